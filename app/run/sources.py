"""The seam between ``RunState`` and where its rows come from: ``ViewSource``.

By default ``RunState`` reads its own run directory: the heartbeat files or
Redis (``heartbeats.py``) and msrun's worker logs (``logmode/``), judged by
its ``VerdictBoard``. A source given as ``RunState(run_dir, config,
source=...)`` replaces that read; the agents' hub
(``app.agent.hubsource.HubSource``) is one, whose rows each host's agent
has already judged. Whatever the source, ``RunState`` keeps what every
reader shares: the one lock, the rows (a ``RowTable``), the pushes
(``take_delta``), the pages and the snapshot. What it reads of its run
directory beyond the rows (job.json, the charts, the log attempts, the
stop's job facts) it keeps reading there, and with a source that
directory holds none of them: those answer as for a run without heartbeats.

A source holds no lock of its own: ``attach`` hands it ``RunState``'s, and
``RunState`` calls it under that lock except for ``rank`` and ``node``,
which may wait on something slow (the hub asks an agent over Redis) and so
take the lock only to read, never across the wait.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Protocol

from app.push import RankPushes


class RowTable:
    """The rows of a view by rank, and what its clients were last pushed of them.

    A row is replaced, never changed in place. ``put`` and ``drop`` keep the
    pushes in step: a put row goes out in the next delta, a dropped one
    makes the next push a snapshot (a removal is no delta).
    """

    __slots__ = ("pushes", "rows")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rows: dict[int, dict] = {}
        self.pushes = RankPushes()

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, rank: int) -> dict | None:
        return self.rows.get(rank)

    def put(self, rank: int, row: dict) -> None:
        self.rows[rank] = row
        self.pushes.dirty.add(rank)

    def drop(self, rank: int) -> dict | None:
        """Remove rank ``rank``'s row; the row it had, or None."""
        old = self.rows.pop(rank, None)
        if old is not None:
            pushes = self.pushes
            pushes.sent.pop(rank, None)
            pushes.dirty.discard(rank)
            pushes.needs_snapshot = True
        return old


class Head(NamedTuple):
    """What a scan gives besides the rows: the world size, the summary strip and the run status."""

    world: int
    summary: dict
    run: dict


class ViewSource(Protocol):
    """What a source of a run's rows provides to ``RunState`` (see the module's docstring)."""

    def attach(self, lock: threading.Lock, table: RowTable) -> None:
        """Once, when ``RunState`` is made: its lock and its rows, the only ones the source uses."""

    def scan(self, now: float) -> Head:
        """Under the lock: put the changed rows into the table, drop the gone ones; the view's head."""

    def heartbeats(self) -> dict[int, dict | None]:
        """Under the lock: each rank's newest record (stop stage, state, start) for the stop service."""

    def started_at(self, rank: int) -> float | None:
        """Under the lock: when rank ``rank``'s process started, as last reported."""

    def page_extras(self, rows: list[dict], now: float) -> dict:
        """Under the lock: what a page of ``rows`` (``RunState.page``) carries besides them."""

    def rank(self, rank: int, now: float) -> dict | None:
        """Without the lock: rank ``rank``'s row and chart history (``GET /api/ranks/<rank>``)."""

    def node(self, host: str, now: float) -> dict | None:
        """Without the lock: the rows of ``host``'s ranks (``GET /api/hosts/<host>/ranks``)."""
