"""The verdict rules, driven by heartbeat sequences and an explicit ``now`` (no sleeping)."""

from __future__ import annotations

import math
import statistics
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.run.health import RankEvidence, Thresholds, judge, judge_all, judge_sequences, peer_median
from app.run.stepcost import StepWindow, score
from app.run.verdicts import VERDICTS
from tests.helpers.heartbeats import heartbeat

TH = Thresholds()
T0 = 1_800_000_000.0


def beats(rank: int, world: int, count: int, step_ms: float, start: float = T0, **kw) -> list[dict]:
    """``count`` heartbeats one second apart, the last one written at ``start + count - 1``."""
    return [heartbeat(rank, world, seq=i + 1, now=start + i, step_ms=step_ms, **kw) for i in range(count)]


def job(world: int, step_ms: dict[int, float], count: int = 5, default_ms: float = 50.0):
    return {r: beats(r, world, count, step_ms.get(r, default_ms)) for r in range(world)}


def last_time(count: int = 5) -> float:
    return T0 + count - 1


def test_steady_job_is_healthy_with_full_scores():
    verdicts = judge_sequences(job(4, {}), last_time() + 0.5, TH)
    assert {v.health for v in verdicts.values()} == {"healthy"}
    assert all(v.score == 1.0 for v in verdicts.values())
    assert "within 1.5x" in verdicts[0].reason


def test_slow_rank_is_a_straggler_with_its_score_and_reason():
    verdicts = judge_sequences(job(8, {5: 100.0}), last_time() + 0.5, TH)
    assert verdicts[5].health == "straggler"
    assert verdicts[5].score == 0.5
    assert "100 ms is 2x the other ranks' median 50 ms" in verdicts[5].reason
    assert all(verdicts[r].health == "healthy" for r in range(8) if r != 5)


def test_just_below_the_ratio_is_not_a_straggler():
    verdicts = judge_sequences(job(4, {1: 74.0}), last_time() + 0.5, TH)
    assert verdicts[1].health == "healthy"
    assert verdicts[1].score == round(50 / 74, 2)


def test_tiny_steps_need_an_absolute_gap_too():
    # 4 ms against 2 ms is 2x, but 2 ms of difference is scheduler noise.
    verdicts = judge_sequences(job(4, {2: 4.0}, default_ms=2.0), last_time() + 0.5, TH)
    assert verdicts[2].health == "healthy"
    lenient = Thresholds(straggler_min_gap_ms=1.0)
    assert (
        judge_sequences(job(4, {2: 4.0}, default_ms=2.0), last_time() + 0.5, lenient)[2].health == "straggler"
    )


def test_one_slow_step_does_not_flag_a_rank_but_a_slow_streak_does():
    fast = beats(0, 2, 4, 50.0, steps=8)
    hiccup = heartbeat(0, 2, seq=5, now=T0 + 4, steps=1, step_ms=400.0)
    peer = beats(1, 2, 5, 50.0, steps=8)
    assert judge_sequences({0: fast + [hiccup], 1: peer}, T0 + 4.5, TH)[0].health == "healthy"
    streak = [heartbeat(0, 2, seq=5 + i, now=T0 + 4 + i, steps=8, step_ms=400.0) for i in range(4)]
    assert judge_sequences({0: fast + streak, 1: peer}, T0 + 8, TH)[0].health == "straggler"


def test_a_straggler_recovers_once_its_window_is_fast_again():
    slow = beats(0, 2, 3, 200.0, steps=32)
    recovered = [heartbeat(0, 2, seq=4 + i, now=T0 + 3 + i, steps=32, step_ms=50.0) for i in range(2)]
    peer = beats(1, 2, 5, 50.0)
    assert judge_sequences({0: slow, 1: peer}, T0 + 3, TH)[0].health == "straggler"
    assert judge_sequences({0: slow + recovered, 1: peer}, T0 + 5, TH)[0].health == "healthy"


# -- synchronous jobs: every rank's wall step time is the same ------------------


def sync_beats(
    rank: int, world: int, count: int, in_ms: float, out_ms: float, wall_ms: float, **kw
) -> list[dict]:
    """Heartbeats of a rank of a synchronous job: equal walls, its own in/out split."""
    return beats(rank, world, count, wall_ms, step_in_ms=in_ms, step_out_ms=out_ms, **kw)


def test_sync_job_finds_the_rank_slow_outside_the_step_by_its_own_work():
    # Measured on the real demo: rank 1 sleeps 0.2 s per step outside the step,
    # rank 0 waits for it inside the gradient AllReduce. Both walls are 340 ms.
    world = {
        0: sync_beats(0, 2, 8, in_ms=339.0, out_ms=1.3, wall_ms=340.0),
        1: sync_beats(1, 2, 8, in_ms=141.0, out_ms=204.0, wall_ms=340.0),
    }
    verdicts = judge_sequences(world, last_time(8) + 0.5, TH)
    assert verdicts[0].health == "healthy" and verdicts[0].score == 1.0
    slow = verdicts[1]
    assert slow.health == "straggler"
    # work: 204 + 141 = 345 ms against 1.3 + 141 = 142.3 ms
    assert slow.score == round(142.3 / 345.0, 2)
    assert "own work 345 ms vs the other ranks' median 142 ms (2.4x)" in slow.reason
    assert "204 ms between steps + 141 ms fastest in-step time" in slow.reason


def test_a_rank_is_compared_only_once_its_window_holds_enough_steps():
    # Healthy ranks of a job starting on busy cores: three steps each, one of
    # them 1.6x the other (measured in CI). Too few to call a straggler.
    world = {
        0: sync_beats(0, 2, 1, in_ms=595.0, out_ms=347.0, wall_ms=340.0, steps=3),
        1: sync_beats(1, 2, 1, in_ms=598.0, out_ms=6.0, wall_ms=340.0, steps=3),
    }
    verdicts = judge_sequences(world, last_time(1) + 0.5, TH)
    assert {v.health for v in verdicts.values()} == {"healthy"}
    assert verdicts[0].reason == "training (too few steps yet to compare with its peers)"
    # The same split over the minimum number of steps: a straggler.
    steps = TH.straggler_min_steps
    world = {
        0: sync_beats(0, 2, 1, in_ms=595.0, out_ms=347.0, wall_ms=340.0, steps=steps),
        1: sync_beats(1, 2, 1, in_ms=598.0, out_ms=6.0, wall_ms=340.0, steps=steps),
    }
    assert judge_sequences(world, last_time(1) + 0.5, TH)[0].health == "straggler"


def test_sync_job_with_many_ranks_scores_by_the_peer_median_work():
    world = {r: sync_beats(r, 8, 8, in_ms=400.0 + r, out_ms=2.0, wall_ms=402.0) for r in range(8)}
    world[5] = sync_beats(5, 8, 8, in_ms=100.0, out_ms=300.0, wall_ms=402.0)
    verdicts = judge_sequences(world, last_time(8) + 0.5, TH)
    assert [r for r, v in verdicts.items() if v.health == "straggler"] == [5]
    assert verdicts[5].score == round(102.0 / 400.0, 2)
    assert all(v.health == "healthy" for r, v in verdicts.items() if r != 5)


def test_sync_job_in_step_and_between_step_jitter_is_healthy():
    world = {r: sync_beats(r, 4, 6, in_ms=170.0 + 7 * r, out_ms=1.0 + r, wall_ms=180.0) for r in range(4)}
    verdicts = judge_sequences(world, last_time(6) + 0.5, TH)
    assert {v.health for v in verdicts.values()} == {"healthy"}
    assert all(v.score == 1.0 or v.score > 0.9 for v in verdicts.values())
    assert verdicts[0].reason == "training within 1.5x of the other ranks' median work per step"


def test_equal_walls_without_the_split_cannot_tell_the_slow_rank():
    # The simulator's heartbeats (step_in_ms/step_out_ms null): the wall rule,
    # which in a real synchronous job sees only equal times.
    world = {r: beats(r, 2, 8, 340.0) for r in range(2)}
    verdicts = judge_sequences(world, last_time(8) + 0.5, TH)
    assert {v.health for v in verdicts.values()} == {"healthy"}
    assert verdicts[0].reason == "training within 1.5x of the other ranks' median"


def test_work_needs_the_split_from_every_stepping_rank():
    world = {
        0: sync_beats(0, 3, 8, in_ms=300.0, out_ms=1.0, wall_ms=100.0),
        1: sync_beats(1, 3, 8, in_ms=100.0, out_ms=200.0, wall_ms=100.0),
        2: beats(2, 3, 8, 300.0),
    }  # no split: everyone falls back to wall times
    verdicts = judge_sequences(world, last_time(8) + 0.5, TH)
    assert verdicts[1].health == "healthy"
    assert verdicts[2].health == "straggler" and "median step 300 ms" in verdicts[2].reason
    # A finished rank without the split is not a stepping peer: work applies.
    world[2] = beats(2, 3, 8, 300.0, state="finished")
    verdicts = judge_sequences(world, last_time(8) + 0.5, TH)
    assert verdicts[1].health == "straggler" and "own work" in verdicts[1].reason


def test_split_window_medians_ride_out_one_odd_heartbeat_and_stalls_keep_the_last():
    window = StepWindow(8)
    for seq, (in_ms, out_ms) in enumerate([(100, 2), (100, 2), (100, 500), (100, 2)], start=1):
        window.add(heartbeat(0, 1, seq=seq, steps=2, step_ms=102.0, step_in_ms=in_ms, step_out_ms=out_ms))
    assert window.split_ms == (100.0, 2.0)
    # A heartbeat that saw no step (a stall) repeats its figures: not counted again.
    window.add(
        heartbeat(0, 1, seq=5, steps=0, step_ms=102.0, step_times_ms=[], step_in_ms=999.0, step_out_ms=999.0)
    )
    assert window.split_ms == (100.0, 2.0)
    # Only the heartbeats that cover the newest 8 steps count.
    for seq in range(6, 10):
        window.add(heartbeat(0, 1, seq=seq, steps=2, step_ms=102.0, step_in_ms=50.0, step_out_ms=60.0))
    assert window.split_ms == (50.0, 60.0)
    window.add(heartbeat(0, 1, seq=10, steps=2, step_in_ms=None, step_out_ms=None))
    assert window.split_ms is None


def test_summary_slowest_rank_uses_the_same_work(run_dir):
    from app.config import from_env
    from app.run.state import RunState
    from tests.helpers.heartbeats import write_heartbeat, write_job

    write_job(run_dir, 2)
    now = time.time()
    state = RunState(run_dir, from_env({}))
    # The dashboard sees each heartbeat as it is written: 6 of 3 steps each.
    for hb0, hb1 in zip(
        sync_beats(0, 2, 6, in_ms=339.0, out_ms=1.3, wall_ms=340.0, start=now - 5),
        sync_beats(1, 2, 6, in_ms=141.0, out_ms=204.0, wall_ms=340.0, start=now - 5),
        strict=True,
    ):
        write_heartbeat(run_dir, hb0)
        write_heartbeat(run_dir, hb1)
        state.scan(hb0["time"])
    state.scan(now)
    snap = state.snapshot(now)
    assert snap["summary"]["slowest"]["rank"] == 1
    assert snap["summary"]["slowest"]["basis"] == "work"
    assert snap["summary"]["slowest"]["step_time_ms"] == 345.0
    assert snap["ranks"][1]["health"] == "straggler"


def test_the_same_heartbeat_read_twice_counts_once():
    window = StepWindow(4)
    hb = heartbeat(0, 1, seq=1, steps=2, step_ms=10.0)
    window.add(hb)
    window.add(hb)
    window.add(heartbeat(0, 1, seq=2, steps=2, step_ms=30.0))
    assert window.median_ms == 20.0


def test_silent_rank_turns_stalled_then_dead():
    seq = job(2, {}, count=3)
    written = last_time(3)
    assert judge_sequences(seq, written + 1.0, TH)[0].health == "healthy"
    stalled = judge_sequences(seq, written + TH.stall_min_s + 0.1, TH)[0]
    assert stalled.health == "stalled"
    # The page must say that heartbeats stopped, not only steps: a rank that
    # cannot write (disk full) may well be training.
    assert "no heartbeat for over 5 s (last: global step 60)" in stalled.reason
    assert "cannot write to the run directory (disk full? read-only?)" in stalled.reason
    dead = judge_sequences(seq, written + TH.dead_after_s + 0.1, TH)[0]
    assert dead.health == "dead"
    assert "no heartbeat for over 30 s" in dead.reason
    assert "disk full" in dead.reason


def test_silent_rank_whose_process_runs_on_this_host_says_so():
    seq = job(2, {}, count=3)
    written = last_time(3)
    for age, health in ((TH.stall_min_s + 0.1, "stalled"), (TH.dead_after_s + 10, "dead")):
        verdict = judge_all_at(seq, written + age, process_alive={0})[0]
        assert verdict.health == health
        assert (
            "its process 4242 still runs, so it is stuck, or training but unable to write its heartbeat"
        ) in verdict.reason.replace(str(seq[0][-1]["pid"]), "4242")


def judge_all_at(world, now, **kw):
    latest = {r: hbs[-1] for r, hbs in world.items()}
    own = {r: 50.0 for r in world}
    return judge_all(latest, own, now, TH, **kw)


def test_stopped_process_is_stalled_not_dead_and_its_peers_wait_for_it():
    written = last_time(3)
    world = job(3, {}, count=3)
    # Ranks 0 and 2 keep writing heartbeats but step no more: blocked in the AllReduce.
    for r in (0, 2):
        world[r] = world[r] + [
            heartbeat(r, 3, seq=4 + i, now=written + 1 + i, global_step=60, last_step_at=written)
            for i in range(40)
        ]
    now = written + 40.5
    stopped = {1: "process 4242 is stopped (SIGSTOP or a debugger; kill -CONT 4242 resumes it)"}
    verdicts = judge_all_at(world, now, process_stopped=stopped)
    assert verdicts[1].health == "stalled"
    assert verdicts[1].reason.startswith("process 4242 is stopped")
    for r in (0, 2):
        assert verdicts[r].health == "stalled", verdicts[r]
        assert verdicts[r].reason == (
            "no step finished for over 5 s (last: global step 60); rank 1 "
            "is stopped: this rank is likely blocked in a collective with it"
        )


def test_peers_of_a_dead_rank_name_it():
    written = last_time(3)
    world = job(4, {}, count=3)
    for r in (0, 2):
        world[r] = world[r] + [
            heartbeat(r, 4, seq=4 + i, now=written + 1 + i, global_step=60, last_step_at=written)
            for i in range(12)
        ]
    now = written + 12.5
    verdicts = judge_all_at(world, now, process_gone={1: "process 11 is gone (host a)"})
    assert verdicts[1].health == "dead" and verdicts[1].cause == "gone"
    assert verdicts[3].health == "stalled" and verdicts[3].cause == "silent"
    assert verdicts[0].reason == (
        "no step finished for over 5 s (last: global step 60); rank 1 is "
        "dead and rank 3 sends no heartbeats: this rank is likely "
        "blocked in a collective with them"
    )
    # Ranks that ended (a finished rank) hold nobody up.
    world[1] = [heartbeat(1, 4, seq=3, now=written, state="finished")]
    world[3] = [heartbeat(3, 4, seq=3, now=written, state="finished")]
    verdicts = judge_all_at(world, now)
    assert verdicts[0].reason == "no step finished for over 5 s (last: global step 60)"


def test_alive_but_not_stepping_is_stalled():
    # The heartbeat thread still writes, the training loop is stuck.
    stuck = [heartbeat(0, 1, seq=i + 1, now=T0 + i, global_step=100, last_step_at=T0) for i in range(8)]
    verdict = judge_sequences({0: stuck}, T0 + 7.2, TH)[0]
    assert verdict.health == "stalled"
    assert "global step 100" in verdict.reason


def test_stall_limit_scales_with_slow_steps():
    slow = beats(0, 1, 3, 2000.0)  # 2 s steps: limit is 5 x 2 s = 10 s
    written = last_time(3)
    # Heartbeats keep coming (about 1 Hz, whatever the step time); steps do not.
    waiting = [
        heartbeat(
            0,
            1,
            seq=4 + i,
            now=written + 1 + i,
            step_ms=2000.0,
            steps=0,
            step_times_ms=[],
            global_step=slow[-1]["global_step"],
            last_step_at=written,
        )
        for i in range(10)
    ]
    assert judge_sequences({0: slow + waiting[:8]}, written + 8, TH)[0].health == "healthy"
    assert judge_sequences({0: slow + waiting}, written + 10.5, TH)[0].health == "stalled"


def test_starting_and_saving_are_never_stalled():
    starting = [
        heartbeat(
            0,
            1,
            seq=1,
            now=T0,
            state="starting",
            global_step=0,
            step_times_ms=[],
            step_time_ms=None,
            step_time_mean_ms=None,
            last_step_at=None,
            started_at=T0 - 600,
        )
    ]
    first = judge_sequences({0: starting}, T0 + 1, TH)[0]
    assert first.health == "starting" and "waiting for the first step" in first.reason
    saving = [heartbeat(0, 1, seq=1, now=T0, state="saving", last_step_at=T0 - 60)]
    assert judge_sequences({0: saving}, T0 + 1, TH)[0].health == "healthy"


def test_process_gone_is_dead_at_once():
    seq = job(2, {})
    gone = {1: "process 4242 is gone (host a)"}
    verdicts = judge_sequences(seq, last_time() + 0.5, TH, process_gone=gone)
    assert verdicts[1].health == "dead"
    assert verdicts[1].reason == "process 4242 is gone (host a)"
    assert verdicts[0].health == "healthy"


def test_lifecycle_states_keep_their_own_verdict_however_old():
    old = T0 - 3600
    failed = heartbeat(0, 3, now=old, state="failed", error="RuntimeError: NPU 3 ECC")
    finished = heartbeat(1, 3, now=old, state="finished", global_step=1000)
    exited = heartbeat(
        2,
        3,
        now=old,
        state="exited",
        global_step=48,
        stop={
            "request_id": "r",
            "source": "flag",
            "stage": "exited",
            "checkpoint": {
                "path": "checkpoints/rank_2/rankwatch-1_48.ckpt",
                "bytes": 494131,
                "seconds": 0.05,
            },
        },
    )
    verdicts = judge_sequences(
        {0: [failed], 1: [finished], 2: [exited]}, T0, TH, process_gone={0: "gone", 1: "gone", 2: "gone"}
    )
    assert verdicts[0].health == "failed" and "NPU 3 ECC" in verdicts[0].reason
    assert verdicts[1].health == "finished" and "1000" in verdicts[1].reason
    assert verdicts[2].health == "exited"
    assert "rankwatch-1_48.ckpt" in verdicts[2].reason


def test_no_heartbeat_is_pending():
    assert judge(RankEvidence(None), T0, TH).health == "pending"


def test_finished_peers_do_not_count_as_peers():
    world = {0: beats(0, 3, 5, 100.0), 1: beats(1, 3, 5, 100.0), 2: beats(2, 3, 5, 10.0, state="finished")}
    verdicts = judge_sequences(world, last_time() + 0.5, TH)
    assert verdicts[0].health == verdicts[1].health == "healthy"


def test_score_is_capped_at_one():
    assert score(25.0, 50.0) == 1.0
    assert score(100.0, 50.0) == 0.5
    assert score(None, 50.0) is None


def test_thresholds_come_from_settings_names():
    th = Thresholds.from_config({"STRAGGLER_RATIO": 2.0, "DEAD_AFTER_S": 9.0, "TICK_S": 1.0})
    assert th.straggler_ratio == 2.0 and th.dead_after_s == 9.0
    assert th.stall_min_s == Thresholds().stall_min_s


@settings(deadline=None)
@given(st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=40), st.data())
def test_peer_median_is_the_median_without_one_copy_of_own(values, data):
    own = data.draw(st.sampled_from(values))
    rest = list(values)
    rest.remove(own)
    expected = statistics.median(rest) if rest else None
    got = peer_median(sorted(values), own)
    assert got == expected or math.isclose(got, expected)


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=5),
    st.lists(st.one_of(st.floats(), st.text(max_size=2)), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
FIELDS = [
    "state",
    "time",
    "last_step_at",
    "started_at",
    "global_step",
    "step_times_ms",
    "step_time_ms",
    "seq",
    "error",
    "stop",
    "host",
    "pid",
]


# The machine is shared with training jobs: generation speed is not the point here.
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS), ANY_VALUE), st.floats(0, 2e9))
def test_any_heartbeat_gets_a_verdict_and_a_reason(hb, now):
    window = StepWindow(8)
    window.add(hb)
    verdict = judge(RankEvidence(hb, own_ms=window.median_ms, peer_ms=50.0), now, TH)
    assert verdict.health in VERDICTS
    assert isinstance(verdict.reason, str) and verdict.reason
