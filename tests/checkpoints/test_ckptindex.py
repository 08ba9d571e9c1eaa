"""trainer_bridge.rundir.ckptindex on a run directory filled by real MindSpore.

One module-scoped run directory holds every layout: a real ``Model.train``
with two ``ModelCheckpoint`` callbacks (ranks 0 and 1) and ``OnRequestExit``
stopping it through the flag file, plus TTP and bridge layouts written with
``save_checkpoint`` at the paths those tools use, plus damaged files and
things the walk must skip.
"""

from __future__ import annotations

import json
import os
import signal

import mindspore as ms
import mindspore.dataset as mds
import pytest
from mindspore import nn
from mindspore.train import Callback, CheckpointConfig, Model, ModelCheckpoint, OnRequestExit

from tests.helpers.checkpoints import Small, _Samples, save_small
from trainer_bridge.rundir import ckptindex, ckptmeta, runfiles
from trainer_bridge.rundir.ckptindex import scan
from trainer_bridge.rundir.ckptmeta import MetaCache
from trainer_bridge.rundir.ckptpaths import (
    ORIGIN_BRIDGE,
    ORIGIN_NATIVE,
    ORIGIN_PERIODIC,
    ORIGIN_TTP,
    classify,
)

STEPS_PER_EPOCH = 8
FLAG_AFTER_STEP = 5  # OnRequestExit sees the flag at the next step's start and saves at its end


class _RaiseFlag(Callback):
    def __init__(self, flag):
        self.flag = flag

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == FLAG_AFTER_STEP:
            self.flag.write_text(json.dumps({"GracefulExit": 1}))


def _train(run):
    """A real short training run that leaves periodic and OnRequestExit checkpoints."""
    data = mds.GeneratorDataset(_Samples(), ["x", "y"], shuffle=False).batch(2)
    net = Small()
    model = Model(
        net,
        nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
        nn.Momentum(net.trainable_params(), 0.01, 0.9),
    )
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10)
    callbacks = [
        ModelCheckpoint(prefix="train", directory=str(run / "ckpt_of_rank" / str(r)), config=config)
        for r in (0, 1)
    ]
    callbacks += [
        _RaiseFlag(run / runfiles.FLAG_NAME),
        OnRequestExit(file_name="LeNet", directory=str(run), config_file=str(run / runfiles.FLAG_NAME)),
    ]
    model.train(2, data, callbacks=callbacks, dataset_sink_mode=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    sigterm = signal.getsignal(signal.SIGTERM)  # OnRequestExit installs its own handler
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MS_ENABLE_GRACEFUL_EXIT", "1")  # read when Model builds the train cell
        try:
            _train(run)
        finally:
            signal.signal(signal.SIGTERM, sigterm)
    # Single process, so OnRequestExit wrote rank_0 only; rank 1 gets a copy made by MindSpore.
    native0 = run / "rank_0" / "LeNet_train.ckpt"
    (run / "rank_1").mkdir()
    ms.save_checkpoint(ms.load_checkpoint(str(native0)), str(run / "rank_1" / "LeNet_train.ckpt"))
    (run / "ckpt_of_rank" / "1" / "train-1_2.ckpt").unlink()

    ttp = run / "ttp_checkpoints"
    for g, epoch, step, ranks in [(12, 2, 4, (0, 1)), (20, 3, 4, (0,))]:
        for r in ranks:
            save_small(
                ttp / f"tft_saved_checkpoints-step_{g}" / f"rank_{r}" / f"ttp_rank_{r}-{epoch}_{step}.ckpt",
                {
                    "epoch_num": epoch,
                    "step_num": g,
                    "cur_rank": r,
                    "batch_num": STEPS_PER_EPOCH,
                    "global_step": g,
                },
            )
    save_small(ttp / "ttp_saved_checkpoints-step_28_tmp" / "rank_0" / "ttp_rank_0-4_4.ckpt")

    for g in (3, 6):
        for r in (0, 1):
            save_small(
                runfiles.checkpoint_path(run, r, 1, g),
                {
                    "epoch_num": 1,
                    "step_num": g,
                    "batch_num": STEPS_PER_EPOCH,
                    "global_step": g,
                    "rankwatch_request_id": f"req-{g}",
                },
            )
    torn = runfiles.checkpoint_path(run, 1, 1, 3)
    data = torn.read_bytes()
    torn.chmod(0o600)
    torn.write_bytes(data[:300])

    bad = run / "bad" / "rank_0"
    bad.mkdir(parents=True)
    (bad / "zero-1_1.ckpt").write_bytes(b"")
    (bad / "random-1_1.ckpt").write_bytes(b"\x93" + os.urandom(2000))
    (bad / "json-1_1.ckpt").write_bytes(b'{"GracefulExit": 1}')

    # Things the walk must skip.
    save_small(run / runfiles.STATE_DIR / "x.ckpt")
    save_small(run / runfiles.CHECKPOINT_DIR / "rank_0" / ".rankwatch-1_9.ckpt")
    (run / "src_pipeline_strategy").mkdir()
    (run / "src_pipeline_strategy" / "src_strategy_0.ckpt").write_bytes(b"\x08\x01")
    outside = tmp_path_factory.mktemp("outside")
    save_small(outside / "rank_0" / "leak-1_1.ckpt")
    (run / "linked").symlink_to(outside, target_is_directory=True)
    (run / "alias.ckpt").symlink_to(runfiles.checkpoint_path(run, 0, 1, 6))
    return run


def _sets(index, origin):
    return {
        s.global_step if s.global_step is not None else (s.epoch, s.step): s
        for s in index.sets
        if s.origin == origin
    }


def test_layouts_and_completeness(run):
    index = scan(run, world_size=2)
    assert not index.errors

    native = _sets(index, ORIGIN_NATIVE)
    assert list(native) == [FLAG_AFTER_STEP + 1]
    s = native[FLAG_AFTER_STEP + 1]
    assert (s.complete, s.ranks_present, s.epoch, s.step) == (True, (0, 1), 1, FLAG_AFTER_STEP + 1)
    assert s.layout == "rank_{rank}/LeNet_train.ckpt"

    periodic = {
        k: v for k, v in _sets(index, ORIGIN_PERIODIC).items() if v.layout.startswith("ckpt_of_rank/")
    }
    assert sorted(periodic) == [2, 4, 6]
    assert periodic[6].complete and periodic[4].complete
    assert (periodic[2].complete, periodic[2].ranks_missing) == (False, (1,))
    assert periodic[4].layout == "ckpt_of_rank/{rank}/train-{E}_{S}.ckpt"
    assert [(f.path, f.rank, f.meta.step_source) for f in periodic[4].files] == [
        ("ckpt_of_rank/0/train-1_4.ckpt", 0, "contents"),
        ("ckpt_of_rank/1/train-1_4.ckpt", 1, "contents"),
    ]

    ttp = _sets(index, ORIGIN_TTP)
    assert sorted(ttp) == [12, 20]
    assert (ttp[12].complete, ttp[12].epoch, ttp[12].step) == (True, 2, 4)
    assert (ttp[20].complete, ttp[20].ranks_missing) == (False, (1,))

    bridge = _sets(index, ORIGIN_BRIDGE)
    assert sorted(bridge) == [3, 6]
    assert bridge[6].complete
    assert bridge[6].layout == "checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt"
    torn = bridge[3]
    assert (torn.complete, torn.ranks_present, torn.ranks_missing, torn.ranks_corrupt) == (
        False,
        (0,),
        (1,),
        (1,),
    )
    assert torn.files[1].meta.reason.startswith("truncated: tensor ")
    assert (torn.files[1].meta.epoch, torn.files[1].meta.step, torn.files[1].meta.step_source) == (
        1,
        3,
        "name",
    )
    assert torn.file_for(0).path == "checkpoints/rank_0/rankwatch-1_3.ckpt" and torn.file_for(1) is None


def test_sets_are_newest_first(run):
    index = scan(run, world_size=2)
    steps = [s.global_step for s in index.sets if s.global_step is not None]
    assert steps == sorted(steps, reverse=True)
    assert index.newest_complete.origin == ORIGIN_TTP and index.newest_complete.global_step == 12


def test_world_size_defaults_to_the_ranks_seen(run):
    index = scan(run)
    assert {s.layout.split("/")[0]: s.world_size for s in index.sets} == {
        "rank_{rank}": 2,
        "ckpt_of_rank": 2,
        "ttp_checkpoints": 2,
        "checkpoints": 2,
        "bad": 1,
    }
    assert _sets(index, ORIGIN_BRIDGE)[6].complete
    assert not _sets(scan(run, world_size=3), ORIGIN_BRIDGE)[6].complete


def test_skipped_and_other_files(run):
    index = scan(run, world_size=2)
    paths = {f.path for s in index.sets for f in s.files} | {f.path for f in index.other_files}
    assert not [
        p
        for p in paths
        if p.startswith(("rankwatch/", "linked/", "src_pipeline_strategy/"))
        or "_tmp" in p
        or "/." in p
        or p == "alias.ckpt"
    ]
    assert [f.path for f in index.other_files] == ["rank_0/LeNet_train.mindir"]
    assert index.other_files[0].origin == ORIGIN_NATIVE


def test_bad_files_do_not_break_the_scan(run):
    index = scan(run, world_size=2)
    bad_sets = [s for s in index.sets if s.layout.startswith("bad/")]
    assert {(s.epoch, s.step, s.complete) for s in bad_sets} == {(1, 1, False)} and len(bad_sets) == 3
    bad = {f.path: f.meta.reason for s in bad_sets for f in s.files}
    assert bad == {
        "bad/rank_0/zero-1_1.ckpt": "empty file",
        "bad/rank_0/json-1_1.ckpt": "not a checkpoint: it looks like JSON",
        "bad/rank_0/random-1_1.ckpt": "not a checkpoint: it starts with "
        + repr((run / "bad/rank_0/random-1_1.ckpt").read_bytes()[:8]),
    }


def test_to_dict_is_the_api_shape(run):
    body = scan(run, world_size=2).to_dict()
    json.dumps(body, allow_nan=False)
    assert body["newest_complete"] == (
        "ttp_checkpoints/tft_saved_checkpoints-step_{G}/rank_{rank}/ttp_rank_{rank}-{E}_{S}.ckpt#g12"
    )
    s = next(s for s in body["sets"] if s["origin"] == ORIGIN_BRIDGE and s["global_step"] == 6)
    assert s["complete"] is True and s["ranks_missing"] == []
    assert s["files"][0] == {
        "path": "checkpoints/rank_0/rankwatch-1_6.ckpt",
        "rank": 0,
        "bytes": s["files"][0]["bytes"],
        "format": "ckpt",
        "mtime": s["files"][0]["mtime"],
        "epoch": 1,
        "step": 6,
        "global_step": 6,
        "status": "ok",
        "reason": None,
        "step_source": "contents",
    }


def test_the_newest_complete_sets_by_origin(run):
    complete = [s for s in scan(run, world_size=2).sets if s.complete]
    s = next(s for s in complete if s.origin == ORIGIN_BRIDGE)
    assert (s.origin, s.global_step) == (ORIGIN_BRIDGE, 6)
    assert s.file_for(1).abspath == str(runfiles.checkpoint_path(run, 1, 1, 6))
    assert complete[0].origin == ORIGIN_TTP  # the newest of any origin
    assert not any(s.complete for s in scan(run, world_size=3).sets if s.origin == ORIGIN_BRIDGE)


def test_second_scan_only_stats(run, monkeypatch):
    cache = MetaCache()
    first = scan(run, world_size=2, cache=cache)
    monkeypatch.setattr(
        ckptmeta, "read_meta", lambda *a, **k: pytest.fail("an unchanged file was read again")
    )
    second = scan(run, world_size=2, cache=cache)
    assert [s.id for s in second.sets] == [s.id for s in first.sets]
    assert cache.hits == first.file_count


def test_unlistable_directory_is_reported(run, monkeypatch):
    real = os.open

    # Each folder is opened (then listed through its descriptor): refuse that open, as a
    # folder without read permission would (the tests run as root, whom chmod does not stop).
    def open_(path, *args, **kwargs):
        if isinstance(path, str) and os.path.basename(path) == "ttp_checkpoints":
            raise PermissionError(13, "Permission denied", path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckptindex.os, "open", open_)
    index = scan(run, world_size=2)
    assert index.errors == ("cannot list ttp_checkpoints: permission denied",)
    assert not _sets(index, ORIGIN_TTP)


def test_missing_run_dir(tmp_path):
    index = scan(tmp_path / "nope")
    assert index.sets == () and "does not exist" in index.errors[0]


@pytest.mark.parametrize(
    "path, origin, rank, layout",
    [
        (
            "checkpoints/rank_3/rankwatch-2_7.ckpt",
            ORIGIN_BRIDGE,
            3,
            "checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt",
        ),
        (
            "out/checkpoints/rank_3/rankwatch-2_7.ckpt",
            ORIGIN_PERIODIC,
            3,
            "out/checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt",
        ),
        ("rank_2/Net_eval.ckpt", ORIGIN_NATIVE, 2, "rank_{rank}/Net_eval.ckpt"),
        (
            "a/tft_saved_checkpoints-step_9/rank_1/ttp_rank_1-1_9.ckpt",
            ORIGIN_TTP,
            1,
            "a/tft_saved_checkpoints-step_{G}/rank_{rank}/ttp_rank_{rank}-{E}_{S}.ckpt",
        ),
        (
            "ckpt/device_5/net-1_2.safetensors",
            ORIGIN_PERIODIC,
            5,
            "ckpt/device_{rank}/net-{E}_{S}.safetensors",
        ),
        ("ckpt/rank7/net-1_2.ckpt", ORIGIN_PERIODIC, 7, "ckpt/rank{rank}/net-{E}_{S}.ckpt"),
        ("ckpt_of_rank/12/train-1_2.ckpt", ORIGIN_PERIODIC, 12, "ckpt_of_rank/{rank}/train-{E}_{S}.ckpt"),
        ("data/12/train-1_2.ckpt", ORIGIN_PERIODIC, 0, "data/12/train-{E}_{S}.ckpt"),
        ("model.ckpt", ORIGIN_PERIODIC, 0, "model.ckpt"),
    ],
)
def test_classify(path, origin, rank, layout):
    assert classify(tuple(path.split("/"))) == (origin, rank, layout)
