"""Issue 18: retention ``on`` while a real 2-rank msrun job saves periodic sets.

The demo saves a ModelCheckpoint set every few steps (MindSpore's own
``keep_checkpoint_max`` set high, as the docs advise); the dashboard's
watcher ticks in this process with ``RETENTION_MODE=on``. Shown, from the
audit trail and the index: sets are collected as the job trains, the
graceful-stop set and the set the bridge resumes from survive, and a
relaunch resumes from that set.
"""

from __future__ import annotations

import time

import pytest

from app import create_app
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.jobs import JOB_TIMEOUT_S, DemoJob, write_flag
from trainer_bridge.rundir import ckptindex
from trainer_bridge.rundir.ckptpaths import ORIGIN_BRIDGE, ORIGIN_PERIODIC

pytestmark = pytest.mark.msrun

EVERY = 3
KEEP = 2


def policy_deletions(rw) -> list[dict]:
    return [r for r in rw.checkpoints.audit.rows() if r["action"] == "delete" and r["who"] == "policy"]


def tick_until(rw, job: DemoJob | None, predicate, what: str, timeout: float = JOB_TIMEOUT_S):
    """Run the dashboard's watcher tick until ``predicate()`` holds (an event, never a duration)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rw.watcher.tick()
        value = predicate()
        if value:
            return value
        if job is not None and job.proc.poll() not in (None, 0):
            raise AssertionError(f"the job failed before {what}\n{job.logs()}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}" + (f"\n{job.logs()}" if job else ""))


def test_retention_on_while_a_real_job_saves(tmp_path, start_job):
    run = tmp_path / "run"
    run.mkdir()
    app = create_app(
        {
            "RUN_DIR": str(run),
            "TESTING": True,
            **FAST_SETTINGS,
            "CHECKPOINT_SCAN_S": 0.2,
            "RETENTION_MODE": "on",
            "RETENTION_KEEP": KEEP,
            "RETENTION_SETTLE_S": 1.0,
        }
    )
    rw = app.extensions["rankwatch"]
    extra = ["--ckpt-every", str(EVERY), "--ckpt-keep", "1000"]
    job = start_job(run, epochs=40, step_delay=0.05, extra=extra)
    # Sets are collected as the job trains: the policy deleted some while ranks still step.
    tick_until(rw, job, lambda: len(policy_deletions(rw)) >= 3, "three periodic sets collected")
    hbs = job.heartbeats()
    assert all(h and h["state"] == "training" for h in hbs), hbs
    index = ckptindex.scan(run, 2)
    periodic = [s for s in index.sets if s.origin == ORIGIN_PERIODIC]
    # The newest set may still be being written (one rank's file there, the other's not yet: a
    # loaded machine caught it). What retention promises is the newest KEEP complete sets.
    in_flight = next((i for i, s in enumerate(periodic) if s.complete), len(periodic))
    assert in_flight <= 1, [(s.id, s.ranks_missing) for s in periodic]
    kept = periodic[in_flight : in_flight + KEEP]
    assert len(kept) == KEEP and all(s.complete for s in kept), [(s.id, s.ranks_missing) for s in periodic]
    for row in policy_deletions(rw):
        assert "delete:" in row["reason"] and '"bytes"' in row["detail"]

    # A graceful stop: its set is kept, and it is the one the bridge resumes from.
    write_flag(run, request_id="req-retention", reason="retention test")
    assert job.wait() == 0, job.logs()
    stop_step, _ = job.stopped_together()
    stop_set = tick_until(
        rw,
        None,
        lambda: next(
            (s for s in ckptindex.scan(run, 2).sets if s.origin == ORIGIN_BRIDGE and s.complete), None
        ),
        "the stop set",
    )
    assert stop_set.global_step == stop_step
    # The bridge recorded each rank's loss as finite in the set (the health evidence).
    assert [f.meta.extras.get("rankwatch_loss_finite") for f in stop_set.files] == [1, 1]
    assert next(s for s in rw.checkpoints.body(2)["sets"] if s["id"] == stop_set.id)["unhealthy"] is None
    plan = rw.checkpoints.retention.plan(2, {})
    why = {e.id: e.why for e in plan.entries}
    assert why[stop_set.id] == "kept: the bridge resumes from it"
    # Retention has run past the stop: only the newest KEEP periodic sets (plus milestones: none) remain.
    tick_until(
        rw,
        None,
        lambda: len([s for s in ckptindex.scan(run, 2).sets if s.origin == ORIGIN_PERIODIC]) <= KEEP,
        "retention to catch up after the stop",
    )
    index = ckptindex.scan(run, 2)
    assert stop_set.id in {s.id for s in index.sets}
    assert all(s.complete for s in index.sets), [(s.id, s.ranks_missing) for s in index.sets]

    # The relaunch resumes from the stop set, which retention kept.
    again = start_job(run, epochs=40, step_delay=0.05, extra=extra)
    # Past S+1: the bridge's heartbeat for a step can be written before that step's log line (both are
    # step-end callbacks), so the line of S+1 is sure to be in the log only once S+2 has begun.
    hbs = again.wait_until(
        lambda hbs: (
            hbs
            if all(h and h.get("resumed_from") and h["global_step"] >= stop_step + 2 for h in hbs)
            else None
        ),
        "every rank resumed and stepping",
    )
    assert all(h["resumed_from"]["global_step"] == stop_step for h in hbs), hbs
    assert again.steps_logged(0)[0] == stop_step + 1
    rw.watcher.stop()
