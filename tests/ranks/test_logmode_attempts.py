"""Attempts in log mode: a relaunch seen as msrun emptying the worker logs (``app/run/logmode/attempts.py``).

The logs are real files in msrun's layout, written and then emptied the way
msrun does it at a relaunch (``open(path, "w")``); the dashboard is the real
app, read through ``GET /api/attempts`` as the page reads it.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from tests.helpers.app import make_app
from tests.helpers.workerlogs import attempts, logs_dir, relaunched, steps

TRACEBACK = 'Traceback (most recent call last):\n  File "train.py", line 3\nRuntimeError: out of memory\n'


def test_a_relaunch_that_empties_the_logs_keeps_the_attempt_it_erased(run_dir, app):
    client = app.test_client()
    logs = logs_dir(run_dir)
    steps(logs, (0, 1), 1, 7)
    [first] = attempts(app, client)
    assert (first["attempt"], first["first_step"], first["last_step"], first["end"]) == (1, 1, 7, None)
    assert first["from_logs"] and first["note"] is None
    # msrun relaunches with the same --log_dir: it opens each worker log with "w".
    steps(logs, (0,), 1, 2, mode="w")
    steps(logs, (1,), 1, 1, mode="w")
    old, new = attempts(app, client)
    # What the dashboard read of attempt 1 outlives its text.
    assert (old["attempt"], old["first_step"], old["last_step"]) == (1, 1, 7)
    assert old["end"] == "killed" and old["ended_at"] is not None  # its ranks vanished while training
    assert "log text is gone" in old["note"]
    assert (new["attempt"], new["first_step"], new["last_step"], new["end"]) == (2, 1, 2, None)
    # Rank 1's log, emptied a tick later by the same relaunch, opens no third attempt.
    steps(logs, (1,), 2, 3)
    assert [a["attempt"] for a in attempts(app, client)] == [1, 2]
    # A second relaunch after a crash: the crash is the attempt's end.
    with open(logs / "worker_1.log", "a") as f:
        f.write(TRACEBACK)
    assert attempts(app, client)[-1]["end"] is None
    steps(logs, (0, 1), 1, 1, mode="w")
    rows = attempts(app, client)
    assert [a["attempt"] for a in rows] == [1, 2, 3]
    assert rows[1]["end"] == "failed" and "out of memory" in rows[1]["error"]


def test_with_the_bridge_the_logs_are_not_the_attempts(run_dir, app):
    """A run whose bridge writes attempts.jsonl answers from it; the logs' view is only for scripts without it."""
    from trainer_bridge.rundir import attempts as bridge_attempts

    bridge_attempts.AttemptLog(run_dir, "launch-1", 2, "node-a", 4242).begin(
        started_at=time.time(), resumed=None, first_step=1, beats=[]
    )
    client = app.test_client()
    logs = logs_dir(run_dir)
    steps(logs, (0, 1), 1, 3)
    steps(logs, (0, 1), 1, 1, mode="w")
    rows = attempts(app, client)
    assert [(a["attempt"], a["launch"]) for a in rows] == [(1, "launch-1")]
    assert "from_logs" not in rows[0]


def test_a_dashboard_started_after_the_relaunch_still_lists_the_attempt_it_erased(run_dir):
    relaunched(run_dir)
    # A new dashboard: nothing in the logs says attempt 1 was ever there.
    again = make_app(run_dir)
    try:
        old, new = attempts(again, again.test_client())
    finally:
        again.extensions["rankwatch_runs"].stop()
    assert (old["attempt"], old["first_step"], old["last_step"], old["end"]) == (1, 1, 7, "killed")
    assert old["from_logs"] and "log text is gone" in old["note"] and old["ended_at"] is not None
    assert (new["attempt"], new["first_step"], new["last_step"], new["end"]) == (2, 1, 2, None)


def test_kept_attempts_are_bounded_and_a_bad_row_is_skipped(run_dir):
    """The store is in the run directory: rows anyone could have written are validated when read."""
    from app.run.logmode.attempts import MAX_KEPT

    relaunched(run_dir)
    db = Path(run_dir) / "rankwatch" / "audit.sqlite3"
    good = {"attempt": 1, "world_size": 2, "end": "killed"}
    bad = [
        "not json",
        json.dumps({**good, "attempt": -1}),
        json.dumps({**good, "end": "exploded"}),
        json.dumps({**good, "world_size": "2"}),
        json.dumps({**good, "error": "x" * 10_000}),
        json.dumps({**good, "hosts": ["h"] * 100_000}),
        "[" * 100_000,
    ]
    conn = sqlite3.connect(db)
    try:
        conn.executemany(
            "INSERT INTO log_attempts (run, attempt, row) VALUES (NULL, 1, ?)", [(b,) for b in bad]
        )
        conn.execute("INSERT INTO log_attempts (run, attempt, row) VALUES (NULL, 1, ?)", (b"\xff\x00",))
        conn.commit()
    finally:
        conn.close()
    again = make_app(run_dir)
    try:
        rows = attempts(again, again.test_client())
        kept = again.extensions["rankwatch"].state._kept.store
    finally:
        again.extensions["rankwatch_runs"].stop()
    assert [(a["attempt"], a["last_step"]) for a in rows] == [(1, 7), (2, 2)]
    assert kept.skipped == len(bad) + 1

    # A run relaunched again and again keeps its newest MAX_KEPT attempts, in memory and on disk.
    logs = logs_dir(run_dir)
    app = make_app(run_dir)
    try:
        client = app.test_client()
        assert [a["attempt"] for a in attempts(app, client)] == [1, 2]
        for _ in range(MAX_KEPT + 5):
            steps(logs, (0, 1), 1, 1, mode="w")  # the relaunch
            app.extensions["rankwatch"].state.scan(time.time())
            steps(logs, (0, 1), 2, 3)  # it trains
            app.extensions["rankwatch"].state.scan(time.time())
        rows = attempts(app, client)
    finally:
        app.extensions["rankwatch_runs"].stop()
    assert len(rows) == MAX_KEPT + 1 and rows[-1]["attempt"] == MAX_KEPT + 7
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("SELECT count(*) FROM log_attempts").fetchone()[0] == MAX_KEPT
    finally:
        conn.close()
