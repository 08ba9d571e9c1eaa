"""The audit trail: every stop request, cancel, re-arm and delete, in SQLite.

The database is ``RUN/rankwatch/audit.sqlite3`` by default (setting
``AUDIT_DB``), so it lives and dies with the run it describes and survives a
dashboard restart. Schema (one table, append-only)::

    CREATE TABLE audit (
        id          INTEGER PRIMARY KEY AUTOINCREMENT,
        at          REAL NOT NULL,  -- Unix seconds
        action      TEXT NOT NULL,  -- request | cancel | rearm | delete | complete | policy | pin | spike
        request_id  TEXT,           -- the stop request it concerns, if any
        who         TEXT NOT NULL,  -- the operator's name (typed in the page) or "rankwatch"
        remote_addr TEXT,           -- where the HTTP request came from
        reason      TEXT,           -- the operator's reason
        outcome     TEXT NOT NULL,  -- accepted | duplicate | refused: ... | completed: ...
        detail      TEXT,           -- JSON with anything else worth keeping
        basis       TEXT NOT NULL DEFAULT 'authenticated',  -- authenticated | observed | policy
        run         TEXT            -- the run id (its path below the runs root, else its name)
    )

``basis`` says what a row rests on. ``authenticated``: a request that
carried the operator token did it. ``observed``: the dashboard inferred it
from files in the run directory (the watcher's ``complete`` and automatic
``rearm`` rows, from the flag and the heartbeats), which any rank, or anyone
else who can write there, can forge. A trail written before the column
existed (``PRAGMA user_version`` 0) is migrated when first opened: its rows by
"rankwatch" become ``observed``, the others ``authenticated``.

``run`` says which run a row is about, so one ``AUDIT_DB`` can serve every
run of a runs root (or many dashboards): a trail opened for a run with
``shared`` reads that run's rows only. A trail in the run's own directory
reads every row (they are all its run's, whatever the run was called when
they were written). Rows written before the column existed (``user_version``
below 3) have none: a shared trail cannot say whose they are, so they stay
in the file and out of every run's view.

Each write opens its own connection (threads and processes may share the
file) in WAL mode with a busy timeout, so two dashboards, or two operators,
never lose a row.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import quote

from app.errors import Unavailable
from trainer_bridge.rundir import runfiles, safedirs, safeio

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
    detail      TEXT,
    basis       TEXT NOT NULL DEFAULT 'authenticated',
    run         TEXT
);
CREATE INDEX IF NOT EXISTS audit_request ON audit (request_id);
"""
# Created by the migration, after the column exists (an old trail's table has no run yet).
RUN_INDEX = "CREATE INDEX IF NOT EXISTS audit_run ON audit (run, id)"
SCHEMA_VERSION = 3  # 2: the basis column; 3: the run column
COLUMNS = (
    "id",
    "at",
    "action",
    "request_id",
    "who",
    "remote_addr",
    "reason",
    "outcome",
    "detail",
    "basis",
    "run",
)
ACTIONS = ("request", "cancel", "rearm", "delete", "complete", "policy", "pin", "spike")
AUTHENTICATED = "authenticated"
OBSERVED = "observed"
# What the automatic stop policy did: no token, and it acts on what the ranks' files say.
POLICY = "policy"
BASES = (AUTHENTICATED, OBSERVED, POLICY)
# The watcher's name in the ``who`` column (rows it writes are observed).
SYSTEM = "rankwatch"
# Longest accepted free text (reason, operator name): an audit row, not an essay.
MAX_TEXT = 500
_SELECT = "SELECT " + ", ".join(COLUMNS) + " FROM audit"
# A spreadsheet evaluates a cell that starts with one of these (OWASP, "CSV Injection").
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_CSV_BATCH = 500


def audit_path(run_dir: str | None, config) -> Path:
    """``AUDIT_DB``, else ``RUN/rankwatch/audit.sqlite3``: the trail stays with its run."""
    return (
        Path(config["AUDIT_DB"])
        if config["AUDIT_DB"]
        else runfiles.state_dir(run_dir or ".") / "audit.sqlite3"
    )


def csv_cell(value):
    """A value for the CSV export: text that a spreadsheet would run as a formula gets a
    leading ``'``, which makes it text (OWASP's advice); numbers pass unchanged."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


class AuditError(Unavailable):
    """The trail cannot be read or written (a corrupt, locked or unwritable database): a 503."""


class _Pinned(sqlite3.Connection):
    """A connection that holds its directory's descriptor (``connect_pinned``) until closed."""

    dir_fd: int | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.dir_fd is not None:
                os.close(self.dir_fd)
                self.dir_fd = None


def connect_pinned(path: Path, root: str | os.PathLike | None, timeout: float) -> sqlite3.Connection:
    """Open the SQLite database ``path`` without following a symlink to or in it; OSError or sqlite3.Error.

    The run directory is writable by every rank: ``RUN/rankwatch`` or the
    database itself could be a symlink to somewhere else, where the
    dashboard (perhaps root) would then create or write a database. So the
    directory is walked from ``root`` without following a symlink
    (``safedirs.open_dir``) and SQLite is given a path through that
    descriptor, which it keeps for the connection's life (the ``-wal`` and
    ``-shm`` files are opened by name later, and SQLite refuses a symlink
    there: it opens them ``O_NOFOLLOW``); the database and those files
    must be absent or regular files (``safeio.NotRegular`` otherwise).
    ``root`` None trusts the database's own directory as configured.

    SQLite itself resolves the symlinks of the database's path to text
    before it opens it (``/proc/self/fd/N`` becomes the directory's path),
    so a symlink put at the database's name after the check would still be
    followed. Hence the file is created here, through the descriptor and
    ``O_NOFOLLOW``; SQLite opens it without creating (``mode=rw``: a
    symlink to a file that does not exist fails); and the path SQLite
    opened must be the pinned directory's own, or the connection is closed
    before any statement, so nothing outside is ever written.
    """
    if root is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        root, rel = path.parent, ""
    else:
        rel = safeio.relative(root, path.parent) if path.parent != Path(root) else ""
    dir_fd = safedirs.open_dir(root, rel, create=True)
    try:
        pinned = f"/proc/self/fd/{dir_fd}"
        names = (path.name, *(path.name + s for s in ("-wal", "-shm", "-journal")))
        safeio.check_absent_or_regular(pinned, names)
        _create(dir_fd, path.name)
        conn = sqlite3.connect(
            f"file:{quote(f'{pinned}/{path.name}')}?mode=rw",
            timeout=timeout,
            isolation_level=None,
            factory=_Pinned,
            uri=True,
        )
        try:
            _check_opened(conn, dir_fd, path.name)
        except BaseException:
            conn.close()
            raise
    except BaseException:
        os.close(dir_fd)
        raise
    conn.dir_fd = dir_fd
    return conn


def _create(dir_fd: int, name: str) -> None:
    """Create the database file ``name`` in ``dir_fd`` if absent, without following a symlink at it.

    One this process may only read (another user's run) is checked all the same, and SQLite opens it read-only.
    """
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags | os.O_RDWR | os.O_CREAT, 0o644, dir_fd=dir_fd)
    except PermissionError:
        fd = os.open(name, flags | os.O_RDONLY, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise safeio.NotRegular(f"{name} is not a regular file (a FIFO, device or directory)")
    finally:
        os.close(fd)


def _check_opened(conn: sqlite3.Connection, dir_fd: int, name: str) -> None:
    """NotRegular unless the file SQLite opened is ``name`` in the pinned directory (no symlink taken)."""
    opened = next((row[2] for row in conn.execute("PRAGMA database_list") if row[1] == "main"), None)
    expected = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
    if opened != expected:
        raise safeio.NotRegular(f"{name} was swapped for a symlink while SQLite opened it")


# Seconds a write waits for another writer (two dashboards, the CLI); a read
# (every watcher tick) waits less. Bounded both: anyone who can write the run
# directory can hold a lock on the file, and a stop must not wait on it.
WRITE_TIMEOUT_S = 2.0

# Connections of this process set WAL mode and the schema one at a time: two of them
# switching a new database to WAL at once get SQLITE_BUSY at once (SQLite does not wait
# there), and the row the losing thread was about to write was lost.
_PREPARE_LOCK = threading.Lock()


def prepare_wal(conn: sqlite3.Connection, schema: str, migrate=None) -> None:
    """WAL mode, ``schema`` (idempotent DDL) and ``migrate(conn)``, under this process's lock."""
    with _PREPARE_LOCK:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(schema)
        if migrate is not None:
            migrate(conn)


def columns_of(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}


def add_columns(
    conn: sqlite3.Connection,
    table: str,
    added: Sequence[tuple[str, str, Sequence[tuple[str, tuple]]]],
    then: Sequence[str] = (),
) -> None:
    """Migrate a table an older dashboard wrote, in one transaction under a write lock.

    ``added`` holds ``(column, declaration, backfill statements)``: each
    column ``table`` lacks is added and its backfill run (the columns are
    read again under the lock, so two dashboards migrating at once add each
    column once). ``then`` is run after them (an index on the new columns,
    a ``user_version``). Both the audit trail and the delivery log, which
    share a file, migrate through this.
    """
    conn.execute("BEGIN IMMEDIATE")
    try:
        have = columns_of(conn, table)
        for name, declaration, backfill in added:
            if name not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")
                for sql, args in backfill:
                    conn.execute(sql, args)
        for sql in then:
            conn.execute(sql)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


READ_TIMEOUT_S = 0.5


class AuditLog:
    def __init__(
        self,
        path: str | Path,
        root: str | os.PathLike | None = None,
        *,
        run: str | None = None,
        shared: bool = False,
    ):
        self.path = Path(path)
        # The run directory when the trail lives in it: walked without following a symlink.
        self.root = root
        # The run every row written here is about; with ``shared``, the only run read back.
        self.run = run
        self.shared = shared and run is not None

    def _where(self, **equal) -> tuple[str, list]:
        """A `` WHERE`` clause and its arguments: each column in ``equal`` and, if shared, this run."""
        if self.shared:
            equal["run"] = self.run
        clause = " AND ".join(f"{column} = ?" for column in equal)
        return (f" WHERE {clause}" if clause else ""), list(equal.values())

    def _connect(self, timeout: float = WRITE_TIMEOUT_S) -> sqlite3.Connection:
        try:
            conn = connect_pinned(self.path, self.root, timeout)
        except (OSError, ValueError, sqlite3.Error) as e:
            why = safeio.why(e) if isinstance(e, OSError) else str(e)
            raise AuditError(f"cannot open the audit trail {self.path}: {why}") from None
        try:
            prepare_wal(conn, SCHEMA, self._migrate)
        except sqlite3.Error as e:
            conn.close()
            raise AuditError(f"cannot use the audit trail {self.path}: {e}") from None
        return conn

    @staticmethod
    def _migrate(conn: sqlite3.Connection) -> None:
        """Bring a trail written by an older dashboard to ``SCHEMA_VERSION``, once, under a write lock."""
        if conn.execute("PRAGMA user_version").fetchone()[0] >= SCHEMA_VERSION:
            return
        add_columns(
            conn,
            "audit",
            [
                (
                    "basis",
                    f"TEXT NOT NULL DEFAULT '{AUTHENTICATED}'",
                    [("UPDATE audit SET basis = ? WHERE who = ?", (OBSERVED, SYSTEM))],
                ),
                # Old rows keep none: nothing in them says which run they were about.
                ("run", "TEXT", []),
            ],
            then=[RUN_INDEX, f"PRAGMA user_version = {SCHEMA_VERSION}"],
        )

    def record(
        self,
        action: str,
        *,
        who: str,
        outcome: str,
        request_id: str | None = None,
        remote_addr: str | None = None,
        reason: str | None = None,
        detail: dict | None = None,
        basis: str = AUTHENTICATED,
        once: bool = False,
    ) -> int:
        """Append one row and return its id; AuditError if the trail cannot take it.

        ``basis`` is ``observed`` for rows the dashboard derives from the run
        directory's files rather than from a request that carried the token.
        ``once``: only if no row of this action and ``request_id`` exists yet,
        checked and inserted in one statement (SQLite serialises writers), so
        that processes that observe the same event at once (a dashboard and a
        ``rankwatch stop`` waiting) record it once; 0 when it was already there.
        """
        if action not in ACTIONS:
            raise ValueError(f"AuditLog.record: unknown action {action!r}")
        if basis not in BASES:
            raise ValueError(f"AuditLog.record: basis must be one of {BASES}, not {basis!r}")
        conn = self._connect()
        try:
            values = (
                time.time(),
                action,
                request_id,
                who,
                remote_addr,
                reason,
                outcome,
                json.dumps(detail, sort_keys=True) if detail else None,
                basis,
                self.run,
            )
            insert = (
                "INSERT INTO audit"
                " (at, action, request_id, who, remote_addr, reason, outcome, detail, basis, run)"
            )
            if not once:
                return conn.execute(insert + " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", values).lastrowid
            where, args = self._where(action=action, request_id=request_id)
            cur = conn.execute(
                insert
                + " SELECT ?, ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE NOT EXISTS (SELECT 1 FROM audit"
                + where
                + ")",
                (*values, *args),
            )
            return cur.lastrowid if cur.rowcount else 0
        except sqlite3.Error as e:
            raise AuditError(f"cannot write to the audit trail {self.path}: {e}") from None
        finally:
            conn.close()

    def rows(self, limit: int | None = None, request_id: str | None = None) -> list[dict]:
        """Newest first (this run's only, if shared). An absent database is an empty trail, not an error."""
        if not self.path.exists():
            return []
        conn = self._connect(READ_TIMEOUT_S)
        try:
            where, args = self._where(**({"request_id": request_id} if request_id is not None else {}))
            sql = _SELECT + where + " ORDER BY id DESC"
            if limit is not None:
                sql += " LIMIT ?"
                args.append(limit)
            return [dict(zip(COLUMNS, r, strict=True)) for r in conn.execute(sql, args)]
        except (sqlite3.Error, ValueError) as e:  # ValueError: rows of another shape
            raise AuditError(f"cannot read the audit trail {self.path}: {e}") from None
        finally:
            conn.close()

    def last_id(self) -> int | None:
        """The newest row's id (None for an empty or absent trail): cheap enough for every tick."""
        if not self.path.exists():
            return None
        conn = self._connect(READ_TIMEOUT_S)
        try:
            where, args = self._where()
            return conn.execute("SELECT max(id) FROM audit" + where, args).fetchone()[0]
        except sqlite3.Error as e:
            raise AuditError(f"cannot read the audit trail {self.path}: {e}") from None
        finally:
            conn.close()

    def iter_csv(self) -> Iterator[str]:
        """The whole trail as CSV, oldest first, in chunks of a few hundred rows.

        Streamed: memory stays that of one chunk however long the trail. Cells
        that would start a spreadsheet formula are neutralised (``csv_cell``).
        The database is opened now (AuditError if it cannot be), read as the
        chunks are taken.
        """
        return self._csv_chunks(self._connect() if self.path.exists() else None, *self._where())

    @staticmethod
    def _csv_chunks(conn: sqlite3.Connection | None, where: str = "", args=()) -> Iterator[str]:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(COLUMNS)
        yield out.getvalue()
        if conn is None:
            return
        try:
            cursor = conn.execute(_SELECT + where + " ORDER BY id", args)
            while batch := cursor.fetchmany(_CSV_BATCH):
                out.seek(0)
                out.truncate()
                writer.writerows([csv_cell(v) for v in row] for row in batch)
                yield out.getvalue()
        except sqlite3.Error as e:
            # Headers are gone by now: say so in the file rather than end it silently.
            yield f"# the audit trail could not be read to its end: {e}\n"
        finally:
            conn.close()
