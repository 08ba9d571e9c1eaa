"""``bridge.loop`` under real ``msrun`` with 2 ranks: a functional loop stops, saves, resumes.

The job is ``python -m trainer_bridge.demo --loop`` (``train_loop.py``):
LeNet5 with ``ms.value_and_grad``, ``nn.DistributedGradReducer`` and
``optimizer(grads)``, its rows from ``bridge.loop``. ``--no-shuffle`` makes a
batch's labels (their CRC in the step log) tell its place in the epoch.
"""

from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from tests.helpers.app import AUTH, make_app
from tests.helpers.jobs import BATCH, UNTIL_STOPPED, DemoJob, dump, write_flag
from tests.helpers.spikes import replay
from trainer_bridge.rundir import copies, runfiles
from trainer_bridge.rundir.ckptmeta import read_meta

pytestmark = pytest.mark.msrun

# 160 samples at the tests' batch: 10 steps an epoch, so the relaunch crosses an epoch boundary
# (the same batch again one epoch later) within some 15 steps, not 55.
SAMPLES = 160
PER_EPOCH = SAMPLES // 2 // BATCH  # steps per epoch on each of the 2 ranks
LOOP = ["--loop", "--no-shuffle"]


def _steps(job: DemoJob, rank: int) -> list[tuple[int, str, int]]:
    """``(global step, labels' CRC, optimizer step)`` per step the rank printed."""
    text = job.worker_log(rank)
    return [
        (int(g), crc, int(o))
        for g, crc, o in re.findall(r"^step (\d+) epoch \d+ t \S+ data (\w+) opt_step (\d+)", text, re.M)
    ]


def _assert_read_as_copy(copy, original) -> None:
    """The copy reads ended and copied, no rank dead though the processes its heartbeats name are gone."""
    assert json.loads(runfiles.job_path(original).read_text())["dir_ino"] == copies.dir_ino(original)
    for path, copied in ((copy, True), (original, False)):
        app = make_app(path)
        try:
            run = app.test_client().get("/api/summary", headers=AUTH).get_json()["run"]
            ranks = app.test_client().get("/api/ranks", headers=AUTH).get_json()["ranks"]
        finally:
            app.extensions["rankwatch"].watcher.stop()
        assert run["status"] == "ended" and bool(run.get("copied")) is copied, run
        assert len(ranks) == 2 and not {r["health"] for r in ranks} & {"dead", "stalled", "failed"}, ranks


def test_loop_flag_stops_every_rank_at_one_step_saves_optimizer_state_and_resumes(tmp_path, start_job):
    import mindspore as ms

    run = tmp_path / "run"
    job = start_job(run, epochs=UNTIL_STOPPED, samples=SAMPLES, step_delay=0.05, extra=LOOP)
    job.wait_for_step(4)
    # A copy of the run directory made while it trains (issue 33): its heartbeats name this job's
    # live ranks. cp may miss a temporary file renamed under it (its status 1), as an operator's would.
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-a", str(run), str(copy)], capture_output=True)
    assert runfiles.job_path(copy).is_file() and runfiles.heartbeat_path(copy, 1).is_file()
    write_flag(run, request_id="req-loop-1", reason="test")
    assert job.wait() == 0, job.logs()
    _assert_read_as_copy(copy, run)

    stop_step, stops = job.stopped_together()
    assert all(s["request_id"] == "req-loop-1" for s in stops), dump(stops)
    assert all(set(s["at"]) >= {"agreed", "saving", "saved", "exited"} for s in stops), dump(stops)
    for r in range(2):
        assert "bridge.stopped True" in job.worker_log(r), job.logs()
        assert [g for g, _, _ in _steps(job, r)] == list(range(1, stop_step + 1))

    # Every rank saved network and optimizer state, equal across ranks, at the stop step.
    paths = [run / s["checkpoint"]["path"] for s in stops]
    metas = [read_meta(p) for p in paths]
    assert all(m.ok for m in metas), [m.reason for m in metas]
    assert [m.extras["step_num"] for m in metas] == [stop_step] * 2
    assert [m.extras["rankwatch_request_id"] for m in metas] == ["req-loop-1"] * 2
    assert [m.extras["rankwatch_world_size"] for m in metas] == [2, 2]
    p0, p1 = (ms.load_checkpoint(str(p)) for p in paths)
    assert set(p0) == set(p1)
    assert {"conv1.weight", "fc3.bias", "moments.conv1.weight", "moments.fc3.bias", "global_step"} <= set(p0)
    state = [
        k for k in p0 if not k.startswith("rankwatch_") and k not in ("epoch_num", "step_num", "batch_num")
    ]
    for k in state:  # weights, momentum, learning rate, the optimizer's step
        np.testing.assert_array_equal(p0[k].asnumpy(), p1[k].asnumpy(), err_msg=k)
    assert int(p0["global_step"].asnumpy()[0]) == stop_step  # the optimizer's own step
    assert np.abs(p0["moments.conv1.weight"].asnumpy()).sum() > 0
    # job.json says how to relaunch this job: msrun's own options, and that it is a loop.
    job_json = json.loads(runfiles.job_path(run).read_text())
    assert job_json["front_end"] == "loop"
    assert "mindspore.parallel.cluster.run" in job_json["launcher_argv"]
    assert f"--log_dir={run / 'msrun_logs'}" in job_json["launcher_argv"]
    assert any(a.startswith("--master_port=") for a in job_json["launcher_argv"])

    # Relaunch with the served flag still up: resume at the next step, on the
    # same data position, with the optimizer's state, and train to the end.
    first = {r: {(g - 1) % PER_EPOCH: crc for g, crc, _ in _steps(job, r)} for r in range(2)}
    assert runfiles.read_flag(run).exit
    epochs = job.epochs_past(stop_step)
    again = start_job(run, epochs=epochs, samples=SAMPLES, step_delay=0.0, extra=LOOP)
    assert again.wait() == 0, again.logs()
    for r in range(2):
        steps = _steps(again, r)  # msrun rewrote the worker logs
        assert steps[0][0] == stop_step + 1 and steps[-1][0] == epochs * PER_EPOCH, steps[:3]
        assert steps[0][2] == stop_step + 1  # the optimizer's step went on from the checkpoint's
        # Each batch sits where the uninterrupted run had it: the first run's
        # batch at each position, and one epoch later the same batch again.
        crc_at = {g: crc for g, crc, _ in steps}
        for g, crc in crc_at.items():
            position = (g - 1) % PER_EPOCH
            if position in first[r]:
                assert crc == first[r][position], (r, g)
            if g + PER_EPOCH in crc_at:
                assert crc == crc_at[g + PER_EPOCH], (r, g)
        assert "bridge.stopped False" in again.worker_log(r)
        # bridge.epoch (printed by the demo) is the epoch each global step is in, resumed or not.
        printed = re.findall(r"^step (\d+) epoch (\d+) ", again.worker_log(r), re.M)
        assert printed and all(int(e) == (int(g) - 1) // PER_EPOCH + 1 for g, e in printed), printed[:5]
        hb = again.heartbeat(r)
        assert hb["state"] == "finished" and hb["stop"] is None, dump(hb)
        assert hb["resumed_from"]["global_step"] == stop_step
    # No false alarm: the loss-spike detector, with its defaults, over the whole run (issue 34).
    found, judged = replay(run, 2)
    assert found == [] and judged >= 4, (found, judged)
