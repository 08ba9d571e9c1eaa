"""Webhook delivery: a background sender with retries, and a log of every attempt.

``WebhookSender.send`` only appends to a bounded in-memory queue and
returns, so the watcher tick that raises an alert never waits for a network
call. Each URL gets its own worker thread (started on its first alert), so a
receiver that hangs delays only its own deliveries. A worker posts its
queue's alerts in order; a failed attempt (no connection, a timeout, HTTP
5xx, 408 or 429) is retried after 1, 2, 4, 8, 16 and then every
``WEBHOOK_RETRY_MAX_S`` seconds, until the alert is ``WEBHOOK_GIVE_UP_S``
old. Another 4xx is the receiver refusing the message, which a retry would
not change: it is given up at once.

Every attempt is a row of ``alert_deliveries`` in the audit database (same
file, so it lives and dies with the run)::

    CREATE TABLE alert_deliveries (
        id        INTEGER PRIMARY KEY AUTOINCREMENT,
        at        REAL NOT NULL,     -- Unix seconds
        alert_id  TEXT NOT NULL,     -- one alert, all its attempts
        event     TEXT NOT NULL,     -- the payload's event
        target    TEXT NOT NULL,     -- the URL without its path (webhook paths hold secrets)
        attempt   INTEGER NOT NULL,  -- 1, 2, ...
        outcome   TEXT NOT NULL,     -- delivered (HTTP 200) | failed: ...; retry in 4 s | gave up: ...
        text      TEXT,              -- the payload's text
        dedup_key TEXT,              -- stop and policy alerts: sent once per key, across restarts
        run       TEXT               -- the run id, as the audit trail's ``run`` column
    )

The newest attempts are also kept in memory for the page. As the audit
trail, a shared ``AUDIT_DB`` holds every run's deliveries and each run reads
back (and checks its ``dedup_key``s against) its own; a log in the run's
own directory is all that run's. A log an older dashboard wrote gains the
``run`` column when first opened (``app.audit.add_columns``, the trail's
migration); its old rows have none, so a shared log keeps them out of
every run's view.

Two defences, because a rank writes much of what an alert says (its error
text, a verdict's reason, host names):

* every string in a payload is ``neutralise``-d on the wire: ``&``, ``<`` and
  ``>`` escaped as Slack requires (so ``<!channel>``, ``<@U123>`` and a
  disguised ``<https://evil|docs>`` link arrive as plain text, and Feishu's
  ``<at user_id="all">`` is no tag), and ``@all``/``@here``/``@channel``/
  ``@everyone`` broken with a zero-width space. The delivery log keeps the
  text as it was;
* a redirect (301, 302, 303, 307, 308) is not followed: urllib would turn
  the POST into a body-less GET and call the answer a delivery. It is given
  up at once with its reason (a redirect does not change on a retry).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sqlite3
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from app.audit import WRITE_TIMEOUT_S, add_columns, columns_of, connect_pinned, prepare_wal
from trainer_bridge.rundir import safeio

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS alert_deliveries (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at        REAL NOT NULL,
    alert_id  TEXT NOT NULL,
    event     TEXT NOT NULL,
    target    TEXT NOT NULL,
    attempt   INTEGER NOT NULL,
    outcome   TEXT NOT NULL,
    text      TEXT,
    dedup_key TEXT,
    run       TEXT
);
CREATE INDEX IF NOT EXISTS alert_deliveries_key ON alert_deliveries (dedup_key);
"""
# Created by the migration, after the column exists (an old log's table has no run yet).
RUN_INDEX = "CREATE INDEX IF NOT EXISTS alert_deliveries_run ON alert_deliveries (run, id)"
COLUMNS = ("id", "at", "alert_id", "event", "target", "attempt", "outcome", "text", "dedup_key", "run")
# Alerts waiting per URL; past this the oldest is dropped (and the drop logged).
QUEUE_MAX = 1000
RECENT_MAX = 200
BACKOFF_FIRST_S = 1.0
RETRY_STATUSES = (408, 429)


# Tokens some receivers turn into a mention of everyone, whatever their markup.
_MENTION_ALL = re.compile(r"@(?=(?:all|here|channel|everyone)\b)", re.IGNORECASE)
REDIRECTS = (301, 302, 303, 307, 308)


def neutralise(value):
    """``value`` (a payload, recursively) with no string able to mention, link or tag anyone."""
    if isinstance(value, str):
        text = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        return _MENTION_ALL.sub("@\u200b", text)
    if isinstance(value, dict):
        return {k: neutralise(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [neutralise(v) for v in value]
    return value


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Hands a redirect back as the HTTPError it is, instead of following it."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def parse_urls(text: str) -> list[str]:
    """The comma-separated URLs of ``WEBHOOK_URL``; ValueError naming the setting for a bad one."""
    urls = [u.strip() for u in text.split(",") if u.strip()]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"setting WEBHOOK_URL (RANKWATCH_WEBHOOK_URL) holds {redact(url)!r}, which is not an "
                "http:// or https:// URL with a host"
            )
    return urls


def redact(url: str) -> str:
    """A URL shown without its path and query: incoming-webhook URLs carry their secret there."""
    parts = urlsplit(url)
    if not parts.scheme or not parts.netloc:
        return "(not a URL)"
    host = parts.netloc.rpartition("@")[2]  # never show credentials
    return (
        f"{parts.scheme}://{host}/…" if parts.path.strip("/") or parts.query else f"{parts.scheme}://{host}"
    )


class _Queue:
    """One URL's pending alerts and its worker."""

    def __init__(self, url: str):
        self.url = url
        self.target = redact(url)
        self.items: collections.deque = collections.deque()
        self.started = False


class WebhookSender:
    """Posts alerts to every configured URL, in the background, with retries."""

    def __init__(
        self,
        urls: list[str],
        db_path: str | Path,
        *,
        db_root: str | os.PathLike | None = None,
        timeout_s: float,
        give_up_s: float,
        retry_max_s: float,
        start_task: Callable,
        clock: Callable[[], float] = time.time,
        run: str | None = None,
        shared: bool = False,
    ):
        self.db_path = Path(db_path)
        self.db_root = db_root
        # The run every row written here is about; with ``shared``, the only run read back.
        self.run = run
        self.shared = shared and run is not None
        self.timeout_s = timeout_s
        self.give_up_s = give_up_s
        self.retry_max_s = retry_max_s
        self._start_task = start_task
        self.clock = clock
        self._queues = [_Queue(u) for u in urls]
        self._cond = threading.Condition()
        self._closed = False
        self._recent: collections.deque = collections.deque(maxlen=RECENT_MAX)
        self._recent_lock = threading.Lock()
        # Bumped by every attempt, so the watcher pushes the page's list only when it changed.
        self.version = 0
        self.raised = 0  # alerts handed to send(), for tests and the benchmark

    @property
    def enabled(self) -> bool:
        return bool(self._queues)

    @property
    def targets(self) -> list[str]:
        return [q.target for q in self._queues]

    # ---------------------------------------------------------------- the caller's side
    def send(self, payload: dict, dedup_key: str | None = None) -> str | None:
        """Queue ``payload`` for every URL and return its alert id; never blocks on the network."""
        if not self._queues:
            return None
        alert_id = uuid.uuid4().hex[:12]
        self.raised += 1
        item = {"id": alert_id, "payload": payload, "queued_at": self.clock(), "dedup_key": dedup_key}
        with self._cond:
            for q in self._queues:
                if len(q.items) >= QUEUE_MAX:
                    dropped = q.items.popleft()
                    self._log_attempt(dropped, q, 0, "dropped: the queue is full (the receiver is down?)")
                q.items.append(item)
                if not q.started:
                    q.started = True
                    self._start_task(self._work, q)
            self._cond.notify_all()
        return alert_id

    def was_sent(self, dedup_key: str) -> bool:
        """Whether an alert with this key was queued before (by this or an earlier dashboard)."""
        if not self._queues or not self.db_path.exists():
            return False
        try:
            conn = self._connect()
            try:
                where, args = self._where(dedup_key=dedup_key)
                row = conn.execute("SELECT 1 FROM alert_deliveries" + where + " LIMIT 1", args).fetchone()
            finally:
                conn.close()
        except sqlite3.Error as e:
            log.warning("alerts: cannot read the delivery log: %s", e)
            return False
        return row is not None

    def queued(self) -> int:
        with self._cond:
            return sum(len(q.items) for q in self._queues)

    def recent(self, limit: int = 50) -> list[dict]:
        """The newest attempts, newest first (kept in memory; the database has them all)."""
        with self._recent_lock:
            return list(self._recent)[-limit:][::-1]

    def rows(self, limit: int = 200) -> list[dict]:
        """Attempts from the database, newest first (this run's only, if shared); empty when nothing was sent."""
        if not self.db_path.exists():
            return []
        conn = self._connect()
        try:
            where, args = self._where()
            cur = conn.execute(
                f"SELECT {', '.join(COLUMNS)} FROM alert_deliveries{where} ORDER BY id DESC LIMIT ?",
                [*args, limit],
            )
            return [dict(zip(COLUMNS, r, strict=True)) for r in cur]
        finally:
            conn.close()

    def _where(self, **equal) -> tuple[str, list]:
        """A `` WHERE`` clause and its arguments: each column in ``equal`` and, if shared, this run."""
        if self.shared:
            equal["run"] = self.run
        clause = " AND ".join(f"{column} = ?" for column in equal)
        return (f" WHERE {clause}" if clause else ""), list(equal.values())

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---------------------------------------------------------------- the workers
    def _work(self, q: _Queue) -> None:
        while True:
            with self._cond:
                while not q.items and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                item = q.items[0]
            self._deliver(q, item)
            with self._cond:
                if q.items and q.items[0] is item:
                    q.items.popleft()

    def _deliver(self, q: _Queue, item: dict) -> None:
        """Post ``item`` until it is delivered, refused, or too old; log every attempt."""
        body = json.dumps(neutralise(item["payload"])).encode()
        attempt, wait = 0, BACKOFF_FIRST_S
        while True:
            attempt += 1
            ok, retry, why = self._post(q.url, body)
            if ok:
                self._log_attempt(item, q, attempt, f"delivered ({why})")
                return
            age = self.clock() - item["queued_at"]
            if not retry:
                self._log_attempt(item, q, attempt, f"gave up: {why}")
                return
            if age + wait > self.give_up_s:
                self._log_attempt(
                    item, q, attempt, f"gave up: {why}; still failing {age:.0f} s after it was raised"
                )
                return
            self._log_attempt(item, q, attempt, f"failed: {why}; retry in {wait:g} s")
            with self._cond:
                if self._cond.wait_for(lambda: self._closed, timeout=wait):
                    return
            wait = min(wait * 2, self.retry_max_s)

    def _post(self, url: str, body: bytes) -> tuple[bool, bool, str]:
        """(delivered, worth retrying, what happened) for one POST."""
        request = urllib.request.Request(
            url,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": "rankwatch"},
        )
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                response.read(65536)
                return True, False, f"HTTP {response.status}"
        except urllib.error.HTTPError as e:
            if e.code in REDIRECTS:
                where = redact(e.headers.get("Location") or "") if e.headers else "(nowhere)"
                return (
                    False,
                    False,
                    (
                        f"HTTP {e.code} {e.reason}: a redirect to {where}, not followed "
                        "(set WEBHOOK_URL to the receiver's final URL)"
                    ),
                )
            retry = e.code >= 500 or e.code in RETRY_STATUSES
            return False, retry, f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            return False, True, f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__

    def _log_attempt(self, item: dict, q: _Queue, attempt: int, outcome: str) -> None:
        payload = item["payload"]
        row = {
            "at": self.clock(),
            "alert_id": item["id"],
            "event": str(payload.get("event")),
            "target": q.target,
            "attempt": attempt,
            "outcome": outcome,
            "text": str(payload.get("text", ""))[:1000],
            "dedup_key": item.get("dedup_key"),
            "run": self.run,
        }
        with self._recent_lock:
            self._recent.append(row)
            self.version += 1
        if not outcome.startswith("delivered"):
            log.warning("alert %s to %s: %s", row["event"], q.target, outcome)
        try:
            conn = self._connect()
            try:
                conn.execute(
                    "INSERT INTO alert_deliveries (at, alert_id, event, target, attempt, outcome, text,"
                    " dedup_key, run) VALUES (:at, :alert_id, :event, :target, :attempt, :outcome, :text,"
                    " :dedup_key, :run)",
                    row,
                )
            finally:
                conn.close()
        except sqlite3.Error as e:
            log.warning("alerts: cannot write the delivery log %s: %s", self.db_path, e)

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = connect_pinned(self.db_path, self.db_root, WRITE_TIMEOUT_S)
        except OSError as e:  # a symlink, FIFO or directory where the database should be
            raise sqlite3.OperationalError(f"cannot open {self.db_path}: {safeio.why(e)}") from None
        try:
            prepare_wal(conn, SCHEMA, _migrate)  # one delivery thread at a time (app/audit.py says why)
        except BaseException:
            conn.close()
            raise
        return conn


def _migrate(conn: sqlite3.Connection) -> None:
    """Give a delivery log an older dashboard wrote its ``run`` column (its rows keep none).

    The file's ``user_version`` is the audit trail's, so the table's own columns
    say whether it is needed; the write lock is taken only when it is.
    """
    if "run" not in columns_of(conn, "alert_deliveries"):
        add_columns(conn, "alert_deliveries", [("run", "TEXT", [])])
    conn.execute(RUN_INDEX)
