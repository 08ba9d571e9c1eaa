"""One ``AUDIT_DB`` shared by the runs of a root: each row carries its run, each run reads its own.

The same holds for the alerts' delivery log, which lives in the same file.
"""

from __future__ import annotations

import csv
import io
import sqlite3

from app import create_app
from app.compose import build
from tests.helpers.app import TOKEN, make_app, operator, wait_for
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.receiver import Receiver

# A trail written by a dashboard before the run column (schema 2: the basis column).
V2_SCHEMA = """
CREATE TABLE audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, action TEXT NOT NULL, request_id TEXT,
    who TEXT NOT NULL, remote_addr TEXT, reason TEXT, outcome TEXT NOT NULL, detail TEXT,
    basis TEXT NOT NULL DEFAULT 'authenticated');
CREATE INDEX audit_request ON audit (request_id);
PRAGMA user_version = 2;
"""
# A delivery log written before its run column, with one delivered stop alert.
OLD_DELIVERIES = """
CREATE TABLE alert_deliveries (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, alert_id TEXT NOT NULL, event TEXT NOT NULL,
    target TEXT NOT NULL, attempt INTEGER NOT NULL, outcome TEXT NOT NULL, text TEXT, dedup_key TEXT);
CREATE INDEX alert_deliveries_key ON alert_deliveries (dedup_key);
INSERT INTO alert_deliveries (at, alert_id, event, target, attempt, outcome, text, dedup_key)
    VALUES (1.0, 'old', 'stop_requested', 'http://x', 1, 'delivered (HTTP 200)', 'an old stop', 'old');
"""
A, B = "a", "team/b"


def old_trail(path) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(V2_SCHEMA)
    conn.execute(
        "INSERT INTO audit (at, action, request_id, who, outcome) VALUES (1.0, 'request', 'old', 'carol', 'accepted')"
    )
    conn.commit()
    conn.close()


def segment(run_id: str) -> str:
    return run_id.replace("/", "~2F")


def stop(client, run_id: str, who: str) -> str:
    r = client.post(
        f"/api/runs/{run_id.replace('/', '~2F')}/exit", json={"reason": "t", "who": who}, headers=operator()
    )
    assert r.status_code == 202, r.get_json()
    return r.get_json()["request_id"]


def test_a_shared_audit_db_keeps_each_runs_rows_apart(tmp_path):
    root, db = tmp_path / "root", tmp_path / "shared" / "audit.sqlite3"
    db.parent.mkdir()
    old_trail(db)
    for rel in (A, B):
        write_job(root / rel, 1)
        write_heartbeat(root / rel, heartbeat(0, 1))
    settings = {
        "TESTING": True,
        "TOKEN": TOKEN,
        "STALL_MIN_S": 600.0,
        "DEAD_AFTER_S": 900.0,
        "AUDIT_DB": str(db),
    }
    app = create_app({"RUNS_ROOT": str(root), **settings})
    client = app.test_client()
    try:
        rid_a, rid_b = stop(client, A, "alice"), stop(client, B, "bob")
        for run_id, who, rid in ((A, "alice", rid_a), (B, "bob", rid_b)):
            seg = run_id.replace("/", "~2F")
            rows = client.get(f"/api/runs/{seg}/audit").get_json()["rows"]
            assert [(r["run"], r["who"], r["request_id"]) for r in rows] == [(run_id, who, rid)]
            exported = list(
                csv.DictReader(io.StringIO(client.get(f"/api/runs/{seg}/audit.csv").get_data(as_text=True)))
            )
            assert [(r["run"], r["who"]) for r in exported] == [(run_id, who)]
        assert "the shared <code>AUDIT_DB</code> (this run's rows)" in client.get("/runs/a/").get_data(
            as_text=True
        )
        rows = {r["id"]: r for r in client.get("/api/runs").get_json()["runs"]}
        assert (
            rows[A]["last_stop"]["requested_by"] == "alice" and rows[B]["last_stop"]["requested_by"] == "bob"
        )
    finally:
        app.extensions["rankwatch_runs"].stop()

    # One file holds both runs' rows, and the old row, whose run nothing can tell, is kept without one.
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
        got = set(conn.execute("SELECT run, who FROM audit WHERE action = 'request'"))
    finally:
        conn.close()
    assert got == {(None, "carol"), (A, "alice"), (B, "bob")}

    # The same run under --run-dir, and from the CLI's engines with RUNS_ROOT, has the same id.
    single = make_app(root / A, AUDIT_DB=str(db))
    try:
        assert [r["who"] for r in single.test_client().get("/api/audit").get_json()["rows"]] == ["alice"]
    finally:
        single.extensions["rankwatch_runs"].stop()
    run = build(str(root / B), {**app.config, "RUNS_ROOT": str(root)}, live=False)
    assert run.audit.run == B and [r["who"] for r in run.audit.rows()] == ["bob"]
    assert run.audit.last_id() == max(
        i for (i,) in sqlite3.connect(db).execute("SELECT id FROM audit WHERE run = 'team/b'")
    )


def test_a_trail_in_its_run_directory_reads_every_row(tmp_path):
    """Without AUDIT_DB the file is the run's: rows written before the column, or under another name, stay."""
    run = tmp_path / "renamed"
    (run / "rankwatch").mkdir(parents=True)
    old_trail(run / "rankwatch" / "audit.sqlite3")
    app = make_app(run)
    try:
        client = app.test_client()
        client.post("/api/exit", json={"reason": "t", "who": "dave"}, headers=operator())
        rows = client.get("/api/audit").get_json()["rows"]
        assert [(r["who"], r["run"]) for r in rows] == [("dave", "renamed"), ("carol", None)]
    finally:
        app.extensions["rankwatch_runs"].stop()


def test_a_shared_delivery_log_has_each_runs_deliveries_and_migrates_an_old_one(tmp_path):
    root, db = tmp_path / "root", tmp_path / "shared" / "audit.sqlite3"
    db.parent.mkdir()
    old_trail(db)
    conn = sqlite3.connect(db)
    conn.executescript(OLD_DELIVERIES)
    conn.close()
    for rel in (A, B):
        write_job(root / rel, 1)
        write_heartbeat(root / rel, heartbeat(0, 1))
    with Receiver() as receiver:
        app = create_app(
            {
                "RUNS_ROOT": str(root),
                "TESTING": True,
                "TOKEN": TOKEN,
                "STALL_MIN_S": 600.0,
                "DEAD_AFTER_S": 900.0,
                "AUDIT_DB": str(db),
                "WEBHOOK_URL": receiver.url,
            }
        )
        client = app.test_client()
        registry = app.extensions["rankwatch_runs"]
        try:
            rids = {A: stop(client, A, "alice"), B: stop(client, B, "bob")}
            for run_id in (A, B):
                registry.get(run_id).watcher.tick()
            receiver.wait_for(
                lambda got: len([p for p in got if p["event"] == "stop_requested"]) == 2, "two stops"
            )
            for run_id, rid in rids.items():
                body = wait_for(
                    lambda run_id=run_id: client.get(f"/api/runs/{segment(run_id)}/alerts").get_json()[
                        "rows"
                    ],
                    f"{run_id}'s delivery row",
                )
                assert [(r["run"], r["dedup_key"].endswith(rid), r["outcome"]) for r in body] == [
                    (run_id, True, "delivered (HTTP 200)")
                ]
        finally:
            for run_id in registry.open_ids():
                registry.peek(run_id).incidents.alerts.sender.close()
            registry.stop()

    # The old log gained the column; its row, whose run nothing can tell, is kept without one.
    conn = sqlite3.connect(db)
    try:
        got = set(conn.execute("SELECT run, alert_id FROM alert_deliveries WHERE event = 'stop_requested'"))
        indexes = {row[1] for row in conn.execute("PRAGMA index_list(alert_deliveries)")}
    finally:
        conn.close()
    assert {run for run, _ in got} == {None, A, B} and (None, "old") in got
    assert "alert_deliveries_run" in indexes
