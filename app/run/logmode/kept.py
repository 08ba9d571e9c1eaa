"""Log-mode attempts kept across dashboard restarts, in the audit database.

msrun empties the worker logs when it relaunches a job, so what a dashboard
read of an earlier attempt (``attempts.LogAttempts``) exists nowhere else:
a dashboard restarted after the relaunch would know only the current
attempt. Each attempt it closes is therefore written to the ``log_attempts``
table of the audit database (``AUDIT_DB``, by default
``RUN/rankwatch/audit.sqlite3``) and read back when a dashboard first reads
the run's logs. That file, not a file of its own in ``RUN/rankwatch/``,
because it is already the dashboard's store for what outlives it (the audit
trail, the alerts' delivery log): opened without following a symlink,
shared by several dashboards in WAL mode, and keyed by run when one
``AUDIT_DB`` serves a runs root (``AuditLog.shared``: a run reads back its
own rows; a file in the run's directory is all that run's)::

    CREATE TABLE log_attempts (
        id      INTEGER PRIMARY KEY AUTOINCREMENT,
        run     TEXT,              -- the run id, as the audit trail's
        attempt INTEGER NOT NULL,  -- its number, as the page shows it
        row     TEXT NOT NULL      -- what was read of it (``KeptAttempt``), as JSON
    )

Bounded: a run keeps its newest ``MAX_KEPT`` rows (older ones are deleted
as new ones come), and reading takes at most that many. The file sits in
the run directory, which every rank can write, so each row is validated
when read back (``KeptAttempt``, strict and bounded); a row that fails is
skipped and counted, and a database that cannot be opened or read is a
warning in the log: the current attempt is still shown from its logs.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import Annotated, Literal

from pydantic import Field

from app.audit import READ_TIMEOUT_S, WRITE_TIMEOUT_S, AuditLog, connect_pinned, prepare_wal
from app.run.logmode.attempts import MAX_KEPT, LogAttempts
from trainer_bridge.rundir import safeio, schema

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS log_attempts (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    run     TEXT,
    attempt INTEGER NOT NULL,
    row     TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS log_attempts_run ON log_attempts (run, id);
"""
# A row is a few hundred bytes (an error line at most MAX_ERROR): anything far larger is not ours.
MAX_ROW_BYTES = 16 * 1024


class KeptAttempt(schema._Model):
    """What the dashboard read of one closed log-mode attempt: the fields worth keeping, bounded."""

    attempt: schema.AttemptNo
    started_at: schema.UnixTime | None = None
    world_size: Annotated[int, Field(ge=0, le=schema.MAX_RANKS)]
    hosts: schema.Hosts = Field(default_factory=list)
    first_step: schema.Count | None = None
    last_step: schema.Count | None = None
    ended_at: schema.UnixTime | None = None
    end: Literal["graceful_stop", "finished", "failed", "killed", "unknown"]
    request_id: schema.RequestId | None = None
    error: Annotated[str, Field(max_length=schema.MAX_ERROR)] | None = None


class KeptAttempts:
    """One run's closed log-mode attempts in the audit database (see the module's docstring)."""

    def __init__(self, audit: AuditLog):
        self.path = audit.path
        self.root = audit.root
        self.run = audit.run
        self.shared = audit.shared
        self.loaded = False
        self.skipped = 0  # rows read back that failed validation

    def _connect(self, timeout: float) -> sqlite3.Connection:
        conn = connect_pinned(self.path, self.root, timeout)
        try:
            prepare_wal(conn, SCHEMA)
        except BaseException:
            conn.close()
            raise
        return conn

    def _where(self) -> tuple[str, tuple]:
        return (" WHERE run = ?", (self.run,)) if self.shared else ("", ())

    def load(self) -> list[dict]:
        """The kept attempts, oldest first, one per number (its newest row); [] if none or unreadable."""
        self.loaded = True
        if not self.path.exists():
            return []
        try:
            conn = self._connect(READ_TIMEOUT_S)
            try:
                where, args = self._where()
                found = conn.execute(
                    f"SELECT row FROM log_attempts{where} ORDER BY id DESC LIMIT ?", (*args, MAX_KEPT)
                ).fetchall()
            finally:
                conn.close()
        except (OSError, ValueError, sqlite3.Error) as e:
            log.warning("log-mode attempts: cannot read %s: %s", self.path, _why(e))
            return []
        by_number: dict[int, dict] = {}
        for (text,) in found:
            try:
                if not isinstance(text, str) or len(text) > MAX_ROW_BYTES:
                    raise schema.SchemaError("not a row of ours")
                row = schema.parse(KeptAttempt, text).to_dict()
            except schema.SchemaError:
                self.skipped += 1
                continue
            by_number.setdefault(row["attempt"], row)  # newest first: the first seen wins
        return [by_number[n] for n in sorted(by_number)]

    def save(self, rows: list[dict]) -> bool:
        """Append closed attempts' rows and trim the run's to ``MAX_KEPT``; False (logged) if it cannot."""
        if not rows:
            return True
        kept = []
        for row in rows:
            try:
                kept.append(
                    schema.build(KeptAttempt, **{k: row[k] for k in KeptAttempt.model_fields if k in row})
                )
            except schema.SchemaError as e:  # a figure out of bounds: shown, not kept
                log.warning("log-mode attempts: attempt %s not kept: %s", row.get("attempt"), e)
        try:
            conn = self._connect(WRITE_TIMEOUT_S)
            try:
                conn.execute("BEGIN IMMEDIATE")
                conn.executemany(
                    "INSERT INTO log_attempts (run, attempt, row) VALUES (?, ?, ?)",
                    [(self.run, k.attempt, k.model_dump_json()) for k in kept],
                )
                where, args = self._where()
                conn.execute(
                    f"DELETE FROM log_attempts{where}{' AND' if where else ' WHERE'} id NOT IN"
                    f" (SELECT id FROM log_attempts{where} ORDER BY id DESC LIMIT ?)",
                    (*args, *args, MAX_KEPT),
                )
                conn.execute("COMMIT")
            finally:
                conn.close()
        except (OSError, ValueError, sqlite3.Error) as e:
            log.warning("log-mode attempts: cannot keep %d in %s: %s", len(rows), self.path, _why(e))
            return False
        return True


def _why(e: Exception) -> str:
    return safeio.why(e) if isinstance(e, OSError) else str(e)


class KeptLink:
    """A ``KeptAttempts`` joined to a log view's attempts (``RunState.keep_log_attempts``).

    ``restore`` reads the kept rows back once, before the logs are first
    read; ``save`` writes each scan's newly closed attempts. The database is
    read and written outside the view's ``lock``: a slow or locked file
    delays neither a tick's other work nor a stop.
    """

    def __init__(self, store: KeptAttempts, attempts: LogAttempts, lock: threading.Lock):
        self.store = store
        self.attempts = attempts
        self.lock = lock

    def restore(self) -> None:
        """Before the logs are first read: the attempts an earlier dashboard kept."""
        if self.store.loaded:
            return
        rows = self.store.load()
        with self.lock:
            self.attempts.restore(rows)

    def save(self) -> None:
        with self.lock:
            rows = self.attempts.take_unsaved()
        if rows:
            self.store.save(rows)
