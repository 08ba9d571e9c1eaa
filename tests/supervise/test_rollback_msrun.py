"""A loss-spike rollback end to end: a real 2-rank msrun job under ``rankwatch launch``, a real dashboard.

The demo's global steps K..K+4 are poisoned (``RANKWATCH_DEMO_POISON_STEP``):
from K on its weights and losses are NaN on both ranks. The dashboard, in
``SPIKE_MODE=enforce``, detects it from the heartbeats, writes the pending
request and a ``requested`` line and asks the graceful stop (who = ``policy``);
``rankwatch launch`` rolls back to the newest healthy set before K, skips the
bad batches and trains on to the end. Every wait is for an event; the
timeouts are failure guards.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.helpers.faults import measure
from tests.helpers.jobs import DEMO_DATA
from tests.helpers.launch import LaunchJob, enforcing_dashboard
from trainer_bridge.rundir import rollbacks, runfiles

pytestmark = pytest.mark.msrun

K = 25
SKIP = 5
# 2000 samples, 2 ranks, batch 32: 31 steps an epoch, 93 in all; a periodic set every 10 steps.
TRAIN = ["--epochs", "3", "--step-delay", "0.05", "--ckpt-every", "10"]
FAST = ["--backoff-s", "0.5", "--grace-s", "5"]
MARGIN = 4


def nonfinite_loss(job: LaunchJob, rank: int) -> int | None:
    """The heartbeat's step when its loss is NaN or infinite, however the bridge spells it."""
    try:
        hb = json.loads(runfiles.heartbeat_path(job.run_dir, rank).read_bytes())
    except (OSError, ValueError):
        return None
    loss = hb.get("loss")
    bad = (isinstance(loss, float) and not math.isfinite(loss)) or (
        isinstance(loss, str) and loss.lower() in ("nan", "inf", "-inf")
    )
    return hb.get("global_step") if bad or hb.get("loss_nonfinite") else None


def test_a_nan_from_step_k_is_rolled_back_to_the_last_healthy_set_and_the_bad_batches_skipped(tmp_path):
    run, server = enforcing_dashboard(tmp_path, SKIP)
    try:
        # A margin other than the default: the dashboard must name the set this supervisor takes.
        launch = [*FAST, "--rollback-margin", str(MARGIN)]
        with LaunchJob(run, TRAIN, launch, env={"RANKWATCH_DEMO_POISON_STEP": f"{K}:5"}, **DEMO_DATA) as job:
            seen = job.wait_until(
                lambda: nonfinite_loss(job, 0) or nonfinite_loss(job, 1), "a non-finite loss in a heartbeat"
            )
            assert seen > K
            requested = job.wait_until(
                lambda: [ln for ln in rollbacks.read_lines(run)[0] if ln.kind == "requested"],
                "the dashboard's rollback request",
            )
            t_asked = requested[0].at
            assert job.wait() == 0, job.output() + server.log()
    finally:
        server.stop()
    first = requested[0].first_step
    # The detector's K: the step after the last finite sample, at most the first NaN loss's (K + 1).
    assert first <= K + 1, requested
    rows = job.rows()
    ends = [(r["attempt"], r["end"], (r.get("cause") or {}).get("kind"), r.get("first_step")) for r in rows]
    assert len(rows) == 2, (ends, rollbacks.read_lines(run)[0], job.output()[-3000:])
    a, b = rows
    # The data resumes SKIP batches past the step the NaN was seen at (the bad batch lies up to there).
    data_step = max(first, requested[0].evidence.step) - 1 + SKIP
    # Attempt 1 ended by the stop, rolled back: to the newest healthy set older than the first step
    # minus the margin (the sets at 30 and later hold NaN weights). Which one depends on where the
    # heartbeats sampled the loss: a last finite sample at step 20 makes the first step 21, and the
    # set at 20 is then inside the margin, so the target is 10 (seen on an idle CI machine).
    target = (first - MARGIN - 1) // 10 * 10
    assert target in (10, 20), (first, target)
    published, error = rollbacks.read_settings(run)
    assert error is None and published.margin == MARGIN, published
    assert (requested[0].target_step, requested[0].target_set) == (target, a["supervisor"]["resume"]["set"])
    cause = a["cause"]
    assert a["end"] == "graceful_stop" and a["restarted_by"] == "launch", job.output()
    assert a["stop_by"] == "policy" and a["request_id"]
    assert (cause["kind"], cause["rule"], cause["from_step"], cause["to_step"], cause["skip_batches"]) == (
        "rollback",
        "nonfinite",
        first,
        target,
        SKIP,
    )
    assert (
        cause["rung"] == 1
        and cause["evidence"] == requested[0].evidence.text
        and "nan" in cause["evidence"].lower()
    )
    assert a["supervisor"]["resume"]["global_step"] == target
    if first > 31:  # the periodic set at 30 (NaN weights) was a candidate: named as passed over
        assert "not finite" in a["supervisor"]["note"]
    # Attempt 2: the weights of the target's step, the data from first + SKIP on; the skipped steps are
    # in its start line, never trained, and it trains to the end with a finite loss.
    assert b["resumed_from"]["global_step"] == target and b["skipped"] == [target + 1, data_step]
    assert b["first_step"] == data_step + 1 and b["end"] == "finished"
    steps = job.steps_logged(0)  # msrun's worker log holds the last attempt's, or both attempts' in turn
    restart = max((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), default=0)
    again = steps[restart:]
    assert again[0] == data_step + 1 and again[-1] == 3 * job.steps_per_epoch
    assert not set(again) & set(range(target + 1, data_step + 1))
    for rank in (0, 1):
        hb = json.loads(runfiles.heartbeat_path(run, rank).read_bytes())
        assert hb["global_step"] == 3 * job.steps_per_epoch and math.isfinite(hb["loss"]), hb
    lines, skipped = rollbacks.read_lines(run)
    assert skipped == 0 and [ln.kind for ln in lines] == ["requested", "relaunched"]
    line = lines[1]
    assert (line.target_step, line.skip_batches, line.attempt, line.first_step) == (target, SKIP, 2, first)
    assert rollbacks.read_request(run) == (None, None)
    assert "rolling back to set" in job.output() and job.marked() == []
    sup = a["supervisor"]
    measure("rollback: stop asked to attempt ended", sup["ended_at"] - t_asked, first_step=first)
    measure(
        "rollback: attempt ended to relaunched (the target's choice)", sup["relaunched_at"] - sup["ended_at"]
    )
    measure("rollback: relaunched to the bridge's start", b["started_at"] - sup["relaunched_at"])
