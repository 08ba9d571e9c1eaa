"""A loss spike that comes back after its rollback: the next rung, then the budget, then a stop (issue 34).

A real 2-rank msrun job under ``rankwatch launch`` and a real dashboard in
``SPIKE_MODE=enforce``, as in ``test_rollback_msrun.py``, but the demo's bad
data runs far past what the first rungs skip (``RANKWATCH_DEMO_POISON_STEP``
K:40): rung 1 skips ``SKIP`` batches and lands in bad data again, rung 2 skips
twice as many at half the learning rate and lands in it again, and with
``--max-rollbacks 2`` the third spike ends the run with
``ROLLBACK_EXHAUSTED``: it needs attention. Every wait is for an event; the
timeouts are failure guards.
"""

from __future__ import annotations

import pytest

from app.supervise import policy
from tests.helpers.jobs import DEMO_DATA
from tests.helpers.launch import LaunchJob, enforcing_dashboard, runs_row
from trainer_bridge.rundir import rollbacks

pytestmark = pytest.mark.msrun

K = 20
SKIP = 5
# A periodic set every 5 steps, all kept (MindSpore's keep_checkpoint_max would delete the target).
# The detector's first step is the one after the last finite sample: on a loaded machine several
# steps before K, so the target is the set at 10 or 15.
TRAIN = ["--epochs", "3", "--step-delay", "0.05", "--ckpt-every", "5", "--ckpt-keep", "40"]
FAST = ["--backoff-s", "0.5", "--grace-s", "5", "--max-rollbacks", "2"]


def test_a_spike_that_comes_back_climbs_the_ladder_then_the_budget_ends_the_run(tmp_path):
    run, server = enforcing_dashboard(tmp_path, SKIP)
    try:
        with LaunchJob(run, TRAIN, FAST, env={"RANKWATCH_DEMO_POISON_STEP": f"{K}:40"}, **DEMO_DATA) as job:
            assert job.wait() == policy.ROLLBACK_EXHAUSTED, job.output() + server.log()
    finally:
        server.stop()
    lines, skipped = rollbacks.read_lines(run)
    kinds = [ln.kind for ln in lines]
    assert skipped == 0 and kinds == ["requested", "relaunched"] * 2 + ["requested", "exhausted"], (
        kinds,
        job.output()[-3000:],
    )
    first, second, last = (ln for ln in lines if ln.kind != "requested")
    # Each rung lands in the bad data again (K..K+39), one rung further and twice the skip.
    assert (first.rung, first.skip_batches, second.rung, second.skip_batches) == (1, SKIP, 2, 2 * SKIP)
    assert last.rung == 3 and first.target_step < K and second.target_step < K, lines
    rows = job.rows()
    assert [r["attempt"] for r in rows] == [1, 2, 3], rows
    a, b, c = rows
    assert [r["cause"]["kind"] for r in (a, b)] == ["rollback", "rollback"]
    assert (a["cause"]["rung"], b["cause"]["rung"]) == (1, 2)
    assert "learning-rate scale 0.5" in job.output()
    assert c["end"] == "graceful_stop" and c["supervisor"]["exit_code"] == policy.ROLLBACK_EXHAUSTED, c
    assert "the rollback budget is used up (2 of 2 in this run directory)" in c["supervisor"]["note"]
    # The landing page: the run needs a person, and says why.
    row = runs_row(tmp_path, run)
    assert row["needs_attention"] and row["rollbacks"] == 2, row
    assert "rollback budget is used up" in (row["gave_up"] or ""), row
    assert job.marked() == []
