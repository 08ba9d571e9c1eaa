"""Socket.IO events. Payloads are dicts; names are snake_case.

A client gets one full ``ranks_snapshot`` when it connects (to it alone);
after that the watcher broadcasts a ``ranks_delta`` per tick in which
something changed. ``EVENTS`` is the list the README documents (the docs
test checks it).
"""
from __future__ import annotations

import time

from flask_socketio import emit

from app import rankwatch, socketio
from app.checkpoints.verify import VERIFY_EVENT
from app.state import DELTA_EVENT, SNAPSHOT_EVENT
from app.watcher import CHECKPOINTS_EVENT, STOP_EVENT

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
}


@socketio.on("connect")
def on_connect(auth=None):
    """Start the watcher (once, whoever comes first) and give this client the whole view."""
    rw = rankwatch()
    rw.watcher.ensure_started()
    now = time.time()
    rw.state.refresh(now, rw.watcher.tick_s)
    emit(SNAPSHOT_EVENT, rw.state.snapshot(now))
    emit(STOP_EVENT, rw.watcher.stop_status(now))
    emit(CHECKPOINTS_EVENT, rw.checkpoints.body(rw.state.heartbeats()[1]))
