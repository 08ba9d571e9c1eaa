"""Socket.IO events. Payloads are dicts; names are snake_case.

A client gets one full ``ranks_snapshot`` when it connects (to it alone);
after that the watcher broadcasts a ``ranks_delta`` per tick in which
something changed. ``EVENTS`` is the list the README documents (the docs
test checks it).
"""

from __future__ import annotations

import logging
import threading
import time

from flask import current_app, request
from flask_socketio import emit

from app import rankwatch, socketio
from app.checkpoints.verify import VERIFY_EVENT
from app.incidents.monitor import EVENT as INCIDENTS_EVENT
from app.state import DELTA_EVENT, SNAPSHOT_EVENT
from app.watcher import CHECKPOINTS_EVENT, STOP_EVENT

log = logging.getLogger(__name__)

EVENTS = {
    SNAPSHOT_EVENT: "server to client: the whole view, as GET /api/ranks; to a client when it "
    "connects, and to everyone when ranks disappeared",
    DELTA_EVENT: "server to client, at most once per tick: the changed fields of the changed "
    "rows, plus the summary and the run status when they changed",
    STOP_EVENT: "server to client: the stop lifecycle, as GET /api/exit without the estimate; "
    "to a client when it connects, and to everyone when it changed",
    CHECKPOINTS_EVENT: "server to client: the checkpoint index, as GET /api/checkpoints; to a "
    "client when it connects, and to everyone when a checkpoint file changed",
    VERIFY_EVENT: "server to client: a deep verify's progress, after it starts and after each file",
    INCIDENTS_EVENT: "server to client, to everyone: the stop policy's status and the newest alert "
    "deliveries, when either changed",
}


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
    """Start the watcher (once, whoever comes first) and give this client the whole view."""
    if not _first_connect(request.sid):
        log.info("refused a re-sent connect from %s", request.sid)
        return
    rw = rankwatch()
    rw.watcher.ensure_started()
    now = time.time()
    rw.state.refresh(now, rw.watcher.tick_s)
    # To this client, which is on this process: not through the message queue,
    # which would carry a whole snapshot to every other dashboard for nothing.
    emit(SNAPSHOT_EVENT, rw.state.snapshot(now), ignore_queue=True)
    emit(STOP_EVENT, rw.watcher.stop_status(now), ignore_queue=True)
    emit(CHECKPOINTS_EVENT, rw.checkpoints.body(rw.state.heartbeats()[1]), ignore_queue=True)
