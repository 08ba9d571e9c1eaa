"""The goodput arithmetic (``app.run.goodput``): kept steps, their wall time, the run's wall time."""

from __future__ import annotations

import math

import pytest

from app.run import goodput

T = 1.7e9


def row(attempt, first, last, started, ended=None, launch=None, **more):
    return {
        "attempt": attempt,
        "launch": launch or f"L{attempt}",
        "first_step": first,
        "last_step": last,
        "started_at": started,
        "ended_at": ended,
        "supervisor": None,
        "downtime": None,
        "restarted_by": None,
        **more,
    }


def test_a_run_without_a_fault_keeps_every_step():
    rows = [row(1, 1, 10, T, T + 12)]
    g = goodput.measure(rows, {"L1": [(s, 1.0) for s in range(1, 11)]}, now=T + 100, running=False)
    assert g["kept_steps"] == 10 and g["steps_lost"] == 0 and g["restarts"] == 0
    assert g["kept_s"] == 10.0 and g["wall_s"] == 12.0
    assert g["goodput"] == round(10 / 12, 4)


def test_steps_trained_again_after_a_resume_are_lost_and_downtime_is_not_kept():
    # Attempt 1 trained 1..25, the set was at step 20: attempt 2 trained 21..40. Steps 21..25 of
    # attempt 1 are lost; the 30 s between its end and attempt 2's first step count in the wall only.
    sup = {"spawned_at": T - 2, "action": "relaunch", "ended_at": T + 26}
    rows = [
        row(1, 1, 25, T, T + 26, supervisor=sup, restarted_by="launch", downtime={"total_s": 3.5}),
        row(2, 21, 40, T + 40, T + 60),
    ]
    times = {"L1": [(s, 1.0) for s in range(1, 26)], "L2": [(s, 1.0) for s in range(21, 41)]}
    g = goodput.measure(rows, times, now=T + 1000, running=False)
    assert goodput.kept_ranges(rows) == [(1, 20, 5), (21, 40, 0)]
    assert g["kept_steps"] == 40 and g["steps_lost"] == 5
    assert g["kept_s"] == 40.0 and g["wall_s"] == 62.0  # from the supervisor's spawn to the last end
    assert g["goodput"] == round(40 / 62, 4)
    assert g["restarts"] == 1 and g["restarts_by_launch"] == 1 and g["downtime_s"] == 3.5
    assert g["automatic_restarts"] == 1
    assert goodput.text(g) == "goodput 64.5% · 1 automatic restart · 5 steps lost · 3.5 s down"
    assert (
        g["text"] == goodput.text(g)
        and g["detail"] == "40 kept steps took 40.0 s of 62.0 s since the first attempt started"
    )


def test_a_heartbeat_point_stands_for_every_step_since_the_previous_one():
    # One point per heartbeat: step 4 (0.5 s a step) covers 1..4, step 10 (2 s) covers 5..10.
    assert goodput.kept_seconds(1, 10, [(4, 0.5), (10, 2.0)]) == 4 * 0.5 + 6 * 2.0
    # Kept up to step 6 only: two steps of the second point.
    assert goodput.kept_seconds(1, 6, [(4, 0.5), (10, 2.0)]) == 4 * 0.5 + 2 * 2.0
    # Steps past the newest point take the attempt's mean step time.
    assert goodput.kept_seconds(1, 12, [(4, 0.5), (10, 2.0)]) == 2.0 + 12.0 + 2 * 1.25
    # Points of steps before the attempt's first (another branch) are not its steps.
    assert goodput.kept_seconds(5, 6, [(3, 9.0), (6, 1.0)]) == 2.0
    # Nothing known: None, not zero; an empty kept range: zero.
    assert goodput.kept_seconds(1, 5, []) is None
    assert goodput.kept_seconds(1, 5, [(3, math.nan), (4, -1.0)]) is None
    assert goodput.kept_seconds(6, 5, [(3, 1.0)]) == 0.0


def test_a_resume_from_an_older_set_than_an_earlier_attempt_also_loses_that_attempts_steps():
    # Attempt 3 resumed from step 5, below attempt 2's first step: attempt 2 is lost entirely.
    rows = [row(1, 1, 10, T, T + 10), row(2, 11, 20, T + 20, T + 30), row(3, 6, 30, T + 40, T + 65)]
    assert goodput.kept_ranges(rows) == [(1, 5, 5), (11, 10, 10), (6, 30, 0)]


def test_an_attempt_that_trained_nothing_and_a_running_run():
    failed = row(2, 11, None, None, launch=None, supervisor={"spawned_at": T + 20, "action": "relaunch"})
    rows = [row(1, 1, 10, T, T + 10), failed]
    g = goodput.measure(rows, {"L1": [(10, 1.0)]}, now=T + 40, running=False)
    # The last line says a relaunch follows: the wall runs to now.
    assert g["wall_s"] == 40.0 and g["kept_s"] == 10.0 and g["restarts"] == 1 and g["steps_lost"] == 0
    live = goodput.measure([row(1, 1, 10, T)], {"L1": [(10, 1.0)]}, now=T + 20, running=True)
    assert live["goodput"] == 0.5


@pytest.mark.parametrize(
    "rows",
    [
        [],
        [row(1, 1, 10, None)],
        [row(1, 1, 10, T, T)],
        [{"attempt": 1, "first_step": "x", "last_step": True, "started_at": "soon", "launch": None}],
    ],
)
def test_what_is_not_known_is_null_never_a_guess(rows):
    g = goodput.measure(rows, {"L1": [(10, 1.0)]}, now=T + 20, running=False)
    assert g["goodput"] is None
    assert goodput.text(g).startswith("goodput not known yet")


def test_the_ratio_is_clamped_to_one():
    # Step times that overlap the wall (a clock step) never make more than all of it.
    g = goodput.measure([row(1, 1, 10, T, T + 5)], {"L1": [(10, 1.0)]}, now=T + 5, running=False)
    assert g["goodput"] == 1.0


@pytest.mark.parametrize(
    ("sup", "said"),
    [
        ({"action": "end", "exit_code": 4, "note": None}, "(exit 4): the restart budget is used up"),
        ({"action": "end", "exit_code": 93, "note": "3 attempts"}, "(exit 93): 3 attempts"),
        ({"action": "end", "exit_code": 1, "note": "a stop was asked"}, None),
        ({"action": "relaunch"}, None),
        ({"action": "record_only", "exit_code": 1}, None),
    ],
)
def test_the_supervisor_gave_up_only_on_its_budget_startup_and_no_progress_rules(sup, said):
    g = goodput.measure([row(1, 1, 10, T, T + 10, supervisor=sup)], {}, now=T + 20, running=False)
    assert (g["gave_up"] is None) if said is None else (said in g["gave_up"])


def test_a_relaunch_by_hand_is_told_apart_from_automatic_restarts():
    # Attempt 1 stopped by its operator and relaunched by hand; attempt 2 relaunched by launch;
    # attempt 4 is Slurm's requeue (its scheduler record counts one restart more).
    slurm = lambda n: {"scheduler": {"kind": "slurm", "job_id": "7", "restart_count": n}}  # noqa: E731
    rows = [
        row(1, 1, 10, T, T + 10),
        row(2, 11, 20, T + 20, T + 30, restarted_by="launch"),
        row(3, 21, 30, T + 40, T + 50, supervisor=slurm(0)),
        row(4, 31, 40, T + 60, T + 70, supervisor=slurm(1)),
    ]
    g = goodput.measure(rows, {}, now=T + 100, running=False)
    assert (g["restarts"], g["automatic_restarts"]) == (3, 2)
    assert g["text"] == "goodput not known yet · 2 automatic restarts · 1 relaunch by hand · 0 steps lost"
    only_by_hand = goodput.measure(rows[:2], {}, now=T + 100, running=False)
    assert only_by_hand["text"] == "goodput not known yet · 1 relaunch by hand · 0 steps lost"
