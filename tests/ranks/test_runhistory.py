"""The whole-run chart series (app/run/history.py) with real objects: aggregation, attempts,
thinning, the cap, bad points, seeding from real history files and the route."""

from __future__ import annotations

import json
import math

import pytest

from app.run.heartbeats import read_history_tail
from app.run.history import KEEP_WHOLE_S, MAX_OPEN, OPEN_S, THIN_EVERY_S, THIN_S, RunHistory
from tests.helpers.app import wait_for
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

T0 = 1.7e9


def run_1hz(hist: RunHistory, seconds: int, ranks: int = 2, launch: str | None = "L1", first_step: int = 1):
    """One step a second for ``seconds``, every rank reporting each step (loss falling, step time 100 ms)."""
    for i in range(seconds):
        t, step = T0 + i, first_step + i
        for r in range(ranks):
            hist.feed(r, (t + r * 0.1, step, 2.3 / (1 + step / 500) + r * 0.01, 100.0 + 10 * r), launch)


def points(answer: dict, launch: str | None = "L1") -> list[list]:
    (row,) = [a for a in answer["attempts"] if a["launch"] == launch]
    return row["points"]


def test_one_point_per_step_mean_loss_median_and_max_step_time():
    hist = RunHistory(10_000)
    for r, (loss, ms) in enumerate([(2.0, 100.0), (2.2, 130.0), (2.4, 400.0)]):
        hist.feed(r, (T0 + r * 0.2, 7, loss, ms), "L1")
    hist.feed(0, (T0 + 1, 8, 1.9, 90.0), "L1")
    (p7, p8) = points(hist.answer([]))
    assert p7[0] == 7 and p7[1] == T0 and p7[2] == pytest.approx(2.2) and p7[3:] == [130.0, 400.0]
    assert p8[:3] == [8, T0 + 1, 1.9]


def test_bad_and_missing_fields_are_ignored():
    hist = RunHistory(10_000)
    bad = [
        (),
        (T0,),
        (T0, None, 2.0, 10.0),  # no global step: before the first step
        (T0 + 1, 5, None, None),  # nothing to draw
        (math.nan, 6, 2.0, 10.0),
        (math.inf, 6, 2.0, 10.0),
        ("soon", 6, 2.0, 10.0),
        (T0 + 2, "six", 2.0, 10.0),
        (T0 + 3, True, 2.0, 10.0),
        (T0 + 4, -3, 2.0, 10.0),
    ]
    for p in bad:
        hist.feed(0, p, "L1")
    hist.feed(0, (T0 + 5, 6, math.nan, 10.0), "L1")  # a NaN loss: the step time still counts
    hist.feed(1, (T0 + 5.5, 6, "x", -4.0), 12345)  # junk values and a launch that is no string
    hist.feed(0, (T0 + 4.5, 9, 1.0, 1.0), "L1")  # older than rank 0's last point: taken already
    ans = hist.answer([])
    assert points(ans) == [[6, T0 + 5, None, 10.0, 10.0]]
    assert [a["launch"] for a in ans["attempts"]] == ["L1"]
    json.dumps(ans, allow_nan=False)


def test_replay_is_a_branch_not_an_overwrite():
    hist = RunHistory(10_000)
    run_1hz(hist, 100, launch="A")  # steps 1..100
    for i, step in enumerate(range(51, 81)):  # B resumed from step 50's set: replays 51..80
        for r in range(2):
            hist.feed(r, (T0 + 500 + i + r * 0.1, step, 0.5, 80.0), "B")
    rows = [
        {"attempt": 1, "launch": "A", "started_at": T0 - 5, "first_step": 1, "end": "graceful_stop"},
        {"attempt": 2, "launch": "B", "started_at": T0 + 490, "first_step": 51, "replayed": [51, 100]},
    ]
    ans = hist.answer(rows)
    a, b = ans["attempts"]
    assert (a["attempt"], b["attempt"]) == (1, 2) and b["replayed"] == [51, 100]
    assert [p[0] for p in a["points"]] == list(range(1, 101))
    assert [p[0] for p in b["points"]] == list(range(51, 81))
    assert all(p[2] == 0.5 for p in b["points"])
    assert all(p[2] != 0.5 for p in a["points"])  # A's steps 51..80 kept as A trained them


def test_last_hour_whole_older_points_one_a_minute():
    hist = RunHistory(10_000)
    run_1hz(hist, 3 * 3600)
    ans = hist.answer([])
    pts = points(ans)
    newest = pts[-1][1]
    recent = [p for p in pts if p[1] >= newest - KEEP_WHOLE_S]
    # Every step of the last hour is there (the newest ones still open, but answered).
    steps = [p[0] for p in recent]
    assert steps == list(range(steps[0], steps[-1] + 1)) and len(steps) >= KEEP_WHOLE_S - 1
    older = [p for p in pts if p[1] < newest - KEEP_WHOLE_S]
    thinned_until = ans["thinned"][-1]["to"]
    bins = [math.floor(p[1] / THIN_S) for p in older if p[1] < thinned_until]
    assert len(bins) == len(set(bins)) and len(bins) >= 100  # one a minute, about two hours of them
    assert ans["thinned"][0]["every_s"] == THIN_S and ans["thinned"][0]["from"] <= T0 + 60
    # A thinned point is its minute's mean loss and its largest step time.
    assert all(p[4] == 110.0 for p in older)
    assert older[0][2] < 2.3 and ans["count"] == len(hist) <= 10_000


def test_the_cap_holds_over_a_day_at_1hz_and_the_oldest_range_widens():
    hist = RunHistory(10_000)
    most = 0
    for hour in range(24):
        for i in range(3600):
            t = T0 + hour * 3600 + i
            hist.feed(0, (t, hour * 3600 + i + 1, 1.0, 50.0), "L1")
        most = max(most, len(hist))
    # The last hour, at most one batch of aged points not yet thinned, and a point a minute before.
    assert most <= 10_000 and len(hist) < KEEP_WHOLE_S + THIN_EVERY_S + 24 * 60 + 10
    small = RunHistory(1000)
    for i in range(24 * 3600):
        small.feed(0, (T0 + i, i + 1, 1.0, 50.0), "L1")
        assert len(small) <= 1000
    ans = small.answer([])
    assert ans["count"] <= 1000 and ans["cap"] == 1000
    assert ans["thinned"][0]["every_s"] > THIN_S  # the oldest range coarser than a minute
    pts = points(ans)
    assert pts[0][0] <= 3600 and pts[-1][0] == 24 * 3600  # still from the first hour to the end


def test_partial_answers_and_generation():
    hist = RunHistory(10_000)
    run_1hz(hist, 60)
    full = hist.answer([])
    assert not full["partial"]
    newest = points(full)[-1][1]
    run_1hz(hist, 70)  # the same first 60 are ignored per rank (older times), 60..69 are new
    part = hist.answer([], after=newest, generation=full["generation"])
    assert part["partial"]
    got = [p[0] for p in points(part)]
    assert got[0] >= 60 - OPEN_S - 1 and got[-1] == 70
    # Another generation (a thinning since): everything again.
    stale = hist.answer([], after=newest, generation=full["generation"] + 1)
    assert not stale["partial"] and [p[0] for p in points(stale)] == list(range(1, 71))


def test_seeded_from_real_history_files_by_attempt_start(run_dir):
    write_job(run_dir, 2)
    for seq in range(1, 41):
        for r in range(2):
            launch = "A" if seq <= 20 else "B"
            step = seq if seq <= 20 else seq - 10  # B resumed from step 10: replays 11..20, then on
            write_heartbeat(
                run_dir,
                heartbeat(r, 2, seq=seq, now=T0 + seq + r * 0.1, global_step=step, launch=launch),
            )
    tails = {r: read_history_tail(run_dir, r, 4096) for r in range(2)}
    hist = RunHistory(10_000)
    hist.seed(tails, [(T0, "A"), (T0 + 20.5, "B")])
    ans = hist.answer([{"attempt": 1, "launch": "A"}, {"attempt": 2, "launch": "B"}])
    a, b = ans["attempts"]
    assert [p[0] for p in a["points"]] == list(range(1, 21))
    assert [p[0] for p in b["points"]] == list(range(11, 31))
    assert runfiles.history_path(run_dir, 0).exists()


def test_route_per_run_and_under_a_runs_root(tmp_path):
    from app import create_app
    from tests.helpers.app import FAST_SETTINGS

    for rel in ("x", "team/y"):
        write_job(tmp_path / rel, 2)
    for seq in range(1, 6):
        for r in range(2):
            write_heartbeat(
                tmp_path / "x", heartbeat(r, 2, seq=seq, now=T0 + seq, global_step=seq, loss=1.0 + r)
            )
            write_heartbeat(
                tmp_path / "team/y", heartbeat(r, 2, seq=seq, now=T0 + seq, global_step=100 + seq)
            )
    app = create_app({"RUNS_ROOT": str(tmp_path), "TESTING": True, **FAST_SETTINGS})
    client = app.test_client()
    try:
        body = client.get("/api/runs/x/history/run").get_json()
        (row,) = body["attempts"]
        assert [p[0] for p in row["points"]] == [1, 2, 3, 4, 5] and row["points"][0][2] == 1.5
        assert body["cap"] == 10_000 and body["thinned"] == []
        other = client.get("/api/runs/team~2Fy/history/run").get_json()
        assert [p[0] for p in other["attempts"][0]["points"]] == [101, 102, 103, 104, 105]
        part = client.get(
            f"/api/runs/x/history/run?after={T0 + 5}&generation={body['generation']}"
        ).get_json()
        assert part["partial"]
        for bad in ("after=x", "after=-1", "after=nan", "generation=-1", "generation=1.5"):
            res = client.get(f"/api/runs/x/history/run?{bad}")
            assert res.status_code == 400 and set(res.get_json()) == {"error", "status"}, bad
        assert client.get("/api/history/run").status_code == 404  # under a root a run is named
    finally:
        app.extensions["rankwatch_runs"].stop()


def test_route_with_one_run_dir(client, run_dir):
    assert client.get("/api/history/run").get_json()["attempts"] == []
    write_job(run_dir, 1)
    for seq in range(1, 4):
        write_heartbeat(
            run_dir, heartbeat(0, 1, seq=seq, now=T0 + seq, global_step=seq, launch="L9", started_at=T0)
        )
    # No attempts.jsonl: the history lines (seeded) take the launch of the heartbeat of their process.
    wait_for(lambda: client.get("/api/history/run").get_json()["attempts"], "the series")
    body = client.get("/api/history/run").get_json()
    assert [(a["launch"], [p[0] for p in a["points"]]) for a in body["attempts"]] == [("L9", [1, 2, 3])]


def test_open_steps_stay_bounded_when_every_rank_reports_another_step():
    hist = RunHistory(10_000)
    for r in range(MAX_OPEN + 500):
        hist.feed(r, (T0 + 0.001 * (r % 7), r, 1.0, 5.0), None if r % 2 else "L1")
    assert len(hist._open) <= MAX_OPEN and len(hist) + len(hist._open) == MAX_OPEN + 500
