"""Attempts in log mode: each relaunch inferred from msrun truncating its worker logs.

A script without the bridge writes no ``attempts.jsonl``. msrun opens each
worker log with ``"w"``, so a relaunch with the same ``--log_dir`` empties
them, and what they said of the previous launch is gone. The reader
(``reader.LogDir``) tells this fold each heartbeat it builds from a log and
each log that started over; the first rank whose log starts over closes the
attempt with the last heartbeat every rank had in it (the other ranks' logs
are emptied a moment later, by the same relaunch, and open nothing new).

A closed attempt keeps what the dashboard read before the text vanished:
its first and last global steps, when it ran, and how it ended by the
bridge's own rule (``trainer_bridge.rundir.attempts.outcome``: a failed
rank, every rank exited or finished, or ranks that vanished while training,
``killed``). Rows have the fields of the bridge's attempts
(``GET /api/attempts``) plus ``"from_logs": true`` and a note that the log
text is gone. Each closed attempt is also handed to the dashboard's store
(``take_unsaved``; ``app.run.logmode.kept`` writes it to the audit
database), and a dashboard started later begins from what an earlier one
kept (``restore``): attempt 1 outlives both its log text and the dashboard
that read it. A relaunch while no dashboard watched is seen by none, and
its attempt is not counted.
"""

from __future__ import annotations

from collections import deque

from trainer_bridge.rundir import attempts

# Closed attempts kept (a job relaunched every few minutes for weeks stays bounded).
MAX_KEPT = 100
GONE_NOTE = (
    "read from msrun's worker logs, which msrun empties when it relaunches the job: "
    "this attempt's log text is gone; the figures are what the dashboard read before"
)
# The fields of a heartbeat kept per rank (the rest of it is not needed to close an attempt).
KEPT = ("rank", "global_step", "state", "time", "started_at", "host", "world_size", "error", "stop")


class LogAttempts:
    """The attempts of one log directory, oldest first. Called under ``RunState``'s lock."""

    def __init__(self) -> None:
        self.closed: deque[dict] = deque(maxlen=MAX_KEPT)
        self.number = 1
        self._last: dict[int, dict] = {}  # rank -> its newest heartbeat in the current attempt
        self._first_step: int | None = None
        self._first_seen: float | None = None
        self._unsaved: list[dict] = []  # closed, not yet handed to the store
        self._restored = False

    def restore(self, kept: list[dict]) -> None:
        """Begin from the attempts an earlier dashboard kept (``KeptAttempt`` fields, oldest first); once.

        Called before the logs are first read, so the current attempt takes the next number.
        """
        if self._restored:
            return
        self._restored = True
        rows = [kept_row(k) for k in kept[-MAX_KEPT:]]
        self.closed.extend(rows)
        self.number = max(self.number, max((r["attempt"] for r in rows), default=0) + 1)

    def take_unsaved(self) -> list[dict]:
        """The attempts closed since the last call, for the store."""
        out, self._unsaved = self._unsaved, []
        return out

    def observe(self, beat: dict, first_step: int | None) -> None:
        """A heartbeat built from a rank's log in the current attempt, and the first step its log showed."""
        self._last[beat["rank"]] = {k: beat.get(k) for k in KEPT}
        g = first_step if first_step is not None else beat.get("global_step")
        if g is not None and (self._first_step is None or g < self._first_step):
            self._first_step = g
        t = beat.get("started_at") or beat.get("time")
        if t is not None and (self._first_seen is None or t < self._first_seen):
            self._first_seen = t

    def started_over(self, rank: int) -> None:
        """Rank ``rank``'s log started over: a relaunch, if it had spoken in the current attempt."""
        if rank not in self._last:
            return
        row = self._row(closed=True)
        self.closed.append(row)
        self._unsaved = [*self._unsaved, dict(row)][-MAX_KEPT:]
        self.number += 1
        self._last.clear()
        self._first_step = self._first_seen = None

    def rows(self) -> list[dict]:
        """Every attempt known, oldest first; the current one open (its end is not known yet)."""
        out = [dict(row) for row in self.closed]
        if self._last:
            out.append(self._row(closed=False))
        return out

    def _row(self, closed: bool) -> dict:
        beats = list(self._last.values())
        hosts = sorted({hb["host"] for hb in beats if hb.get("host")})
        steps = [hb["global_step"] for hb in beats if hb.get("global_step") is not None]
        row = blank_row(self.number) | {
            "started_at": self._first_seen,
            "world_size": max((hb.get("world_size") or 0 for hb in beats), default=0) or len(beats),
            "hosts": hosts,
            "host_count": len(hosts),
            "first_step": self._first_step,
            "last_step": max(steps) if steps else None,
            "note": GONE_NOTE if closed else None,
        }
        if closed:
            told = attempts.outcome(beats)
            row.update({k: v for k, v in told.items() if k != "source"})
            row["stop_by"] = None  # a log does not say who asked
        return row


def blank_row(number: int) -> dict:
    """A log-mode attempt's row with nothing known yet: the fields of the bridge's rows."""
    return {
        "attempt": number,
        "launch": None,
        "started_at": None,
        "world_size": 0,
        "hosts": [],
        "host_count": 0,
        "pid": None,
        "resumed_from": None,
        "first_step": None,
        "previous_last_step": None,
        "replayed": None,
        "last_step": None,
        "ended_at": None,
        "end": None,
        "request_id": None,
        "requested_by": None,
        "error": None,
        "sealed_by": None,
        "source": None,
        "from_logs": True,
        "note": None,
    }


def kept_row(kept: dict) -> dict:
    """The row of an attempt an earlier dashboard closed and kept (``kept.KeptAttempt``'s fields)."""
    row = blank_row(kept["attempt"]) | kept
    return row | {"host_count": len(row["hosts"]), "note": GONE_NOTE, "stop_by": None}
