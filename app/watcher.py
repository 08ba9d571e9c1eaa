"""The one background loop: scan the run directory, push what changed.

It is started once, under a lock, by the server's worker before it serves
(``app/serve/server.py``; ``python -m app`` and ``rankwatch serve``), or
else by the first Socket.IO client (nothing runs at import time or in
``create_app``, so tests choose), and it uses
``socketio.sleep`` so that it follows whatever async mode Flask-SocketIO runs.
Each tick sends at most one rank event to the ranks page's clients (the
rooms and the changed-only rule are ``app/push.py``'s): a ``ranks_delta``
with the changed fields of the changed rows, or a ``ranks_snapshot`` when
ranks disappeared; and a ``stop_status`` when the stop lifecycle changed.
The tick also lets the stop service record a completed stop and re-arm the
flag, so that happens even with no browser open.
Then it asks the checkpoint service (which re-scans at most every
``CHECKPOINT_SCAN_S``) and, when the index changed, sends the sets that
changed (``checkpoints_delta``; the whole index, ``checkpoints``, first and
when the pages may have missed a push).
Last, the incident step turns this tick's verdict changes and the stop's
lifecycle into alerts and runs the stop policy (``app.incidents.monitor``).

With several dashboards behind one Redis (``app/cluster.py``) every process
runs this loop, but only the leader does the above, and its pushes reach
every process's pages through the message queue. A follower reads the
run as the leader does (for its own API and charts) but pushes nothing
while that relay works; while Redis is unreachable it pushes its own view
to its own pages. A follower writes nothing. A process that becomes
leader, or leads on after an outage, first pushes a whole snapshot to
everyone: it cannot know what their pages last got.

Above ``PAGE_WINDOW_RANKS`` ranks the ranks page is windowed
(``app/ranks/window.py``): no rank event goes to the room; every process,
leader or follower, pushes each of its own clients that client's window,
from its own view and on this process only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from flask_socketio import SocketIO

from app import push
from app.large import LARGE_ANSWER_RANKS
from app.push import STOP_EVENT
from app.ranks.window import Windows
from app.run.state import RunState
from app.stop.service import StopService

if TYPE_CHECKING:
    from app.checkpoints.service import CheckpointService
    from app.cluster import Cluster
    from app.incidents.monitor import Incidents

log = logging.getLogger(__name__)


class Watcher:
    """Scans ``state`` every ``tick_s`` seconds and pushes what changed to the pages that show it."""

    def __init__(
        self,
        socketio: SocketIO,
        state: RunState,
        tick_s: float,
        clock: Callable[[], float] = time.time,
        stop: StopService | None = None,
        checkpoints: CheckpointService | None = None,
        incidents: Incidents | None = None,
        cluster: Cluster | None = None,
        room: str | None = None,
        window_ranks: int = LARGE_ANSWER_RANKS,
        redact: Callable[[dict], dict] | None = None,
    ):
        self.socketio = socketio
        # The ranks page's windows (app/ranks/window.py): above window_ranks each client gets its own.
        self.windows = Windows(window_ranks)
        self.windowed = False
        # The run whose pages hear this loop (app/push.py's rooms); None for --run-dir's.
        self.room = room
        # What the viewers without the token get of each push (app.edge.auth.redact_run_dir, app/push.py),
        # and the windowed clients that hold the token (app/ranks/events.py), whose pushes are not redacted.
        self.redact = redact
        self.operators: set[str] = set()
        self.cluster = cluster
        # Whether the last tick led (always, without a cluster), and whether Redis answered.
        self.leading = cluster is None
        self._reachable = True
        self.state = state
        self.stop_service = stop
        self.checkpoints = checkpoints
        self.incidents = incidents
        self._stop_pushed = push.Changed()
        self.tick_s = tick_s
        self.clock = clock
        self._lock = threading.Lock()
        self._task = None
        self._stopping = threading.Event()
        # Under --runs: whether the run directory is still the one found (app/runs/registry.py);
        # a tick through a directory swapped for another does nothing (issue 32, P2).
        self.guard: Callable[[], bool] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._stopping.is_set()

    def ensure_started(self) -> None:
        """Start the loop unless it runs already; safe to call from every connect."""
        with self._lock:
            if self._task is None:
                self._task = self.socketio.start_background_task(self._run)

    def _emit(self, event: str, payload: dict, local: bool = False) -> None:
        # Without Redis only this process's pages can hear it; publishing would fail (and log) every tick.
        local = local or (self.cluster is not None and not self.cluster.reachable)
        push.emit(self.socketio, event, payload, local=local, run=self.room, redact=self.redact)

    def tick(self) -> tuple[str, dict] | None:
        """Scan once and push the result; returns what was pushed."""
        if self.guard is not None and not self.guard():
            return None
        if self.cluster is not None:
            leads = self.cluster.step()
            reachable = self.cluster.reachable
            if leads and (not self.leading or (reachable and not self._reachable)):
                # New leader, or back from an outage during which other processes'
                # pages missed our pushes: everyone takes the whole view again.
                self.state.resend()
                self._stop_pushed.forget()
                if self.checkpoints is not None:
                    self.checkpoints.resend()
            self.leading, self._reachable = leads, reachable
            if not leads:
                return self._follow()
        now = self.clock()
        self.state.scan(now)
        out = self.state.take_delta(now)
        windowed = self._tick_windows(now)
        if out and not windowed:
            self._emit(*out)
        status = self._tick_stop(now) if self.stop_service is not None else None
        if self.checkpoints is not None:
            self._tick_checkpoints()
        if self.incidents is not None:
            # Alerts and the stop policy (app/incidents/monitor.py) read this tick's changes.
            pushed = self.incidents.tick(now, out, status)
            if pushed:
                self._emit(*pushed)
        return out

    def _follow(self) -> tuple[str, dict] | None:
        """A follower's tick: read like the leader, push nothing while its pushes reach our pages.

        It reads every tick all the same: its charts (``/api/history``) need
        every heartbeat, and Redis's stream keeps only the last few per rank.
        """
        now = self.clock()
        self.state.scan(now)
        windowed = self._tick_windows(now)
        if self.cluster.relaying():
            return None
        out = self.state.take_delta(now)
        if out and not windowed:
            self._emit(*out, local=True)
        if self.stop_service is not None:
            self._push_stop(self.stop_status(now), local=True)
        return out

    def _tick_windows(self, now: float) -> bool:
        """Push each windowed client its window's changes; returns whether the page runs windowed.

        Windowed, the room gets no rank event (each client has its own, from
        this process: ``app/ranks/window.py``); back below the threshold, the
        room gets a whole snapshot next, as its clients hold only a window.
        """
        windowed = self.windows.active(self.state.world_size())
        if windowed != self.windowed:
            self.windowed = windowed
            if windowed:
                self.windows.refresh_all()
            else:
                self.state.resend()
        if not windowed:
            return False
        for sid, event, payload in self.windows.pushes(self.state, now):
            redact = None if sid in self.operators else self.redact
            push.emit(self.socketio, event, payload, to=sid, local=True, redact=redact)
        return True

    def _tick_stop(self, now: float) -> dict:
        status = self.stop_service.tick(now)
        self._push_stop(status)
        return status

    def _push_stop(self, status: dict, local: bool = False) -> None:
        if self._stop_pushed.take(status):
            self._emit(STOP_EVENT, status, local=local)

    def _tick_checkpoints(self) -> None:
        heartbeats, world = self.state.heartbeats()
        retention = getattr(self.checkpoints, "retention", None)
        if retention is not None:
            # The leader alone gets here: several dashboards never delete twice.
            alerts = getattr(self.incidents, "alerts", None)
            try:
                retention.tick(world, heartbeats, alerts.once if alerts is not None else None)
            except Exception:
                log.exception("checkpoint retention failed; the next new set tries again")
        pushed = self.checkpoints.poll(world)
        if pushed is not None:
            self._emit(*pushed)

    def stop_status(self, now: float) -> dict | None:
        """The stop lifecycle as pushed (for a client that just connected)."""
        if self.stop_service is None:
            return None
        return self.stop_service.status(now)

    def _run(self) -> None:
        deadline = self.clock()
        while not self._stopping.is_set():
            try:
                self.tick()
            except Exception:
                # A bug in one tick must not end live updates for everyone;
                # the next tick starts from the files again.
                log.exception("watcher tick failed")
            # Keep a steady rate (the scan's own time counts against the tick),
            # but after an overlong scan rest half a tick rather than scan
            # back to back on an overloaded machine.
            deadline = max(deadline + self.tick_s, self.clock() + self.tick_s / 2)
            self.socketio.sleep(max(0.0, deadline - self.clock()))

    def stop(self, timeout: float = 5.0) -> None:
        """End the loop (tests and shutdown); waits up to ``timeout`` for it."""
        self._stopping.set()
        with self._lock:
            task = self._task
        if task is not None and task.is_alive():
            task.join(timeout)
        if self.cluster is not None:
            self.cluster.release()
