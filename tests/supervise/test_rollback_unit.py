"""The enforce half of the loss-spike ladder without MindSpore: the target, the rung, the budget, the record.

The real 2-rank job is in test_rollback_msrun.py.
"""

from __future__ import annotations

import json
import time

from app.supervise import policy, rollback
from app.supervise.cause import describe
from tests.helpers.checkpoints import nan_set, periodic, sid
from trainer_bridge.rundir import rollbacks, runfiles


def request(
    first_step: int, skip: int = 20, rung: int = 1, asked_at: float | None = None
) -> rollbacks.Request:
    ev = rollbacks.Evidence(rule="nonfinite", rank=1, step=first_step + 3, value="nan", ranks=2)
    return rollbacks.Request(
        rule="nonfinite",
        evidence=ev,
        first_step=first_step,
        skip_batches=skip,
        rung=rung,
        asked_at=time.time() if asked_at is None else asked_at,
    )


class Said(list):
    def __call__(self, text: str) -> None:
        self.append(text)


def test_the_target_is_the_newest_finite_set_before_the_spike_and_the_nan_breakpoint_is_refused(run_dir):
    for step in (10, 20):
        periodic(run_dir, step)
    nan_set(run_dir, 30)  # a periodic save after the weights went NaN: no name or flag says so
    # MindSpore's exception_save: the newest file on disk, NaN weights, named *_breakpoint.ckpt.
    nan_set(run_dir, 41, name="net-1_{s}_breakpoint.ckpt")
    periodic(run_dir, 50)  # after the spike: never a target, healthy or not
    req = request(first_step=45)
    rollbacks.write_request(run_dir, req)
    said = Said()
    d = rollback.decide(
        str(run_dir), 2, rollback.pending(str(run_dir), req.asked_at - 1, said), rollback.Settings(), said
    )
    assert d.code is None and d.resume == {"set": sid(20), "global_step": 20}
    assert "breakpoint" in d.said and "not finite" in d.said
    assert d.env == {
        runfiles.RESUME_STEP_ENV: "20",
        rollbacks.SKIP_FROM_ENV: "48",
        rollbacks.SKIP_BATCHES_ENV: "20",
    }
    # The bridge's rule: the data (and the step count) resume at 48 - 1 + 20, counted from the
    # step the NaN was seen at (first step 45 + 3): the bad batch may lie anywhere up to there.
    assert rollback.data_step(d.env) == 67
    assert d.cause == {
        "kind": "rollback",
        "rule": "nonfinite",
        "evidence": "nonfinite: rank 1 at global step 48: nan",
        "from_step": 45,
        "skip_batches": 20,
        "rung": 1,
        "to_set": sid(20),
        "to_step": 20,
    }
    assert describe(d.cause) == (
        "loss-spike rollback (nonfinite): nonfinite: rank 1 at global step 48: nan; from global step 45 back "
        f"to global step 20 (set {sid(20)}), 20 batches skipped past it"
    )
    assert rollback.confirm(str(run_dir), 2, d, rollback.Settings(), req, said) is None
    rollback.committed(str(run_dir), d, 2, said)
    (line,) = rollbacks.read_lines(run_dir)[0]
    assert (line.kind, line.target_step, line.target_set, line.skip_batches, line.attempt) == (
        "relaunched",
        20,
        sid(20),
        20,
        2,
    )
    assert rollbacks.read_request(run_dir) == (None, None)
    # A request that is there no more: the next stop is an ordinary stop.
    assert rollback.pending(str(run_dir), 0, said) is None


def test_the_margin_and_mindformers_health_file_and_the_detectors_record(run_dir):
    for step in (10, 20, 30):
        periodic(run_dir, step)
    s = rollback.Settings(margin=10)
    d = rollback.decide(str(run_dir), 2, request(first_step=38), s, Said())
    assert d.resume["global_step"] == 20  # 30 is not older than 38 - 10
    # MindFormers marks rank 0's file of set 20 unhealthy.
    (run_dir / "health_ckpts.json").write_text(json.dumps([{"is_health": 1, "ckpt_name": "net-1_20.ckpt"}]))
    d = rollback.decide(str(run_dir), 2, request(first_step=38), s, Said())
    assert d.resume["global_step"] == 10 and "health_ckpts.json" in d.said
    (run_dir / "health_ckpts.json").unlink()
    # The detector recorded a spike over steps 18-22 (observe mode): set 20 was saved inside it.
    ev = rollbacks.Evidence(rule="spike", rank=0, step=22, value=9.5, level=1.2)
    rollbacks.append(
        run_dir, rollbacks.Line(kind="observed", at=time.time(), rule="spike", evidence=ev, first_step=18)
    )
    d = rollback.decide(str(run_dir), 2, request(first_step=38), s, Said())
    assert d.resume["global_step"] == 10 and "in a spike the detector recorded (global steps 18-22)" in d.said


def test_a_target_deleted_during_the_rollback_gives_way_to_the_next_and_none_left_is_refused(run_dir):
    periodic(run_dir, 10)
    periodic(run_dir, 20)
    req = request(first_step=30)
    said = Said()
    d = rollback.decide(str(run_dir), 2, req, rollback.Settings(), said)
    assert d.resume["global_step"] == 20
    for r in (0, 1):
        (run_dir / f"ckpt/rank_{r}/net-1_20.ckpt").unlink()
    note = rollback.confirm(str(run_dir), 2, d, rollback.Settings(), req, said)
    assert note == (
        f"the rollback target set {sid(20)} was deleted during the rollback; taking the next one: set "
        f"{sid(10)} (global step 10)"
    )
    assert d.code is None and d.env[runfiles.RESUME_STEP_ENV] == "10" and d.cause["to_step"] == 10
    assert d.line.target_step == 10 and note in d.said
    (run_dir / "ckpt/rank_1/net-1_10.ckpt").unlink()
    rollback.confirm(str(run_dir), 2, d, rollback.Settings(), req, said)
    assert d.code == policy.ROLLBACK_REFUSED
    assert [ln.kind for ln in rollbacks.read_lines(run_dir)[0]] == ["refused"]


def test_no_healthy_target_is_refused_and_needs_attention(run_dir):
    nan_set(run_dir, 10)
    nan_set(run_dir, 20, name="net-1_{s}_breakpoint.ckpt")
    req = request(first_step=25)
    rollbacks.write_request(run_dir, req)
    d = rollback.decide(str(run_dir), 2, req, rollback.Settings(), Said())
    assert d.code == policy.ROLLBACK_REFUSED and "no complete healthy set older than global step 24" in d.said
    (line,) = rollbacks.read_lines(run_dir)[0]
    assert line.kind == "refused" and "not finite" in line.note and "breakpoint" in line.note
    assert rollbacks.read_request(run_dir) == (None, None)


def test_the_ladder_goes_one_rung_further_at_the_same_place_and_the_budget_ends_it(run_dir):
    for step in (10, 20, 100, 200):
        periodic(run_dir, step)
    s = rollback.Settings(max_rollbacks=3, cooldown_steps=50)
    rungs = []
    # The same spike at step 25 three times: rung 1, 2, 3, each skipping twice as far, the LR halved.
    for attempt in (2, 3, 4):
        d = rollback.decide(str(run_dir), 2, request(first_step=25, skip=10), s, Said())
        assert d.code is None and d.resume["global_step"] == 20
        rollback.committed(str(run_dir), d, attempt, Said())
        rungs.append((d.cause["rung"], d.cause["skip_batches"], d.env.get(rollbacks.LR_SCALE_ENV)))
    assert rungs == [(1, 10, None), (2, 20, "0.5"), (3, 40, "0.25")]
    # Never a loop: a fourth is past the budget.
    d = rollback.decide(str(run_dir), 2, request(first_step=25, skip=10), s, Said())
    assert d.code == policy.ROLLBACK_EXHAUSTED and "budget is used up (3 of 3" in d.said
    assert [ln.kind for ln in rollbacks.read_lines(run_dir)[0]] == ["relaunched"] * 3 + ["exhausted"]


def test_a_spike_far_past_the_last_rollback_starts_at_rung_one(run_dir):
    for step in (10, 20):
        periodic(run_dir, step)
    s = rollback.Settings(cooldown_steps=50)
    d = rollback.decide(str(run_dir), 2, request(first_step=25, skip=10), s, Said())
    rollback.committed(str(run_dir), d, 2, Said())
    periodic(run_dir, 200, mtime=time.time() + 10)  # saved by the relaunched attempt
    # 25 - 1 + 10 + 50 = 84 is the cooldown's end; a spike at 300 is a new place.
    d = rollback.decide(str(run_dir), 2, request(first_step=300, skip=10), s, Said())
    assert d.cause["rung"] == 1 and d.cause["skip_batches"] == 10 and d.resume["global_step"] == 200


def test_a_stale_or_bad_request_is_cleared_and_ignored(run_dir):
    said = Said()
    rollbacks.write_request(run_dir, request(first_step=25, asked_at=1000.0))
    assert rollback.pending(str(run_dir), since=2000.0, say=said) is None
    assert "before this attempt began" in said[-1] and rollbacks.read_request(run_dir) == (None, None)
    path = run_dir / rollbacks.request_rel()
    path.write_text('{"rule": "nonfinite", "first_step": -3}')
    assert rollback.pending(str(run_dir), since=0, say=said) is None
    assert "rollback.json" in said[-1] and not path.exists()


def test_a_request_that_joined_an_operators_stop_ends_the_run_as_asked(run_dir):
    said = Said()
    rollbacks.write_request(run_dir, request(first_step=25))
    runfiles.write_flag(run_dir, True, request_id="r1", requested_by="alice", reason="done for today")
    assert rollback.pending(str(run_dir), since=0, say=said) is None
    assert "the stop was asked by 'alice', not the policy" in said[-1]
    assert rollbacks.read_request(run_dir) == (None, None)
    rollbacks.write_request(run_dir, request(first_step=25))
    runfiles.write_flag(run_dir, True, request_id="r2", requested_by="policy", reason="nonfinite")
    assert rollback.pending(str(run_dir), since=0, say=said).first_step == 25
    assert rollback.pending(str(run_dir), 0, said, "Ctrl-C or SIGTERM to rankwatch launch") is None
    assert "asked by Ctrl-C or SIGTERM to rankwatch launch, not the policy" in said[-1]
    assert rollbacks.read_request(run_dir) == (None, None)


def test_rollback_relaunches_do_not_spend_the_restart_budget():
    recs = [
        {"kind": "supervised", "restarted_by": "launch", "cause": {"kind": "rollback"}, "last_step": 30},
        {"kind": "supervised", "restarted_by": "launch", "cause": {"kind": "crash"}, "last_step": 40},
    ]
    assert policy.History.of(recs).restarts == 1


def test_the_rollback_environment_is_dropped_from_any_other_relaunch():
    base = {"PATH": "/bin", runfiles.RESUME_STEP_ENV: "20", rollbacks.SKIP_BATCHES_ENV: "5"}
    assert rollback.environment(base, None) == {"PATH": "/bin"}
    assert rollback.data_step({runfiles.RESUME_STEP_ENV: "20"}) == 20
    # Without the first step, the skip counts from the resumed set; never backwards.
    assert rollback.data_step({runfiles.RESUME_STEP_ENV: "20", rollbacks.SKIP_BATCHES_ENV: "5"}) == 25
    env = {runfiles.RESUME_STEP_ENV: "20", rollbacks.SKIP_BATCHES_ENV: "1", rollbacks.SKIP_FROM_ENV: "5"}
    assert rollback.data_step(env) == 20


def test_a_crash_relaunch_from_a_set_before_the_skipped_data_skips_it_again(run_dir):
    for step in (10, 20):
        periodic(run_dir, step)
    assert rollback.carry(str(run_dir), 20) == {}
    d = rollback.decide(str(run_dir), 2, request(first_step=25, skip=10), rollback.Settings(), Said())
    rollback.committed(str(run_dir), d, 2, Said())
    assert rollback.carry(str(run_dir), 20) == {
        rollbacks.SKIP_FROM_ENV: "28",
        rollbacks.SKIP_BATCHES_ENV: "10",
    }
    # A set past the skipped data (37) needs no skip; one older than the target is another story.
    assert rollback.carry(str(run_dir), 37) == {} and rollback.carry(str(run_dir), 10) == {}


def test_a_restarted_supervisor_decides_the_rollback_left_pending_and_never_resumes_the_branch_it_left(
    run_dir,
):
    """Issue 34's leftover: the supervisor that asked the stop was killed before its relaunch."""
    for step in (10, 20, 30, 36):  # 36: the stop's own set, saved after the spike began at 32
        periodic(run_dir, step)
    rollbacks.write_request(run_dir, request(first_step=32, skip=10))
    said = Said()
    code, env = rollback.restart(str(run_dir), 2, rollback.Settings(), 3, said)
    rolled = {runfiles.RESUME_STEP_ENV: "30", rollbacks.SKIP_FROM_ENV: "35", rollbacks.SKIP_BATCHES_ENV: "10"}
    assert (code, env) == (None, rolled), said
    assert said[0] == "a loss-spike rollback was left undecided by an earlier supervisor: deciding it now"
    assert "rolling back to set " + sid(30) in said[1]
    (line,) = rollbacks.read_lines(run_dir)[0]
    assert (line.kind, line.target_step, line.attempt) == ("relaunched", 30, 3)
    assert rollbacks.read_request(run_dir) == (None, None)

    # Killed again before attempt 3 saved a set (or attempt 3 crashed): set 36 is the branch the
    # rollback left, newest and healthy as it looks, and the skip is carried.
    choice = policy.choose_resume(str(run_dir), 2)
    assert choice.global_step == 30, choice.note
    assert (
        f"set {sid(36)}: unhealthy: left behind by the rollback from the spike at global step 32 to global step 30"
    ) in choice.note
    said = Said()
    assert rollback.restart(str(run_dir), 2, rollback.Settings(), 4, said) == (None, rolled)
    assert said[0] == f"resuming from set {sid(30)} (global step 30)"
    # A later spike's target passes over the left branch too.
    assert rollback.choose(str(run_dir), 2, request(first_step=50), rollback.Settings()).global_step == 30

    # The new branch's own sets, saved after the rollback, are taken as they come.
    periodic(run_dir, 46, mtime=line.at + 20)
    assert policy.choose_resume(str(run_dir), 2).global_step == 46
    assert rollback.restart(str(run_dir), 2, rollback.Settings(), 4, Said()) == (
        None,
        {runfiles.RESUME_STEP_ENV: "46"},
    )
