"""The ranks page's window: above ``PAGE_WINDOW_RANKS`` a browser gets only the rows on its screen.

Below the threshold every ranks-page client gets every row (a snapshot on
connect, then the room's deltas) and pages, sorts and filters them itself.
Above it, what a browser receives must not grow with the job (issue 20: at
most 50 KB/s to each browser, whatever the job's size), so the page runs
*windowed*:

* a client tells the server its window with the ``ranks_view`` event
  (``RanksView``: ``page``, ``per_page``, ``health``, ``sort``, validated as
  ``GET /api/ranks``'s query, ``per_page`` bounded lower);
* it gets a ``ranks_snapshot`` with the summary, the run status, the host
  rows of the window's ranks (with agents) and only the window's rows, plus
  ``window`` (the page, the total and the pages);
* each tick it gets a ``ranks_delta`` with only its window's changed rows
  (``window.order`` when the window's ranks or their order changed), and the
  summary, the run status and the hosts when they changed.

The window's rows come from ``RunState.page``, the one implementation
``/api/ranks`` also serves, filter and worst-first order included.

With several dashboards behind one Redis (``app/cluster.py``) each process
pushes the windows of its own clients, from its own view of the run and
with ``local=True``: a window is one client's, so nothing about it goes
through the message queue, leader or not.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field

from app.edge import params
from app.push import DELTA_EVENT, SNAPSHOT_EVENT, Changed, changed_fields
from app.run.verdicts import VERDICTS

# /api/ranks pages: 500 rows are about 280 kB of JSON; a client may ask for up to 1,000.
PER_PAGE_DEFAULT = 500
PER_PAGE_MAX = 1000
# A window's rows are pushed every tick they change: 200 rows' changed fields
# stay well under 50 KB/s at two ticks a second.
WINDOW_PER_PAGE_MAX = 200
WINDOW_PER_PAGE_DEFAULT = 100

Verdicts = params.some_of(VERDICTS, "verdict")
Sort = Annotated[Literal["rank", "worst"], Field(description="rank or worst")]


class RanksPage(params.Query):
    """``GET /api/ranks``'s ``?page=``, ``?per_page=``, ``?health=dead,stalled`` and ``?sort=worst``."""

    page: params.PositiveInt = 1
    per_page: Annotated[params.PositiveInt, params.at_most(PER_PAGE_MAX)] = PER_PAGE_DEFAULT
    health: Verdicts = ()
    sort: Sort = "rank"


class RanksView(RanksPage):
    """The ``ranks_view`` event's payload: a window, smaller than an API page at most."""

    per_page: Annotated[params.PositiveInt, params.at_most(WINDOW_PER_PAGE_MAX)] = WINDOW_PER_PAGE_DEFAULT


def page_of(state, now: float, q: RanksPage, clamp: bool = False) -> tuple[dict, dict]:
    """(``state.page``'s body for ``q``, the window: page, per_page, total, pages, health, sort).

    ``clamp``: a page past the last is the last (a window whose filter
    emptied); otherwise the caller refuses it.
    """
    start = (q.page - 1) * q.per_page
    body, total = state.page(now, list(q.health), start, q.per_page, q.sort)
    pages = max(1, math.ceil(total / q.per_page))
    page = q.page
    if clamp and page > pages:
        page = pages
        body, total = state.page(now, list(q.health), (page - 1) * q.per_page, q.per_page, q.sort)
    window = {
        "page": page,
        "per_page": q.per_page,
        "total": total,
        "pages": pages,
        "health": list(q.health),
        "sort": q.sort,
    }
    return body, window


def _bare(row: dict) -> dict:
    # The page computes the age from ``time`` and the server's clock: sending it would change every row every tick.
    return {k: v for k, v in row.items() if k != "heartbeat_age_s"}


def _hosts_key(hosts: list[dict] | None) -> list[dict] | None:
    # A digest's age moves every tick; the hosts are pushed again when a digest changed, not when it aged.
    return None if hosts is None else [{k: v for k, v in h.items() if k != "digest_age_s"} for h in hosts]


@dataclass
class _Client:
    view: RanksView
    sent: dict[int, dict] = field(default_factory=dict)
    window: dict = field(default_factory=dict)
    order: list[int] = field(default_factory=list)
    summary: Changed = field(default_factory=Changed)
    run: Changed = field(default_factory=Changed)
    hosts: Changed = field(default_factory=Changed)
    fresh: bool = True  # owes a whole window (just joined, changed its view, or the page went windowed)


class Windows:
    """The windows of one run's ranks-page clients on this process, by Socket.IO sid; thread-safe."""

    def __init__(self, threshold: int):
        self.threshold = threshold
        self._clients: dict[str, _Client] = {}
        self._lock = threading.Lock()

    def active(self, world: int) -> bool:
        """Whether a job of ``world`` ranks is shown windowed."""
        return world > self.threshold

    def join(self, sid: str) -> None:
        """A ranks-page client connected; its window is the first page until it says otherwise."""
        with self._lock:
            self._clients[sid] = _Client(RanksView())

    def leave(self, sid: str) -> None:
        with self._lock:
            self._clients.pop(sid, None)

    def sids(self) -> list[str]:
        with self._lock:
            return list(self._clients)

    def set_view(self, sid: str, view: RanksView) -> bool:
        """Change a client's window; False if ``sid`` is not a ranks-page client of this run."""
        with self._lock:
            client = self._clients.get(sid)
            if client is None:
                return False
            client.view, client.fresh = view, True
            return True

    def refresh_all(self) -> None:
        """Every client owes a whole window (the page just went windowed)."""
        with self._lock:
            for client in self._clients.values():
                client.fresh = True

    def snapshot(self, state, now: float, sid: str) -> dict | None:
        """The whole window of ``sid`` now (``ranks_snapshot``'s payload), remembered as sent."""
        with self._lock:
            client = self._clients.get(sid)
            if client is None:
                return None
            return self._whole(client, page_of(state, now, client.view, clamp=True))

    def pushes(self, state, now: float) -> list[tuple[str, str, dict]]:
        """This tick's ``(sid, event, payload)`` for every client whose window changed.

        Clients with the same window share one ``state.page`` a tick: a hundred
        browsers on the first page of a 100,000-rank job cost one page, not a hundred.
        """
        out = []
        pages: dict[RanksView, tuple[dict, dict]] = {}

        def page(view: RanksView) -> tuple[dict, dict]:
            if view not in pages:
                pages[view] = page_of(state, now, view, clamp=True)
            return pages[view]

        with self._lock:
            for sid, client in self._clients.items():
                if client.fresh:
                    out.append((sid, SNAPSHOT_EVENT, self._whole(client, page(client.view))))
                    continue
                delta = self._delta(client, page(client.view), now)
                if delta is not None:
                    out.append((sid, DELTA_EVENT, delta))
        return out

    def _whole(self, client: _Client, answer: tuple[dict, dict]) -> dict:
        body, window = answer
        client.fresh = False
        client.sent = {row["rank"]: _bare(row) for row in body["ranks"]}
        client.order = [row["rank"] for row in body["ranks"]]
        client.window = window
        client.summary.take(body["summary"])
        client.run.take(body["run"])
        client.hosts.take(_hosts_key(body.get("hosts")))
        return {**body, "window": window}

    def _delta(self, client: _Client, answer: tuple[dict, dict], now: float) -> dict | None:
        body, window = answer
        rows: list[dict[str, Any]] = []
        sent = {}
        for row in body["ranks"]:
            bare = _bare(row)
            diff = changed_fields(client.sent.get(bare["rank"], {}), bare)
            if diff:
                diff["rank"] = bare["rank"]
                rows.append(diff)
            sent[bare["rank"]] = bare
        client.sent = sent
        order = list(sent)
        delta: dict[str, Any] = {}
        if rows:
            delta["rows"] = rows
        if order != client.order or window != client.window:
            client.order, client.window = order, window
            delta["window"] = {**window, "order": order}
        if client.summary.take(body["summary"]):
            delta["summary"] = body["summary"]
        if client.run.take(body["run"]):
            delta["run"] = body["run"]
        if "hosts" in body and client.hosts.take(_hosts_key(body["hosts"])):
            delta["hosts"] = body["hosts"]
        if not delta:
            return None
        return {"now": now, "world_size": body["world_size"], **delta}
