"""The incremental ``VerdictBoard`` gives exactly ``health.judge_all``'s verdicts.

Random job histories (ranks stepping at different paces, some with the
in/out split and some without, going silent, stopping, finishing, process
probes coming and going, time jumping across every threshold) are fed to both;
after every tick the board's verdicts must equal a from-scratch ``judge_all``
with the blocker notes, and it must have asked ``judge`` about fewer ranks
than there are when little changed.
"""

from __future__ import annotations

import random

import pytest

from app.run import judging, peers, stepcost
from app.run.health import judge_all
from app.run.stepcost import StepWindow
from tests.helpers.heartbeats import heartbeat
from tests.helpers.ranks import TH, Rank


def from_scratch(
    ranks: dict[int, Rank], world: int, now: float, probes: dict, before: dict | None = None
) -> dict:
    view = set(range(world)) | set(ranks)
    latest = {r: (ranks[r].hb if r in ranks else None) for r in view}
    own = {r: (ranks[r].window.median_ms if r in ranks else None) for r in view}
    split = {r: (ranks[r].window.split_ms if r in ranks else None) for r in view}
    steps = {r: ranks[r].window.steps for r in view if r in ranks}
    gone = {r: p[0] for r, p in probes.items() if p[0]}
    stopped = {r: p[1] for r, p in probes.items() if p[1]}
    alive = {r for r, p in probes.items() if p[2]}
    # The straggler rule's hysteresis reads the last verdicts.
    stragglers = {r for r, v in (before or {}).items() if v.health == "straggler"}
    return judge_all(
        latest,
        own,
        now,
        TH,
        gone,
        split,
        process_stopped=stopped,
        process_alive=alive,
        steps=steps,
        stragglers=stragglers,
    )


@pytest.mark.parametrize("seed", range(40))
def test_board_equals_judge_all_on_random_histories(seed):
    rnd = random.Random(seed)
    world = rnd.choice([1, 2, 5, 9, 16])
    now = 1_800_000_000.0
    ranks: dict[int, Rank] = {}
    board = judging.VerdictBoard(TH)
    probes: dict[int, tuple] = {}
    for _tick in range(60):
        now += rnd.choice([0.1, 0.5, 0.5, 1.0, 3.0, 7.0])
        board.set_view(set(range(world)) | set(ranks))
        for r in range(world):
            if rnd.random() < 0.5 and (r in ranks or rnd.random() < 0.7):
                ranks.setdefault(r, Rank(r, world, rnd, now)).beat(now)
                rk = ranks[r]
                board.observe(r, stepcost.RankReport.of(rk.hb, rk.window))
        for r in list(probes):
            if rnd.random() < 0.3:
                del probes[r]
                board.set_probe(r, None, None, False)
        if ranks and rnd.random() < 0.3:
            r = rnd.choice(sorted(ranks))
            probes[r] = rnd.choice(
                [
                    ("process 1 is gone", None, False),
                    (None, "process 1 is stopped", False),
                    (None, None, True),
                ]
            )
            board.set_probe(r, *probes[r])
        before = dict(board.verdicts)
        board.update(now)
        expected = from_scratch(ranks, world, now, probes, before)
        assert board.verdicts == expected, f"seed {seed}, t={now}"
        # The summary's counts follow the verdicts.
        counts = board.summary_figures()["counts"]
        assert {h: n for h, n in counts.items() if n} == _count(expected)


def _count(verdicts):
    out = {}
    for v in verdicts.values():
        out[v.health] = out.get(v.health, 0) + 1
    return out


def test_a_quiet_tick_judges_only_what_moved(monkeypatch):
    """At 2048 ranks a tick in which 10 ranks wrote asks judge() about those 10, not 2048."""
    now = 1_800_000_000.0
    world = 2048
    board = judging.VerdictBoard(TH)
    windows = {}
    board.set_view(set(range(world)))
    for r in range(world):
        hb = heartbeat(r, world, seq=1, now=now, step_ms=20.0, steps=8, step_in_ms=14.0, step_out_ms=6.0)
        windows[r] = StepWindow(TH.straggler_window)
        windows[r].add(hb)
        board.observe(r, stepcost.RankReport.of(hb, windows[r]))
    board.update(now)
    calls = []
    real = judging.judge
    monkeypatch.setattr(judging, "judge", lambda *a, **k: calls.append(a[0].hb["rank"]) or real(*a, **k))
    now += 0.5
    for r in range(10):
        hb = heartbeat(r, world, seq=2, now=now, step_ms=20.0, steps=8, step_in_ms=14.0, step_out_ms=6.0)
        windows[r].add(hb)
        board.observe(r, stepcost.RankReport.of(hb, windows[r]))
    board.update(now)
    assert sorted(calls) == list(range(10))


def _board_with_hosts(
    now: float, hosts: dict[int, str], ages: dict[int, float], local: set[int] = frozenset()
):
    board = judging.VerdictBoard(TH)
    board.set_view(set(hosts))
    for r, host in hosts.items():
        hb = heartbeat(r, len(hosts), seq=1, now=now - ages.get(r, 0.0), host=host, step_ms=20.0, steps=8)
        hb["last_step_at"] = hb["time"]
        window = StepWindow(TH.straggler_window)
        window.add(hb)
        board.observe(r, stepcost.RankReport.of(hb, window, local=r in local))
    board.update(now)
    return board


def test_a_node_whose_ranks_go_silent_together_is_lost():
    now = 1_800_000_000.0
    hosts = {0: "a", 1: "a", 2: "b", 3: "b"}
    board = _board_with_hosts(now, hosts, {2: 6.0, 3: 6.5})
    assert [board.verdicts[r].health for r in range(4)] == ["healthy", "healthy", "node_lost", "node_lost"]
    reason = board.verdicts[2].reason
    assert (
        reason.startswith("node b lost: all 2 of its ranks")
        and "while 1 other host still reports: a machine or network failure" in reason
    )
    assert board.summary_figures()["counts"]["node_lost"] == 2


@pytest.mark.parametrize(
    ("ages", "local", "why"),
    [
        ({2: 6.0}, set(), "one silent rank of a host that still reports is that rank's problem"),
        ({0: 6.0, 1: 6.0, 2: 6.0, 3: 6.0}, set(), "everything silent: no host to compare with"),
        ({2: 6.0, 3: 20.0}, set(), "silent 14 s apart: not together"),
        ({2: 6.0, 3: 6.0}, {2, 3}, "the dashboard's own host is probed, never guessed lost"),
        ({2: 4.0, 3: 4.0}, set(), "not yet silent for stall_min_s"),
    ],
)
def test_no_node_is_lost_without_the_whole_node_going_silent_together(ages, local, why):
    now = 1_800_000_000.0
    board = _board_with_hosts(now, {0: "a", 1: "a", 2: "b", 3: "b"}, ages, local)
    assert "node_lost" not in {v.health for v in board.verdicts.values()}, why


def test_a_straggler_near_the_ratio_does_not_flap():
    """Issue 33: a rank hovering near 1.5x flapped between straggler and healthy within a minute.

    It turns straggler at 1.5x, stays one while it is above 0.9 of the rule
    (1.35x here), and is healthy again only below that; the board and the
    from-scratch rules agree at every tick.
    """
    board = judging.VerdictBoard(TH)
    board.set_view({0, 1, 2})
    now = 1_800_000_000.0
    seen = []
    for seq, slow in enumerate((100.0, 160.0, 145.0, 152.0, 140.0, 146.0, 130.0, 145.0), start=1):
        now += 1.0
        hbs = {r: heartbeat(r, 3, seq=seq, now=now, step_ms=ms) for r, ms in enumerate((100.0, 100.0, slow))}
        for r, hb in hbs.items():
            board.observe(r, stepcost.RankReport(hb, hb["step_time_ms"], None, TH.straggler_window))
        before = {r for r, v in board.verdicts.items() if v.health == "straggler"}
        board.update(now)
        own = {r: hb["step_time_ms"] for r, hb in hbs.items()}
        steps = dict.fromkeys(hbs, TH.straggler_window)
        assert board.verdicts == judge_all(hbs, own, now, TH, steps=steps, stragglers=before)
        seen.append(board.verdicts[2].health)
    assert seen == [
        "healthy",  # 1.0x
        "straggler",  # 1.6x: past the rule
        "straggler",  # 1.45x: below 1.5x, yet not clearly back
        "straggler",
        "straggler",  # 1.4x
        "straggler",
        "healthy",  # 1.3x: below 1.35x, back among its peers
        "healthy",  # 1.45x: not past the rule again
    ]


def test_the_slowest_rank_rule_ties_to_the_highest_rank_and_takes_the_boards_peer_median():
    """``peers.slowest_rank``: the board and the agents' hub both call it (the hub in tests/cluster/test_agent.py)."""
    assert peers.pick([3, 7, 5], [10.0, 10.0, 9.0]) == (7, 10.0)
    assert peers.pick([], []) is None
    found = peers.slowest_rank(
        [0, 1, 2], [50.0, 200.0, 60.0], "step", straggler=lambda r: r == 1, threshold_ratio=1.5
    )
    assert (found["rank"], found["median_ms"], found["ratio"], found["straggler"]) == (1, 55.0, 3.64, True)
    given = peers.slowest_rank(
        [0, 1, 2],
        [50.0, 200.0, 60.0],
        "work",
        straggler=lambda r: False,
        threshold_ratio=1.5,
        peer=lambda r: 40.0,
    )
    assert (given["median_ms"], given["basis"], given["text"].startswith("none:")) == (40.0, "work", True)
    alone = peers.slowest_rank([4], [80.0], "step", straggler=lambda r: False, threshold_ratio=1.5)
    assert (alone["median_ms"], alone["gap_ms"]) == (80.0, 0.0)  # one rank: compared with itself
