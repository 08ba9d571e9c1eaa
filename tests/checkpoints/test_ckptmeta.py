"""trainer_bridge.rundir.ckptmeta against files written by real MindSpore.

Every expectation about a good file is checked against what
``mindspore.load_checkpoint`` returns for the same file, so the hand-written
parser cannot drift from MindSpore's format unnoticed. Helpers shared with
test_ckptindex live here because conftest.py belongs to another change.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mindspore import Parameter, Tensor, nn

from trainer_bridge.rundir import ckptmeta
from trainer_bridge.rundir.ckptmeta import MetaCache, read_meta, steps_from_name

REPO = Path(__file__).resolve().parents[2]
APPEND = {"epoch_num": 3, "step_num": 21, "batch_num": 8, "global_step": 21, "rankwatch_request_id": "abc"}


class Small(nn.Cell):
    """Two Dense layers: big enough to have real tensors, small enough to be quick."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(16, 12)
        self.fc2 = nn.Dense(12, 3)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def save_small(path, append_dict=None, fmt="ckpt", **kwargs) -> Path:
    """Save a fresh ``Small`` at ``path`` with MindSpore and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ms.save_checkpoint(
        Small(), str(path), append_dict=dict(append_dict) if append_dict else None, format=fmt, **kwargs
    )
    return path


def loaded_view(path, fmt="ckpt", **kwargs):
    """(params, scalars) as MindSpore itself loads them."""
    loaded = ms.load_checkpoint(str(path), format=fmt, **kwargs)
    params = {
        k: (tuple(v.shape), str(v.dtype), v.nbytes) for k, v in loaded.items() if not isinstance(v, str)
    }
    scalars = {
        k: v if isinstance(v, str) else _item(v)
        for k, v in loaded.items()
        if isinstance(v, str) or v.shape == ()
    }
    return params, scalars


def _item(tensor):
    # asnumpy() refuses bfloat16 with the NumPy installed here, so widen it first.
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.astype(ms.float32)
    return tensor.asnumpy().item()


def meta_view(meta):
    return {p.name: (p.shape, p.dtype, p.bytes) for p in meta.params}, dict(meta.extras)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """One valid file per format, saved once for the module."""
    d = tmp_path_factory.mktemp("ckptmeta")
    no_str = {k: v for k, v in APPEND.items() if not isinstance(v, str)}
    return {
        "ckpt": save_small(d / "net.ckpt", APPEND),
        "safetensors": save_small(d / "net.safetensors", no_str, fmt="safetensors"),
    }


def test_ckpt_matches_load_checkpoint(files):
    meta = read_meta(files["ckpt"], with_params=True)
    assert (meta.status, meta.reason, meta.format) == ("ok", None, "ckpt")
    params, scalars = loaded_view(files["ckpt"])
    assert meta_view(meta) == (params, scalars)
    assert scalars["rankwatch_request_id"] == "abc"
    assert meta.param_count == len(params)
    assert meta.param_bytes == sum(b for _, _, b in params.values())
    assert meta.bytes == files["ckpt"].stat().st_size
    assert (meta.epoch, meta.step, meta.global_step, meta.step_source) == (3, 5, 21, "contents")


def test_safetensors_matches_load_checkpoint(files):
    meta = read_meta(files["safetensors"], with_params=True)
    assert (meta.status, meta.format) == ("ok", "safetensors")
    assert meta_view(meta) == loaded_view(files["safetensors"], fmt="safetensors")
    assert (meta.epoch, meta.step, meta.global_step, meta.step_source) == (3, 5, 21, "contents")


def test_safetensors_cannot_hold_a_str_value(tmp_path):
    """MindSpore refuses str append_dict values in safetensors; the docs of ckptmeta rely on it."""
    with pytest.raises(Exception, match="dtype"):
        save_small(tmp_path / "s.safetensors", {"request_id": "abc"}, fmt="safetensors")


def test_default_read_is_cheap(files):
    meta = read_meta(files["ckpt"])
    assert meta.params is None and meta.param_count == 8  # 4 tensors + 4 numbers; the str is not a tensor
    json.dumps(meta.to_dict(), allow_nan=False)


def test_crc_trailer_is_cut_before_parsing(tmp_path):
    path = save_small(tmp_path / "crc.ckpt", APPEND, crc_check=True)
    assert path.read_bytes()[-17:-10] == b"crc_num"
    meta = read_meta(path, with_params=True)
    assert meta.ok
    assert meta_view(meta) == loaded_view(path, crc_check=True)
    cut = tmp_path / "crc_cut.ckpt"
    cut.write_bytes(path.read_bytes()[:-5])
    assert read_meta(cut).reason == "truncated: the CRC trailer is cut off (12 of 17 bytes)"


def test_split_tensor_is_joined(tmp_path, monkeypatch):
    """Tensors over SLICE_SIZE (512 MiB) are written in chunks; shrink it to get chunks cheaply."""
    monkeypatch.setattr(ms.train.serialization, "SLICE_SIZE", 1)  # KiB
    w = Parameter(Tensor(np.arange(768, dtype=np.float32).reshape(48, 16)), name="w")
    path = tmp_path / "sliced.ckpt"
    ms.save_checkpoint([{"name": "w", "data": w}], str(path), append_dict=dict(APPEND))
    assert path.read_bytes().count(b"\n\x01w\x12") == 3
    assert meta_view(read_meta(path, with_params=True)) == loaded_view(path)

    only = tmp_path / "only.ckpt"
    ms.save_checkpoint([{"name": "w", "data": w}], str(only))
    raw = only.read_bytes()
    cut = tmp_path / "only_cut.ckpt"
    cut.write_bytes(raw[: len(raw) * 2 // 3])  # three equal chunks: drop the last whole one
    assert (
        read_meta(cut).reason == "truncated: tensor 'w' Float32[48, 16] needs 3072 bytes, the file holds 2048"
    )


def test_scalar_types_and_non_finite_values(tmp_path):
    extras = {
        "i": 7,
        "f": 0.25,
        "b": True,
        "inf": float("inf"),
        "long": "r" * 100,
        "bf16": Tensor(np.array(1.5), ms.bfloat16),
        "f16": Tensor(np.array(-2.0), ms.float16),
    }
    path = save_small(tmp_path / "types.ckpt", extras)
    meta = read_meta(path, with_params=True)
    _, scalars = loaded_view(path)
    assert meta.extras == scalars
    assert meta.to_dict()["extras"]["inf"] == "inf"
    json.dumps(meta.to_dict(), allow_nan=False)


def test_encrypted_file_is_recognised(tmp_path):
    path = save_small(tmp_path / "enc.ckpt", APPEND, enc_key=b"0123456789abcdef")
    meta = read_meta(path)
    assert (meta.status, meta.encrypted, meta.param_count) == ("ok", "AES-GCM", None)


def test_mindir(tmp_path):
    net = Small()
    ms.export(
        net, Tensor(np.zeros((1, 16), np.float32)), file_name=str(tmp_path / "net"), file_format="MINDIR"
    )
    meta = read_meta(tmp_path / "net.mindir")
    assert (meta.status, meta.format, meta.step_source) == ("ok", "mindir", None)
    assert meta.extras["producer_name"] == "MindSpore"
    bad = tmp_path / "bad.mindir"
    bad.write_bytes(b"\xff" * 100)
    assert read_meta(bad).status == "corrupt"


def test_step_from_name():
    assert steps_from_name("ckpt_of_rank/3/train-2_40.ckpt") == (2, 40, None)
    assert steps_from_name("x/tft_saved_checkpoints-step_31/rank_1/ttp_rank_1-4_7.ckpt") == (4, 7, 31)
    assert steps_from_name("x/ttp_saved_checkpoints-step_31/rank_1/ttp_rank_1-4_7.ckpt") == (4, 7, 31)
    assert steps_from_name("rank_0/Net_train.ckpt") == (None, None, None)


def test_step_falls_back_to_the_name(tmp_path):
    meta = read_meta(save_small(tmp_path / "train-4_7.ckpt"))
    assert (meta.epoch, meta.step, meta.global_step, meta.step_source) == (4, 7, None, "name")
    ttp = save_small(tmp_path / "tft_saved_checkpoints-step_31" / "rank_1" / "ttp_rank_1-4_7.ckpt")
    meta = read_meta(ttp)
    assert (meta.epoch, meta.step, meta.global_step, meta.step_source) == (4, 7, 31, "name")
    # ModelCheckpoint's append_info gives epoch_num and a cumulative step_num, no batch_num.
    partial = read_meta(save_small(tmp_path / "p-4_7.ckpt", {"epoch_num": 4, "step_num": 31}))
    assert (partial.epoch, partial.step, partial.global_step, partial.step_source) == (4, 7, 31, "contents")
    none = read_meta(save_small(tmp_path / "plain.ckpt"))
    assert (none.epoch, none.step, none.global_step, none.step_source) == (None, None, None, None)


# -- bad files ---------------------------------------------------------------


def test_truncated_inside_a_tensor(files, tmp_path):
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(files["ckpt"].read_bytes()[:200])
    meta = read_meta(cut)
    assert meta.status == "corrupt"
    assert meta.reason.startswith("truncated: tensor 'fc1.weight' needs 768 bytes, ")
    assert meta.bytes == 200


def test_truncated_safetensors(files, tmp_path):
    raw = files["safetensors"].read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(raw[:-10])
    assert read_meta(cut).reason.startswith("truncated: tensor ")
    cut.write_bytes(raw[:40])
    assert read_meta(cut).reason.startswith("truncated: the safetensors header needs ")


@pytest.mark.parametrize(
    "content, ext, reason",
    [
        (b"", ".ckpt", "empty file"),
        (b'{"GracefulExit": 1}', ".ckpt", "not a checkpoint: it looks like JSON"),
        (b"\x93" + random.Random(0).randbytes(4095), ".ckpt", "not a checkpoint: it starts with b'\\x93"),
        (random.Random(1).randbytes(64), ".safetensors", "not a checkpoint: "),
        (b"hello world", ".mindir", "not a MindIR model: "),
    ],
)
def test_bad_content(tmp_path, content, ext, reason):
    path = tmp_path / f"bad{ext}"
    path.write_bytes(content)
    meta = read_meta(path)
    assert meta.status == "corrupt"
    assert meta.reason.startswith(reason), meta.reason


def test_permission_denied_is_reported(files, monkeypatch):
    # Tests run as root, whom chmod 000 does not stop, so simulate EACCES.
    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(ckptmeta, "_open", refuse)
    meta = read_meta(files["ckpt"])
    assert (meta.status, meta.reason) == ("corrupt", "unreadable: permission denied")
    assert meta.bytes == files["ckpt"].stat().st_size


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_permission_denied_for_real(files, tmp_path):
    path = tmp_path / "locked.ckpt"
    path.write_bytes(files["ckpt"].read_bytes())
    path.chmod(0)
    assert read_meta(path).reason == "unreadable: permission denied"


def test_missing_directory_and_fifo(tmp_path):
    assert read_meta(tmp_path / "gone.ckpt").reason == "unreadable: the file vanished"
    (tmp_path / "dir.ckpt").mkdir()
    assert read_meta(tmp_path / "dir.ckpt").reason == "not a checkpoint: not a regular file"
    os.mkfifo(tmp_path / "fifo.ckpt")
    assert read_meta(tmp_path / "fifo.ckpt").reason == "not a checkpoint: not a regular file"


def test_every_truncation_is_corrupt_or_a_clean_prefix(files, tmp_path):
    """A cut between two entries is valid protobuf; anything else must be reported."""
    raw = files["ckpt"].read_bytes()
    full = read_meta(files["ckpt"], with_params=True)
    names = [p.name for p in full.params]
    cut = tmp_path / "cut.ckpt"
    for n in range(1, len(raw)):
        cut.write_bytes(raw[:n])
        meta = read_meta(cut, with_params=True)
        if meta.ok:
            got = [p.name for p in meta.params]
            assert got == names[: len(got)] and len(meta.extras) < len(full.extras), n
        else:
            assert meta.reason.startswith("truncated: "), (n, meta.reason)


# -- fuzzing -----------------------------------------------------------------

_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(
    data=st.one_of(st.binary(max_size=512), st.binary(max_size=512).map(lambda b: b"\n" + b)),
    ext=st.sampled_from([".ckpt", ".safetensors", ".mindir", ".bin"]),
)
def test_fuzz_random_bytes(tmp_path, data, ext):
    path = tmp_path / f"fuzz{ext}"
    path.write_bytes(data)
    meta = read_meta(path, with_params=True)
    assert meta.status in ("ok", "corrupt")
    json.dumps(meta.to_dict(), allow_nan=False)


@_FUZZ
@given(fmt=st.sampled_from(["ckpt", "safetensors"]), data=st.data())
def test_fuzz_damaged_valid_files(files, tmp_path, fmt, data):
    raw = bytearray(files[fmt].read_bytes())
    raw = raw[: data.draw(st.integers(0, len(raw)), label="length")]
    for _ in range(data.draw(st.integers(0, 3), label="flips")):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path / f"fuzz.{fmt}"
    path.write_bytes(bytes(raw))
    meta = read_meta(path, with_params=True)
    assert meta.status in ("ok", "corrupt")
    json.dumps(meta.to_dict(), allow_nan=False)


# -- cache and imports ---------------------------------------------------------


def test_cache_reads_each_version_once(files, tmp_path, monkeypatch):
    path = tmp_path / "c.ckpt"
    path.write_bytes(files["ckpt"].read_bytes())
    cache = MetaCache()
    first = cache.read(path)
    assert cache.read(path) is first and (cache.hits, cache.misses) == (1, 1)

    monkeypatch.setattr(ckptmeta, "read_meta", lambda *a, **k: pytest.fail("an unchanged file was read"))
    assert cache.read(path, os.stat(path)) is first
    monkeypatch.undo()

    path.write_bytes(files["ckpt"].read_bytes()[:100])
    assert cache.read(path).status == "corrupt" and cache.misses == 2


def test_cache_is_bounded(files, tmp_path):
    cache = MetaCache(maxsize=2)
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.ckpt")
        paths[-1].write_bytes(files["ckpt"].read_bytes())
        cache.read(paths[-1])
    assert len(cache) == 2
    cache.read(paths[0])
    assert cache.misses == 4  # the oldest was evicted and read again


def test_modules_do_not_import_mindspore():
    code = (
        "import sys, trainer_bridge.rundir.ckptmeta, trainer_bridge.rundir.ckptindex; "
        "bad = [m for m in ('mindspore', 'google.protobuf', 'numpy') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
