"""The run-directory contract: flag parsing and atomic writes."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer_bridge.rundir import runfiles


@pytest.mark.parametrize(
    "raw, exit_, rid",
    [
        (b'{"GracefulExit": 1}', True, None),
        (b'{"GracefulExit": 1, "request_id": "r1", "reason": "ecc"}', True, "r1"),
        (b'{"GracefulExit": 0, "request_id": "r1"}', False, "r1"),
        (b'{"GracefulExit": "1"}', False, None),  # MindSpore compares with the int 1
        (b'{"GracefulExit": true}', False, None),  # ... and so does a bool, for us
        (b'{"GracefulExit": 1.0}', True, None),  # json 1.0 == 1, as in OnRequestExit
        (b'{"other": 1}', False, None),
        (b'{"GracefulExit": 1, "request_id": 7}', True, None),
    ],
)
def test_parse_flag(raw, exit_, rid):
    flag = runfiles.parse_flag(raw)
    assert (flag.exit, flag.request_id) == (exit_, rid)


@pytest.mark.parametrize("raw", [b"", b'{"GracefulExit": 1', b"[1]", b"\xff\xfe", b"null", b"1"])
def test_parse_flag_rejects_garbage(raw):
    with pytest.raises(runfiles.FlagError):
        runfiles.parse_flag(raw)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_parse_flag_never_raises_anything_but_flag_error(raw):
    try:
        runfiles.parse_flag(raw)
    except runfiles.FlagError:
        pass


def test_read_flag_missing_is_none(tmp_path):
    assert runfiles.read_flag(tmp_path) is None


def test_write_flag_is_native_format_and_leaves_no_temp(tmp_path):
    written = runfiles.write_flag(tmp_path, True, request_id="r9", reason="npu 3")
    data = json.loads(runfiles.flag_path(tmp_path).read_text())
    assert data == written and data["GracefulExit"] == 1
    assert os.listdir(tmp_path) == [runfiles.FLAG_NAME]
    runfiles.write_flag(tmp_path, False)
    assert json.loads(runfiles.flag_path(tmp_path).read_text()) == {"GracefulExit": 0}


def test_atomic_write_failure_keeps_old_file_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "hb.json"
    runfiles.atomic_write_json(target, {"v": 1})

    def broken_replace(src, dst, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError):
        runfiles.atomic_write_json(target, {"v": 2})
    assert json.loads(target.read_text()) == {"v": 1}
    assert os.listdir(tmp_path) == ["hb.json"]


def test_read_json_or_none_tolerates_bad_files(tmp_path):
    (tmp_path / "torn.json").write_text('{"a": ')
    assert runfiles.read_json_or_none(tmp_path / "torn.json") is None
    assert runfiles.read_json_or_none(tmp_path / "missing.json") is None


def test_checkpoint_path_follows_modelcheckpoint_naming(tmp_path):
    p = runfiles.checkpoint_path(tmp_path, 3, 2, 17)
    assert p.relative_to(tmp_path).as_posix() == "checkpoints/rank_3/rankwatch-2_17.ckpt"
