"""The overhead benchmarks' shared harness (tests/bench/ab.py): its rounds and its statistics.

The benchmarks themselves are run by hand on a quiet machine; what they
decide rests on these pieces, which are checked here on made-up rounds.
"""

from __future__ import annotations

import pytest

from tests.bench import ab


def _round(plain_s: float, side_s: float, steps: int = 100, job: int = 0) -> dict:
    side = {"s": side_s, "steps": steps, "median_ms": side_s / steps * 1e3, "cpu_s": side_s}
    side["cost"] = {"agreements": 2, "agree_ms": 1.0, "reporter_cpu_ms": 1.0}
    plain = {"s": plain_s, "steps": steps, "median_ms": plain_s / steps * 1e3, "cpu_s": plain_s}
    return {"order": ["plain", "bridge"], "plain": plain, "bridge": side, "job": job}


def test_every_rank_runs_the_sides_in_the_same_shuffled_order():
    ran = {0: [], 1: []}

    def sides(rank):
        return {
            name: (lambda i, name=name: ran[rank].append(name) or {})
            for name in ("plain", "bridge", "no-loss")
        }

    first = ab.alternate(12, seed=7, sides=sides(0))
    second = ab.alternate(12, seed=7, sides=sides(1))
    assert ran[0] == ran[1]  # the ranks' collectives pair up
    assert [r["order"] for r in first] == [r["order"] for r in second]
    assert all(sorted(r["order"]) == ["bridge", "no-loss", "plain"] for r in first)
    assert len({tuple(r["order"]) for r in first}) > 1  # shuffled, not fixed


def test_a_steady_two_percent_cost_is_shown_below_target():
    rounds = [_round(1.0 + 0.01 * (i % 3), (1.0 + 0.01 * (i % 3)) * 1.02, job=i % 4) for i in range(12)]
    s = ab.summarise(rounds, "bridge", seed=1)
    assert abs(s["pooled"] - 1 / 1.02) < 1e-9
    assert s["lo"] <= s["pooled"] <= s["hi"] < ab.TARGET
    assert ab.verdict(s) == "< 0.99 shown"
    spent_ms = 2.0 * len(rounds)  # agreements and reporter, 1 ms each a round
    assert abs(s["share"] - spent_ms / (sum(r["bridge"]["s"] for r in rounds) * 1e3)) < 1e-12


def test_no_cost_with_little_noise_is_shown_at_target_and_wide_noise_decides_nothing():
    quiet = [_round(1.0, 1.0 + (0.002 if i % 2 else -0.002), job=i // 3) for i in range(12)]
    assert ab.verdict(ab.summarise(quiet, "bridge", seed=1)) == ">= 0.99 shown"
    noisy = [_round(1.0, 1.0 + (0.3 if i % 2 else -0.2), job=i // 3) for i in range(12)]
    s = ab.summarise(noisy, "bridge", seed=1)
    assert s["lo"] < ab.FLOOR and s["hi"] > ab.TARGET
    assert ab.verdict(s) == "undecided"


def test_a_few_rounds_decide_nothing():
    few = [_round(1.0, 1.02) for _ in range(ab.QUICK_ROUNDS)]
    assert ab.verdict(ab.summarise(few, "bridge", seed=1)).startswith("none")


def test_the_interval_is_reproducible_from_its_seed():
    rounds = [_round(1.0, 1.0 + 0.05 * ((i * 7) % 5 - 2)) for i in range(12)]
    assert ab.summarise(rounds, "bridge", seed=3) == ab.summarise(rounds, "bridge", seed=3)


def test_a_shift_that_holds_for_a_whole_job_widens_the_interval_and_one_job_decides_nothing():
    # Within each job the rounds agree to 0.1%, but the jobs disagree by 3%:
    # an interval over rounds alone would call this decided.
    shifts = [0.97, 1.0, 1.01, 0.995]
    rounds = [
        _round(1.0, shifts[j] + (0.001 if i % 2 else -0.001), job=j) for j in range(4) for i in range(10)
    ]
    s = ab.summarise(rounds, "bridge", seed=1)
    assert s["jobs"] == 4
    assert s["job_min"] == pytest.approx(1 / max(shifts)) and s["job_max"] == pytest.approx(1 / min(shifts))
    assert s["hi"] - s["lo"] > 0.01
    one_job = [dict(r, job=0) for r in rounds[:10]]
    assert ab.verdict(ab.summarise(one_job, "bridge", seed=1)) == f"none: fewer than {ab.MIN_JOBS} jobs"


def _saved(seed: int, jobs: int, ratio: float) -> dict:
    rounds = [_round(1.0, 1.0 / ratio, job=j) for j in range(jobs) for _ in range(8)]
    return {
        "title": "bridge.loop / the same loop without it",
        "ranks": 2,
        "threads": 1,
        "bound": True,
        "seed": seed,
        "jobs": jobs,
        "pairs": 8,
        "load": {"start": 1.0, "end": 3.0, "seconds": 100.0},
        "state": {"threads": 16, "cores": ["0"], "online": 2},
        "rounds": {"tiny": rounds},
    }


def test_pooled_runs_keep_their_jobs_apart_and_runs_that_share_a_seed_are_refused():
    from tests.bench import pool

    result, load, args = pool.pool([_saved(1, 2, 0.98), _saved(3, 2, 1.0)])
    rounds = result["sizes"]["tiny"]
    assert sorted({r["job"] for r in rounds}) == [0, 1, 2, 3] and args.jobs == 4
    s = ab.summarise(rounds, "bridge", seed=1)
    assert s["jobs"] == 4 and s["job_min"] == pytest.approx(0.98) and s["job_max"] == pytest.approx(1.0)
    assert load["seconds"] == 200.0
    with pytest.raises(SystemExit, match="share a seed"):
        pool.pool([_saved(1, 2, 0.98), _saved(2, 2, 1.0)])
