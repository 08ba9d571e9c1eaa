"""Issue 13, items 4 (the CSV only) and 8: the audit trail under attack.

* The CSV passed ``=``, ``+``, ``-`` and ``@`` cells through, so a reason
  typed as a formula ran in the spreadsheet that opened the export.
* A run-directory writer with no token (a forged flag plus "exited"
  heartbeats) made ``complete``/``rearm`` rows attributed to "rankwatch" that
  read like the dashboard's own word: rows derived from files are marked
  ``observed``.
* ``/api/audit.csv`` built the whole trail in memory (239 MB per request).
* One operator could write rows without bound.
"""

from __future__ import annotations

import csv
import io
import sqlite3
import time
import tracemalloc

import pytest

from app.audit import AuditLog
from tests.helpers.app import AUTH
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles


def csv_rows(client) -> list[dict]:
    r = client.get("/api/audit.csv")
    assert r.status_code == 200 and r.mimetype == "text/csv"
    return list(csv.DictReader(io.StringIO(r.get_data(as_text=True))))


FORMULAS = [
    '=HYPERLINK("http://evil.example","x")',
    "+1+1",
    "-2+3",
    "@SUM(A1)",
    "\t=1",
    "\r=1",
    "=cmd|' /C calc'!A0",
]


def test_csv_cells_that_start_a_formula_are_neutralised(app, client):
    for i, text in enumerate(FORMULAS):
        r = client.post("/api/exit", json={"reason": text, "who": text[:20]}, headers=AUTH)
        assert r.status_code == 202, r.get_json()
        if i % 2 == 0:  # alternate request and cancel, so each press is a fresh row
            client.post("/api/exit/cancel", json={"reason": text}, headers=AUTH)
    # Below the API (which strips whitespace from what is typed): a tab or CR first.
    app.extensions["rankwatch"].stop.audit.record("cancel", who="\t=2", reason="\r=3", outcome="-4")
    rows = csv_rows(client)
    reasons = [row["reason"] for row in rows]
    for text in FORMULAS:
        assert "'" + text.strip() in reasons, (text, reasons)
    assert (rows[-1]["who"], rows[-1]["reason"], rows[-1]["outcome"]) == ("'\t=2", "'\r=3", "'-4")
    for row in rows:
        for value in row.values():
            assert not value or value[0] not in "=+-@\t\r", row
        float(row["at"])  # numbers stay numbers
    # The JSON API is not a spreadsheet: it keeps the text as typed.
    assert {r["reason"] for r in client.get("/api/audit").get_json()["rows"]} >= {t.strip() for t in FORMULAS}


def test_rows_derived_from_files_are_observed_not_authenticated(app, client, run_dir):
    """B forges a stop: a flag saying stop, then heartbeats saying every rank exited."""
    write_job(run_dir, 2)
    runfiles.write_flag(run_dir, True, request_id="forged-1", requested_at=time.time(), requested_by="alice")
    for r in range(2):
        stop = {"request_id": "forged-1", "stage": "exited", "stop_step": 8, "at": {"exited": time.time()}}
        write_heartbeat(run_dir, heartbeat(r, 2, state="exited", stop=stop))
    app.extensions["rankwatch"].watcher.tick()
    rows = {r["action"]: r for r in client.get("/api/audit").get_json()["rows"]}
    assert rows["complete"]["basis"] == "observed" and rows["rearm"]["basis"] == "observed", rows
    assert rows["complete"]["who"] == "rankwatch"
    # What an operator did with the token is authenticated.
    assert client.post("/api/exit", json={"reason": "real"}, headers=AUTH).status_code == 202
    newest = client.get("/api/audit?limit=1").get_json()["rows"][0]
    assert newest["action"] == "request" and newest["basis"] == "authenticated"
    assert {row["basis"] for row in csv_rows(client)} == {"observed", "authenticated"}


OLD_SCHEMA = """
CREATE TABLE audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, action TEXT NOT NULL, request_id TEXT,
    who TEXT NOT NULL, remote_addr TEXT, reason TEXT, outcome TEXT NOT NULL, detail TEXT);
CREATE INDEX audit_request ON audit (request_id);
"""


def test_an_existing_trail_is_migrated(tmp_path):
    path = tmp_path / "audit.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript(OLD_SCHEMA)
    conn.executemany(
        "INSERT INTO audit (at, action, request_id, who, outcome) VALUES (?, ?, ?, ?, ?)",
        [
            (1.0, "request", "r1", "alice", "accepted"),
            (2.0, "complete", "r1", "rankwatch", "completed: all 2 ranks"),
            (3.0, "rearm", "r1", "rankwatch", "accepted (automatic after completion)"),
        ],
    )
    conn.commit()
    conn.close()
    audit = AuditLog(path)
    assert [(r["who"], r["basis"]) for r in reversed(audit.rows())] == [
        ("alice", "authenticated"),
        ("rankwatch", "observed"),
        ("rankwatch", "observed"),
    ]
    audit.record("cancel", who="bob", outcome="accepted")
    audit.record("complete", who="rankwatch", outcome="completed", basis="observed")
    assert [r["basis"] for r in audit.rows(limit=2)] == ["observed", "authenticated"]
    # Migrating twice (a second dashboard on the same trail) changes nothing.
    assert len(AuditLog(path).rows()) == 5


def test_the_csv_is_streamed_not_built_in_memory(app, client, run_dir):
    audit = app.extensions["rankwatch"].stop.audit
    audit.record("request", who="op", outcome="accepted")  # create the database
    conn = sqlite3.connect(audit.path)
    reason = "r" * 400
    conn.executemany(
        "INSERT INTO audit (at, action, who, reason, outcome, basis) VALUES (?, 'request', 'op', ?, 'accepted', 'authenticated')",
        [(float(i), reason) for i in range(20_000)],
    )
    conn.commit()
    conn.close()
    r = client.get("/api/audit.csv", buffered=False)
    assert r.is_streamed
    tracemalloc.start()
    total = 0
    try:
        for chunk in r.response:
            total += len(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        r.close()
    assert total > 8_000_000  # the whole trail went out...
    assert peak < 4_000_000, peak  # ...without ever being held at once (the rows as objects: 30 MB)


def test_an_operator_cannot_write_rows_without_bound(app, client):
    # A flood of stop presses: every one answered (a stop is never refused), few recorded.
    presses = [client.post("/api/exit", json={"reason": f"flood {i}"}, headers=AUTH) for i in range(200)]
    assert {r.status_code for r in presses} == {202}
    assert presses[-1].get_json()["audit_error"].startswith("not recorded: too many requests")
    # Other changes past the budget are refused.
    refused = client.post("/api/exit/rearm", json={"force": True}, headers=AUTH)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert refused.get_json()["status"] == 429
    rows = client.get("/api/audit?limit=10000").get_json()["rows"]
    assert len(rows) <= 31, len(rows)
    # Another client is not slowed down by this one.
    other = client.post(
        "/api/exit/rearm", json={"force": True}, headers=AUTH, environ_base={"REMOTE_ADDR": "127.0.0.2"}
    )
    assert other.status_code == 200, other.get_json()


def test_an_event_recorded_once_is_recorded_once_however_many_processes_see_it(tmp_path):
    """A dashboard and a waiting ``rankwatch stop`` may both see a stop complete: one row, whoever wins."""
    import multiprocessing

    path = tmp_path / "audit.sqlite3"
    AuditLog(path).record("request", who="op", outcome="accepted", request_id="r1")
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()

    def observe() -> None:
        start.wait(60)
        AuditLog(path).record("complete", who="system", outcome="completed", request_id="r1", once=True)

    procs = [ctx.Process(target=observe) for _ in range(6)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 6
    rows = AuditLog(path).rows()
    assert [r["action"] for r in rows].count("complete") == 1, rows
    # Another request's completion is its own, and a second try answers 0.
    log = AuditLog(path)
    assert log.record("complete", who="system", outcome="completed", request_id="r2", once=True) > 0
    assert log.record("complete", who="system", outcome="completed", request_id="r2", once=True) == 0


@pytest.mark.parametrize("target", ["victim.sqlite3", "new.sqlite3"])
def test_an_audit_db_swapped_for_a_symlink_after_the_check_writes_nothing_outside(
    tmp_path, monkeypatch, target
):
    """Issue 32 (a residual of P2): between the check of ``audit.sqlite3`` and SQLite's own open, a
    rank swaps the name for a symlink to a database elsewhere (or to a name where none is yet).
    SQLite resolves a symlink to text before it opens, so it wrote there. The symlink is planted at
    that very moment here (as SQLite is called); the row is now refused, and nothing elsewhere is
    written or created."""
    import os

    from app.audit import AuditError, audit_path

    run = tmp_path / "run"
    runfiles.state_dir(run).mkdir(parents=True)
    out = tmp_path / "out"
    out.mkdir()
    victim = out / "victim.sqlite3"
    conn = sqlite3.connect(victim)
    conn.execute("CREATE TABLE canary (x)")
    conn.commit()
    conn.close()
    before = victim.read_bytes()
    trail = AuditLog(audit_path(run, {"AUDIT_DB": ""}), root=run, run="r")
    trail.record("request", who="op", outcome="before")
    name = runfiles.state_dir(run) / "audit.sqlite3"
    real_connect = sqlite3.connect

    def planted(*args, **kw):
        os.rename(name, name.with_name("aside"))
        os.symlink(out / target, name)
        return real_connect(*args, **kw)

    monkeypatch.setattr(sqlite3, "connect", planted)
    with pytest.raises(AuditError, match="symlink|unable to open"):
        trail.record("request", who="op", outcome="through the symlink")
    monkeypatch.undo()
    assert victim.read_bytes() == before and sorted(os.listdir(out)) == ["victim.sqlite3"]
    os.replace(name.with_name("aside"), name)
    assert [r["outcome"] for r in trail.rows()] == ["before"]
