"""The bridge's pure parts, without MindSpore: the interval rule, the vote, save and resume choices."""

from __future__ import annotations

import functools
import itertools
import subprocess
import sys
import threading
from collections import defaultdict

import numpy as np

from tests.helpers import ckptcraft
from trainer_bridge.agreement import Agreement, next_interval
from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.ckptindex import scan
from trainer_bridge.saving import (
    Served,
    agree_resume,
    append_fields,
    checkpoint_file,
    data_position,
    find_resume_point,
    own_resume_points,
)


def test_these_modules_need_no_mindspore():
    code = (
        "import sys, trainer_bridge.agreement, trainer_bridge.saving, trainer_bridge.counters; "
        "sys.exit('mindspore' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_next_interval_is_clamped():
    rule = functools.partial(next_interval, sync_interval_s=0.5, max_sync_every=100, max_overhead=0.005)
    assert rule(0.0, 0.0) == 1
    assert rule(0.01, 0.0) == 50
    assert rule(10.0, 0.0) == 1
    assert rule(1e-6, 0.0) == 100
    # An agreement costing 2 ms at 100 ms steps: 0.5% allows one every 4 steps,
    # fewer than the 5 the latency target asks for, so latency decides...
    assert rule(0.1, 0.002) == 5
    # ...but at 20 ms each, agreeing every 5 steps would take 4%: stretch to 40.
    assert rule(0.1, 0.020) == 40


RULE = {"sync_interval_s": 0.5, "max_overhead": 0.003, "max_sync_every": 1000}


def test_agreement_votes_after_the_first_step_then_every_k():
    a = Agreement(None, 1, global_step=0, **RULE)
    assert a.due(1, 0.5)  # the first step (it compiles): vote at once
    assert a.vote(False, 1) == 0.0 and a.next_sync == 2  # 0.5 s steps: every step
    step_s = 1 / 64  # exact in binary: 0.5 s / step_s is exactly 32 steps
    assert a.due(2, step_s)
    assert a.vote(True, 2) == 1.0  # alone, this rank's vote is the answer
    assert a.sync_every == 32 and a.next_sync == 34
    assert [s for s in range(3, 40) if a.due(s, step_s)] == list(range(34, 40))
    assert (a.agreements, a.first_agree_ms is not None) == (2, True)


def test_agreement_uses_the_reduced_figures_so_every_rank_picks_the_same_step():
    # Rank 0 measured 10 ms steps, its peer 30 ms: both must pick K from the mean, 20 ms.
    calls = []

    def vote_sum(mine, mean, cost):
        calls.append((mine, mean, cost))
        return mine + 1.0, mean + 0.030, cost + 0.0

    a = Agreement(vote_sum, 2, global_step=100, **RULE)
    assert a.due(101, 0.010)
    assert a.vote(False, 101) == 1.0  # the peer voted stop
    assert calls == [(0.0, 0.010, 0.0)]
    assert a.sync_every == 25 and a.next_sync == 126


def test_sink_mode_counts_the_steps_of_a_sink():
    a = Agreement(None, 1, global_step=0, **RULE)
    assert a.due(25, 0.25, steps=25)  # one call for 25 steps: the mean step is 10 ms
    a.vote(False, 25)
    assert a.sync_every == 50


def test_data_position_and_file_name():
    assert data_position(0, 8) == (0, 0)
    assert data_position(13, 8) == (1, 5)
    assert data_position(16, 8) == (2, 0)
    path = checkpoint_file("RUN", 1, 2, 13, 8)
    assert path.as_posix() == f"RUN/{runfiles.CHECKPOINT_DIR}/rank_1/rankwatch-2_5.ckpt"


def test_append_fields_leave_the_optimizers_global_step_alone():
    common = {"epoch": 2, "global_step": 13, "per_epoch": 8, "request_id": "r", "rank": 1, "world": 2}
    with_opt = append_fields(**common, param_names={"fc.weight", "global_step"})
    assert with_opt == {
        "epoch_num": 2,
        "step_num": 13,
        "batch_num": 8,
        "rankwatch_request_id": "r",
        "rankwatch_rank": 1,
        "rankwatch_world_size": 2,
    }
    assert append_fields(**common, param_names={"fc.weight"})["global_step"] == 13


def test_served_covers_ids_and_bare_flags_older_than_the_last_save():
    served = Served(frozenset({"a"}), last_saved_at=100.0)
    assert served.covers(runfiles.Flag(True, "a", {}), 500.0)
    assert not served.covers(runfiles.Flag(True, "b", {}), 50.0)
    assert served.covers(runfiles.Flag(True, None, {}), 99.0)
    assert not served.covers(runfiles.Flag(True, None, {}), 101.0)


class ThreadSum:
    """A SUM AllReduce of three float32s across one thread per rank, round by round (as the graph's)."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.lock = threading.Lock()
        self.rounds: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])

    def for_rank(self):
        calls = itertools.count()

        def vote_sum(a: float, b: float, c: float) -> tuple[float, float, float]:
            with self.lock:
                sums = self.rounds[next(calls)]
                sums[0], sums[1], sums[2] = (
                    np.float32(x) + np.float32(y) for x, y in zip(sums, (a, b, c), strict=True)
                )
            self.barrier.wait(timeout=30)  # every rank has added its share of this round
            return tuple(float(x) for x in sums)

        return vote_sum


def agreed(run_dirs: list, world: int) -> dict:
    """Each rank (a thread) scans its own ``run_dirs[rank]`` and agrees with the others."""
    reducer, out = ThreadSum(world), {}

    def rank_main(rank):
        index = scan(run_dirs[rank], world_size=world)
        out[rank] = agree_resume(reducer.for_rank(), rank, world, own_resume_points(index, rank))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(out) == world, "a rank did not decide"
    return out


def save(run_dir, rank: int, step: int) -> None:
    path = run_dir / f"{runfiles.CHECKPOINT_DIR}/rank_{rank}/rankwatch-1_{step}.ckpt"
    ckptcraft.write(path, ckptcraft.ckpt(global_step=step))


def test_ranks_on_local_disks_agree_on_the_newest_set_each_holds_its_file_of(tmp_path):
    nodes = [tmp_path / f"node{n}" / "job" for n in range(2)]
    for step in (10, 20):
        for rank in range(4):
            save(nodes[rank // 2], rank, step)
    for rank in (0, 1, 2):  # rank 3's save at step 30 never happened
        save(nodes[rank // 2], rank, 30)
    # No node sees a whole set: reading alone finds nothing to resume from.
    assert all(scan(n, world_size=4).newest_complete is None for n in nodes)
    points = agreed([nodes[r // 2] for r in range(4)], 4)
    assert {r: p.global_step for r, p in points.items()} == dict.fromkeys(range(4), 20)
    for rank, point in points.items():
        assert (
            point.path.resolve()
            == (nodes[rank // 2] / f"checkpoints/rank_{rank}/rankwatch-1_20.ckpt").resolve()
        )

    # One shared directory: the same choice as the set read as complete.
    shared = tmp_path / "shared" / "job"
    for rank, step in [(r, s) for r in range(4) for s in (10, 20)] + [(0, 30), (1, 30), (2, 30)]:
        save(shared, rank, step)
    points = agreed([shared] * 4, 4)
    assert (
        {p.global_step for p in points.values()}
        == {find_resume_point(scan(shared, 4), 0).global_step}
        == {20}
    )

    # Steps past float32's exact integers (2**24) travel exactly.
    big = tmp_path / "big" / "job"
    for rank in range(2):
        save(big, rank, 2**25 + 3)
    assert {p.global_step for p in agreed([big] * 2, 2).values()} == {2**25 + 3}

    # No set all ranks hold: a fresh start on every rank.
    lone = tmp_path / "lone" / "job"
    save(lone, 0, 10)
    assert agreed([lone] * 2, 2) == {0: None, 1: None}
