"""The bridge under real ``msrun`` with 2 ranks: stop, agree, save, exit, resume."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from tests.helpers.jobs import UNTIL_STOPPED, dump, write_flag
from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.ckptmeta import read_meta

pytestmark = pytest.mark.msrun

# 160 samples at the tests' batch: 10 steps an epoch on each of the 2 ranks, so the relaunch that trains "to the end"
# (into the epoch after the next, to cross an epoch boundary) trains some 15 steps, not 55.
SAMPLES = 160


def _stopped(hbs):
    return hbs if all(h and h["state"] == "exited" for h in hbs) else None


def test_flag_stops_every_rank_at_one_step_then_resume_ignores_the_served_flag(tmp_path, start_job):
    import mindspore as ms

    run = tmp_path / "run"
    job = start_job(run, epochs=UNTIL_STOPPED, samples=SAMPLES)
    job.wait_for_step(4)
    write_flag(run, request_id="req-stop-1", reason="test")
    assert job.wait() == 0, job.logs()

    # Each rank ran exactly up to the agreed step, no further.
    stop_step, stops = job.stopped_together()
    assert stop_step >= 4, dump(stops)
    assert all(s["request_id"] == "req-stop-1" for s in stops), dump(stops)
    assert all(set(s["at"]) >= {"agreed", "saving", "saved", "exited"} for s in stops), dump(stops)

    paths = [run / s["checkpoint"]["path"] for s in stops]
    metas = [read_meta(p) for p in paths]
    assert all(m.ok for m in metas), [m.reason for m in metas]
    assert [m.extras["step_num"] for m in metas] == [stop_step, stop_step]
    assert [m.global_step for m in metas] == [stop_step, stop_step]
    assert [m.extras["rankwatch_request_id"] for m in metas] == ["req-stop-1"] * 2
    # Data parallelism: after the same steps, every rank holds the same weights.
    p0, p1 = (ms.load_checkpoint(str(p)) for p in paths)
    weights = [k for k in p0 if k.startswith(("conv", "fc"))]
    assert weights
    for k in weights:
        np.testing.assert_array_equal(p0[k].asnumpy(), p1[k].asnumpy(), err_msg=k)

    # Relaunch with the same flag still saying GracefulExit 1: resume at the
    # next step and run to the end, because that request was already served.
    assert runfiles.read_flag(run).exit
    epochs = job.epochs_past(stop_step)
    again = start_job(run, epochs=epochs, samples=SAMPLES)
    assert again.wait() == 0, again.logs()
    for r in range(2):
        resumed = again.steps_logged(r)  # msrun rewrote the worker logs
        assert resumed[0] == stop_step + 1, resumed
        hb = again.heartbeat(r)
        assert hb["state"] == "finished" and hb["stop"] is None, dump(hb)
        assert hb["resumed_from"]["global_step"] == stop_step
        assert hb["global_step"] == resumed[-1] == epochs * again.steps_per_epoch

    # A relaunch whose resume point is past the epochs it asks for (1 step per epoch here,
    # 1 epoch, and the set is at stop_step >= 4) ends cleanly instead of Model.train's
    # "epoch must bigger than initial_epoch" (issue 17): it says so and reports finished.
    past = start_job(run, epochs=1, samples=16)
    assert past.wait() == 0, past.logs()
    for r in range(2):
        log = past.worker_log(r)
        assert f"resumed at global step {stop_step}, past the 1 epochs asked for: nothing to train" in log, (
            log
        )
        assert "initial_epoch" not in log and past.steps_logged(r) == []
        hb = past.heartbeat(r)
        assert hb["state"] == "finished" and hb["resumed_from"]["global_step"] == stop_step, dump(hb)


def test_sigterm_to_one_rank_stops_every_rank_gracefully(tmp_path, start_job):
    run = tmp_path / "run"
    job = start_job(run, epochs=UNTIL_STOPPED)
    hbs = job.wait_for_step(4)
    os.kill(hbs[1]["pid"], signal.SIGTERM)
    assert job.wait() == 0, job.logs()
    hbs = job.heartbeats()
    assert _stopped(hbs), dump(hbs)
    stops = [h["stop"] for h in hbs]
    assert stops[0]["stop_step"] == stops[1]["stop_step"], dump(stops)
    assert stops[1]["source"] == "sigterm" and stops[1]["seen_step"] is not None
    assert stops[0]["seen_step"] is None  # rank 0 learnt of it only through the vote
    for s in stops:
        assert read_meta(run / s["checkpoint"]["path"]).global_step == s["stop_step"]


def test_corrupt_flag_neither_stops_nor_crashes_training(tmp_path, start_job, start_dash):
    """A torn and a garbage flag are logged and ignored; training goes on, and a valid flag still stops it.

    The job trains until stopped, and each step waits for the bridge's own
    log line: a one-epoch job could end on a fast machine before the
    reporter's next poll, and then there would be nothing to check.
    """
    from tests.helpers.faults import poll_until

    run = tmp_path / "run"
    job = start_job(run, epochs=50)
    dash = start_dash(run, tmp_path / "dashboard.log")
    errors = []

    def logged(times):
        return poll_until(
            lambda: job.worker_log(0).count("ignoring unreadable stop flag") >= times,
            f"rank 0 to log the unreadable flag ({times})",
        )

    job.wait_for_step(2)
    runfiles.flag_path(run).write_bytes(b'{"GracefulExit": 1, "req')  # a torn write
    # The dashboard says the flag is unreadable (and does not call it a request).
    errors.append(
        dash.wait(
            lambda body: body if body["flag_error"] else None,
            "GET /api/exit to report the torn flag",
            path="/api/exit",
        )
    )
    logged(1)
    hbs = job.wait_for_step(max(h["global_step"] for h in job.heartbeats()) + 2)
    runfiles.flag_path(run).write_bytes(b"\xff\xfe" + os.urandom(62))  # garbage from another tool
    errors.append(
        dash.wait(
            lambda body: (
                body if body["flag_error"] and body["flag_error"] != errors[0]["flag_error"] else None
            ),
            "GET /api/exit to report the garbage flag",
            path="/api/exit",
        )
    )
    logged(2)
    # Still training past both, and never stopping for them.
    job.wait_for_step(max(h["global_step"] for h in job.heartbeats()) + 2)
    assert all(h["state"] == "training" and h["stop"] is None for h in job.heartbeats()), dump(hbs)
    write_flag(run, "after-garbage")
    assert job.wait() == 0, job.logs()
    for body in errors:
        assert body["flag_error"].startswith("flag file is not valid JSON"), body
        assert body["flag"] is None and body["state"] == "idle" and body["request"] is None, body
    _, stops = job.stopped_together()
    assert {s["request_id"] for s in stops} == {"after-garbage"}, dump(stops)
