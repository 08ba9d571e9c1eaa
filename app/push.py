"""What the dashboard pushes over Socket.IO: each event's name, the page it is for, and "only when it changed".

**Pages.** Each page names itself when it connects (``io({auth: {page:
"ranks"}})``) and joins that page's room; every event goes only to the room
of the page that shows it. So the checkpoint browser never receives the rank
deltas of a 4,096-rank job twice a second, and a connect sends only the
snapshots its page draws. A client that names no page (a script, a page of
an older version) joins every room and gets everything, as before.

**Audiences.** A client that connects with the operator token (``auth:
{token}``) joins its pages' operator rooms, one without it the viewer
rooms; a wrong token is refused at the connect (``app/ranks/events.py``).
Every push to a room goes to both: to the viewers as
``app.edge.auth.redact_run_dir`` makes it, the one redaction of the HTTP
answers (no absolute path of the run directory, issue 32 P11), handed in
by the caller as ``redact``. A payload that names no such path is sent
once to both rooms.

**Only what changed.** ``Changed`` remembers the last value pushed of one
kind and says whether a new one differs; ``changed_fields`` is the same for
the fields of one row. The rank table's deltas (``RankPushes``, for
``app.run.state``), the stop lifecycle (``app.watcher``), the checkpoint
index (``app.checkpoints.indexbody``'s ``IndexPushes``: whole, then the
changed sets) and the incident panel (``app.incidents``) all
decide through these.

Every emit goes through ``emit`` here, so that which page hears what is
written once. With several dashboards behind one Redis (``app/cluster.py``)
a room spans every process, as Flask-SocketIO's message queue relays it;
``local=True`` keeps an event on this process.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from typing import Any

RANKS_PAGE = "ranks"
CHECKPOINTS_PAGE = "checkpoints"
PAGES = (RANKS_PAGE, CHECKPOINTS_PAGE)

SNAPSHOT_EVENT = "ranks_snapshot"
DELTA_EVENT = "ranks_delta"
STOP_EVENT = "stop_status"
INCIDENTS_EVENT = "incidents"
CHECKPOINTS_EVENT = "checkpoints"
CHECKPOINTS_DELTA_EVENT = "checkpoints_delta"
VERIFY_EVENT = "checkpoint_verify"
# What a checkpoint page sends when it missed a push: the whole index comes back as the ack.
CHECKPOINTS_INDEX_REQUEST = "checkpoints_index"

# Which page shows each event (the README's Socket.IO table says the same).
PAGE_OF = {
    SNAPSHOT_EVENT: RANKS_PAGE,
    DELTA_EVENT: RANKS_PAGE,
    STOP_EVENT: RANKS_PAGE,
    INCIDENTS_EVENT: RANKS_PAGE,
    CHECKPOINTS_EVENT: CHECKPOINTS_PAGE,
    CHECKPOINTS_DELTA_EVENT: CHECKPOINTS_PAGE,
    VERIFY_EVENT: CHECKPOINTS_PAGE,
}


def room(page: str, run: str | None = None, operator: bool = False) -> str:
    """A page's room; of one run's page when ``run`` (under ``--runs``), so pushes never mix runs;
    its operators' (clients with the token) when ``operator``.

    JSON, because a run id may hold any character: two runs never share a room.
    """
    if operator:
        return json.dumps([run, page, "operator"])
    return page if run is None else json.dumps([run, page])


def rooms(page: object, run: str | None = None, operator: bool = False) -> tuple[str, ...]:
    """The rooms a client joins: its page's, or every page's when it names none we know."""
    return tuple(room(p, run, operator) for p in ((page,) if page in PAGES else PAGES))


def wants(page: object, event: str) -> bool:
    """Whether a client of ``page`` is sent ``event``."""
    return page not in PAGES or PAGE_OF[event] == page


def emit(
    socketio,
    event: str,
    payload: Any,
    *,
    redact: Callable[[Any], Any] | None,
    to: str | None = None,
    local: bool = False,
    run: str | None = None,
) -> None:
    """Push ``event`` to its page's rooms (of ``run``), or to one client (``to``, a sid); ``local``: this process only.

    ``redact``: what the viewers' room gets instead (``app.edge.auth.redact_run_dir`` for the run);
    None only for a payload that can name no path. For ``to``, the one client's: the caller's to
    pass the view that client may see.
    """
    kwargs = {"ignore_queue": True} if local else {}
    if to is not None:
        shown = redact(payload) if redact is not None else payload
        socketio.emit(event, shown, to=to, **kwargs)
        return
    page = PAGE_OF[event]
    operators, viewers = room(page, run, operator=True), room(page, run)
    shown = redact(payload) if redact is not None else payload
    if shown is payload:
        socketio.emit(event, payload, to=[operators, viewers], **kwargs)
    else:
        socketio.emit(event, payload, to=operators, **kwargs)
        socketio.emit(event, shown, to=viewers, **kwargs)


_NOTHING = object()


class Changed:
    """The last value pushed of one kind: ``take(value)`` is True, and remembers it, when it differs."""

    def __init__(self):
        self._last: Any = _NOTHING
        self._lock = threading.Lock()

    def take(self, value: Any) -> bool:
        with self._lock:
            if value == self._last:
                return False
            self._last = value
            return True

    @property
    def pushed(self) -> bool:
        """Whether a value was taken since the start or the last ``forget``."""
        return self._last is not _NOTHING

    def forget(self) -> None:
        """Push the next value whatever it is (the pages may have missed the last)."""
        with self._lock:
            self._last = _NOTHING


def changed_fields(old: Mapping, new: Mapping) -> dict:
    """The fields of ``new`` that ``old`` lacks or holds with another value."""
    return {k: v for k, v in new.items() if k not in old or old[k] != v}


class RankPushes:
    """What clients were last sent of the rank rows, the summary and the run status (``RunState``'s pushes).

    ``take`` makes the next push: each changed row with only the fields
    that differ from what was last pushed (plus ``rank``), the summary and
    run status only when they changed. A removal (rank files deleted, run
    directory replaced) cannot be a delta: ``needs_snapshot`` makes the next
    push a whole snapshot.
    """

    def __init__(self) -> None:
        self.sent: dict[int, dict] = {}
        self.dirty: set[int] = set()  # ranks whose row changed since the last push
        self._summary = Changed()
        self._run = Changed()
        # Ranks can only be added by a delta; anything else (a run directory
        # deleted, a heartbeat removed) needs every client to take a snapshot.
        self.needs_snapshot = True

    def take(
        self,
        now: float,
        world: int,
        rows: Mapping[int, dict],
        summary: dict,
        run: dict,
        snapshot: Callable[[], dict],
    ) -> tuple[str, dict] | None:
        """(DELTA_EVENT, changed fields), (SNAPSHOT_EVENT, ``snapshot()``), or None: nothing changed."""
        if self.needs_snapshot:
            self.needs_snapshot = False
            self.dirty.clear()
            self.sent = dict(rows)
            self._summary.take(summary)
            self._run.take(run)
            return SNAPSHOT_EVENT, snapshot()
        changes = []
        for r in sorted(self.dirty):
            row, old = rows[r], self.sent.get(r, {})
            diff = changed_fields(old, row)
            if diff:
                diff["rank"] = r
                changes.append(diff)
            self.sent[r] = row
        self.dirty.clear()
        delta: dict[str, Any] = {}
        if changes:
            delta["rows"] = changes
        if self._summary.take(summary):
            delta["summary"] = summary
        if self._run.take(run):
            delta["run"] = run
        if not delta:
            return None
        return DELTA_EVENT, {"now": now, "world_size": world, **delta}
