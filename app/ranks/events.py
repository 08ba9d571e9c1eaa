"""Socket.IO events. Payloads are dicts; names are snake_case.

A client names its page when it connects (``auth: {page: "ranks"}`` or
``"checkpoints"``), joins that page's room and gets, to it alone, the
snapshots its page draws; after that the watcher pushes to each room only
its page's events, and only what changed (``app/push.py``). ``EVENTS`` is
the list the README documents (the docs test checks it).

A client that holds the operator token sends it too (``auth: {token}``)
and joins its page's operator rooms; one without it gets every push with
the run directory's absolute path redacted (``app/push.py``). A wrong or
throttled token is refused at the connect, with the API's error and its
status as the refusal's message and data, rather than taken as a viewer:
the page must learn that its token is stale.
"""

from __future__ import annotations

import logging
import threading
import time

from flask import current_app, g, request
from flask_socketio import ConnectionRefusedError, join_room

from app import push
from app.edge import params
from app.edge.auth import check_token
from app.errors import BadRequest, RankwatchError, WrongToken
from app.extensions import rankwatch, run_known, socketio
from app.push import (
    CHECKPOINTS_DELTA_EVENT,
    CHECKPOINTS_EVENT,
    CHECKPOINTS_INDEX_REQUEST,
    DELTA_EVENT,
    INCIDENTS_EVENT,
    SNAPSHOT_EVENT,
    STOP_EVENT,
    VERIFY_EVENT,
)
from app.ranks.window import RanksView

log = logging.getLogger(__name__)

EVENTS = {
    SNAPSHOT_EVENT: "ranks page: the whole view, as GET /api/ranks; to a client when it "
    "connects, and to the page's room when ranks disappeared",
    DELTA_EVENT: "ranks page, at most once per tick: the changed fields of the changed "
    "rows, plus the summary and the run status when they changed",
    STOP_EVENT: "ranks page: the stop lifecycle, as GET /api/exit without the estimate; "
    "to a client when it connects, and to the room when it changed",
    INCIDENTS_EVENT: "ranks page: the stop policy's status and the newest alert "
    "deliveries, when either changed",
    CHECKPOINTS_EVENT: "checkpoints page: the checkpoint index, as GET /api/checkpoints, with the "
    "version of the last push it includes; to a client when it connects, and to the room at the "
    "first push",
    CHECKPOINTS_DELTA_EVENT: "checkpoints page, when a checkpoint file changed: the sets added or "
    "changed, the ids of those gone, the summary fields that changed; its version and the one it "
    "applies to (base)",
    VERIFY_EVENT: "checkpoints page: a deep verify's progress, after it starts and after each file",
}
# The events a page sends: its window, when the ranks page runs windowed (app/ranks/window.py);
# and, from the checkpoint browser, a request for the whole index when it missed a delta.
VIEW_EVENT = "ranks_view"
INDEX_REQUEST = CHECKPOINTS_INDEX_REQUEST


def _first_connect(sid: str) -> bool:
    """True the first time ``sid`` connects; False for an event a client named "connect".

    python-socketio dispatches an EVENT packet named ``connect``
    (``42["connect"]``) to this handler as if the client had connected again,
    and each one cost a full snapshot. So the sids already served are kept
    (pruned of the ones that are gone), and a second "connect" gets nothing.
    """
    served = current_app.extensions.setdefault("rankwatch_connected", set())
    manager = socketio.server.manager
    with _served_lock:
        if sid in served:
            return False
        served.intersection_update({s for s in served if manager.is_connected(s, "/")})
        served.add(sid)
    return True


_served_lock = threading.Lock()


@socketio.on("connect")
def on_connect(auth=None):
    """Start the watcher (once, whoever comes first); join the page's room and send its whole view."""
    if not _first_connect(request.sid):
        log.info("refused a re-sent connect from %s", request.sid)
        return
    page = auth.get("page") if isinstance(auth, dict) else None
    # A run's console names its run (app/runs/scoping.py); an unknown one is refused.
    run = auth.get("run") if isinstance(auth, dict) else None
    if run is not None:
        if not isinstance(run, str) or not run_known(run):
            return False
        g.run_id = run
    operator = _operator(auth)
    rw = rankwatch()
    for room in push.rooms(page, rw.room, operator):
        join_room(room)
    rw.watcher.ensure_started()
    now = time.time()
    rw.state.refresh(now, rw.watcher.tick_s)

    redact = None if operator else rw.redact

    def send(event, payload):
        # To this client, which is on this process: not through the message queue,
        # which would carry a whole snapshot to every other dashboard for nothing.
        push.emit(socketio, event, payload, to=request.sid, local=True, redact=redact)

    _runs_of_sids()[request.sid] = run
    if operator:  # its windows' pushes and its answers are not redacted (app/watcher.py)
        rw.watcher.operators.add(request.sid)
    if push.wants(page, SNAPSHOT_EVENT):
        windows = rw.watcher.windows
        windows.join(request.sid)
        if windows.active(rw.state.world_size()):
            send(SNAPSHOT_EVENT, windows.snapshot(rw.state, now, request.sid))
        else:
            send(SNAPSHOT_EVENT, rw.state.snapshot(now))
        send(STOP_EVENT, rw.watcher.stop_status(now))
    if push.wants(page, CHECKPOINTS_EVENT):
        send(CHECKPOINTS_EVENT, _whole_index(rw))


def _whole_index(rw) -> dict:
    # Its version is the pages' only while this process pushes to them (app/watcher.py).
    return rw.checkpoints.whole(rw.state.heartbeats()[1], rw.watcher.leading)


@socketio.on(INDEX_REQUEST)
def on_checkpoints_index(*_):
    """A checkpoint page that missed a delta (its version is not the delta's base): the whole
    index as the ack, with the version of the last push it includes (``app/checkpoints/indexbody.py``)."""
    rw = _client_run(request.sid)
    if rw is None:
        return _refused(BadRequest("checkpoints_index is for a client of this dashboard's pages"))
    body = _whole_index(rw)
    return body if request.sid in rw.watcher.operators else rw.redact(body)


def _operator(auth) -> bool:
    """Whether the connecting client holds the operator token; a wrong one is refused (401, or 429).

    A ``token`` that is no string is no token (garbage in ``auth`` is ignored, as any other field).
    """
    held = auth.get("token") if isinstance(auth, dict) else None
    if not isinstance(held, str):
        return False
    try:
        if check_token(held):
            return True
        raise WrongToken("wrong operator token: connect without one to watch, or open a new login link")
    except RankwatchError as e:
        raise ConnectionRefusedError(e.message, {"status": e.status}) from None


def _runs_of_sids() -> dict[str, str | None]:
    """The run each client named (None: ``--run-dir``'s), for its later events."""
    return current_app.extensions.setdefault("rankwatch_sid_runs", {})


def _client_run(sid: str):
    """The engines of the run ``sid`` connected to, or None if it is no client here."""
    runs = _runs_of_sids()
    if sid not in runs:
        return None
    g.run_id = runs[sid]
    try:
        return rankwatch()
    except Exception:  # its run went away (app/runs/registry.py): nothing to show
        log.info("a ranks-page client's run is gone", exc_info=True)
        return None


@socketio.on(VIEW_EVENT)
def on_ranks_view(payload=None, *extra):
    """A windowed client's window (``app/ranks/window.py``); answers (the ack) with an error or ``{"ok"}``.

    The window's rows follow as a ``ranks_snapshot`` at the next tick while
    the page is windowed; below the threshold the view is kept for when it is.
    A client may send any number of arguments with an event: more than one is refused, not a crash.
    """
    if extra:
        return _refused(BadRequest("ranks_view takes one JSON object, not several arguments"))
    if not isinstance(payload, dict):
        return _refused(BadRequest("the ranks_view payload must be a JSON object"))
    try:
        view = params.validate(RanksView, payload)
    except BadRequest as e:
        return _refused(e)
    rw = _client_run(request.sid)
    if rw is None or not rw.watcher.windows.set_view(request.sid, view):
        return _refused(BadRequest("ranks_view is for a client of the ranks page"))
    return {"ok": True}


def _refused(e: BadRequest) -> dict:
    # The API's one error shape, as the event's ack.
    return {"error": e.message, "status": e.status}


@socketio.on("disconnect")
def on_disconnect(*_):
    rw = _client_run(request.sid)
    _runs_of_sids().pop(request.sid, None)
    if rw is not None:
        rw.watcher.windows.leave(request.sid)
        rw.watcher.operators.discard(request.sid)
