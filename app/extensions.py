"""The app-wide objects: the Socket.IO server, the per-app container and its accessor.

Kept out of ``app/__init__.py`` so that importing any ``app`` module (the
``rankwatch`` CLI imports ``app.cli``) does not import Flask: routes and
events import these from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flask import current_app, g
from flask_socketio import SocketIO

if TYPE_CHECKING:
    from app.audit import AuditLog
    from app.checkpoints.service import CheckpointService
    from app.incidents.monitor import Incidents
    from app.incidents.stacks import StackService
    from app.run.state import RunState
    from app.stop.service import StopService
    from app.watcher import Watcher

socketio = SocketIO()


@dataclass
class Rankwatch:
    """One run's engines (``app.compose.build``); a dashboard's are kept in ``app.extensions["rankwatch"]``.

    The CLI's (``live=False``) have no watcher, stack service or incidents.
    """

    state: RunState
    audit: AuditLog
    stop: StopService
    # The checkpoint browser's index and actions, with its retention (app/checkpoints/service.py).
    checkpoints: CheckpointService
    watcher: Watcher | None = None
    # Stack captures, alerts and the stop policy (app/incidents/).
    stacks: StackService | None = None
    incidents: Incidents | None = None
    # (endpoint, label) per top-level page; each blueprint adds its own when
    # registered, and base.html draws the nav from this list.
    nav: list[tuple[str, str]] = field(default_factory=list)
    # The run its pushes are for (app/push.py's rooms): None for the one run of --run-dir.
    room: str | None = None
    # What a viewer without the token is pushed of a body (app.edge.auth.redact_run_dir, app/push.py).
    redact: Callable[[Any], Any] | None = None


def run_known(run_id: str) -> bool:
    """Whether ``run_id`` is a run this dashboard serves (for a Socket.IO client that names one)."""
    return current_app.extensions["rankwatch_runs"].known(run_id)


def rankwatch() -> Rankwatch:
    """The engines of the run this request is about: the run in its URL (``g.run_id``, set by
    ``app/runs/scoping.py``), else the app's one run (``--run-dir``)."""
    run_id = g.get("run_id")
    if run_id is not None:
        return current_app.extensions["rankwatch_runs"].get(run_id)
    return current_app.extensions["rankwatch"]
