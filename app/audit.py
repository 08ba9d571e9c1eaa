"""The audit trail: every stop request, cancel, re-arm and delete, in SQLite.

The database is ``RUN/rankwatch/audit.sqlite3`` by default (setting
``AUDIT_DB``), so it lives and dies with the run it describes and survives a
dashboard restart. Schema (one table, append-only)::

    CREATE TABLE audit (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        at          REAL NOT NULL,  -- Unix seconds
        action      TEXT NOT NULL,  -- request | cancel | rearm | delete | complete
        request_id  TEXT,           -- the stop request it concerns, if any
        who         TEXT NOT NULL,  -- the operator's name (typed in the page) or "rankwatch"
        remote_addr TEXT,           -- where the HTTP request came from
        reason      TEXT,           -- the operator's reason
        outcome     TEXT NOT NULL,  -- accepted | duplicate | refused: ... | completed: ...
        detail      TEXT            -- JSON with anything else worth keeping
    )

Each write opens its own connection (threads and processes may share the
file) in WAL mode with a busy timeout, so two dashboards, or two operators,
never lose a row.
"""
from __future__ import annotations

import csv
import io
import json
import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS audit (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    at          REAL NOT NULL,
    action      TEXT NOT NULL,
    request_id  TEXT,
    who         TEXT NOT NULL,
    remote_addr TEXT,
    reason      TEXT,
    outcome     TEXT NOT NULL,
    detail      TEXT
);
CREATE INDEX IF NOT EXISTS audit_request ON audit (request_id);
"""
COLUMNS = ("id", "at", "action", "request_id", "who", "remote_addr", "reason", "outcome", "detail")
ACTIONS = ("request", "cancel", "rearm", "delete", "complete")


class AuditLog:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, timeout=10.0, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(SCHEMA)
        return conn

    def record(self, action: str, *, who: str, outcome: str, request_id: str | None = None,
               remote_addr: str | None = None, reason: str | None = None,
               detail: dict | None = None) -> int:
        """Append one row and return its id."""
        if action not in ACTIONS:
            raise ValueError(f"AuditLog.record: unknown action {action!r}")
        conn = self._connect()
        try:
            cur = conn.execute(
                "INSERT INTO audit (at, action, request_id, who, remote_addr, reason, outcome, detail)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (time.time(), action, request_id, who, remote_addr, reason, outcome,
                 json.dumps(detail, sort_keys=True) if detail else None))
            return cur.lastrowid
        finally:
            conn.close()

    def rows(self, limit: int | None = None, request_id: str | None = None) -> list[dict]:
        """Newest first. An absent database is an empty trail, not an error."""
        if not self.path.exists():
            return []
        conn = self._connect()
        try:
            sql, args = "SELECT * FROM audit", []
            if request_id is not None:
                sql += " WHERE request_id = ?"
                args.append(request_id)
            sql += " ORDER BY id DESC"
            if limit is not None:
                sql += " LIMIT ?"
                args.append(limit)
            return [dict(zip(COLUMNS, r)) for r in conn.execute(sql, args)]
        finally:
            conn.close()

    def has(self, action: str, request_id: str) -> bool:
        return any(r["action"] == action for r in self.rows(request_id=request_id))

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        for row in reversed(self.rows()):
            writer.writerow([row[c] for c in COLUMNS])
        return out.getvalue()
