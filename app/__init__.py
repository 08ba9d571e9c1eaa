"""Rankwatch's dashboard: a Flask + Flask-SocketIO application factory.

Nothing happens at import time. ``create_app`` builds the app, its
``RunState`` and its (not yet started) ``Watcher``; the first Socket.IO
client starts the watcher.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flask import Flask, current_app
from flask_socketio import SocketIO

from app.audit import AuditLog
from app.auth import ensure_token
from app.config import coerce_all, from_env
from app.state import RunState
from app.stop_service import StopService
from app.watcher import Watcher
from trainer_bridge import runfiles

if TYPE_CHECKING:
    from app.checkpoints.service import CheckpointService

# static/ and templates/ live at the top of the repository (DESIGN.md).
ROOT = Path(__file__).resolve().parent.parent

socketio = SocketIO()


@dataclass
class Rankwatch:
    """The app's per-instance objects, kept in ``app.extensions["rankwatch"]``."""
    state: RunState
    watcher: Watcher
    stop: StopService
    # (endpoint, label) per top-level page; each blueprint adds its own when
    # registered, and base.html draws the nav from this list.
    nav: list[tuple[str, str]] = field(default_factory=list)
    # The checkpoint browser's index and actions (app/checkpoints/service.py).
    checkpoints: CheckpointService | None = None


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """Build the dashboard. ``config`` overrides the settings read from the environment."""
    app = Flask(__name__, static_folder=str(ROOT / "static"),
                template_folder=str(ROOT / "templates"))
    app.config.update(from_env())
    app.config.update(coerce_all(config or {}))
    app.config["TOKEN_GENERATED"] = ensure_token(app.config)
    app.config["MAX_CONTENT_LENGTH"] = app.config["MAX_BODY_BYTES"]

    from app import errors
    errors.register(app)

    run_dir = app.config["RUN_DIR"] or None
    state = RunState(run_dir, app.config)
    audit = AuditLog(app.config["AUDIT_DB"] or runfiles.state_dir(run_dir or ".") / "audit.sqlite3")
    stop = StopService(run_dir or ".", audit, deadline_s=app.config["STOP_DEADLINE_S"],
                       auto_rearm=app.config["AUTO_REARM"])
    # Imported here, not at the top: the package's routes import this module.
    from app.checkpoints.service import CheckpointService
    from app.checkpoints.verify import Verifier
    checkpoints = CheckpointService(run_dir, audit, scan_s=app.config["CHECKPOINT_SCAN_S"],
                                    verifier=Verifier(socketio.start_background_task, socketio.emit))
    rw = app.extensions["rankwatch"] = Rankwatch(
        state=state, watcher=Watcher(socketio, state, app.config["TICK_S"], stop=stop,
                                     checkpoints=checkpoints),
        stop=stop, checkpoints=checkpoints)
    app.context_processor(lambda: {"nav_links": rw.nav})

    # Blueprints before init_app: importing one registers its Socket.IO
    # handlers, which Flask-SocketIO carries over to every later init_app only
    # while no server exists yet (one app per test relies on that).
    from app.main import bp as main_bp
    app.register_blueprint(main_bp)
    from app.stop import bp as stop_bp
    app.register_blueprint(stop_bp)
    from app.checkpoints import bp as checkpoints_bp
    app.register_blueprint(checkpoints_bp)

    # Threading, not eventlet/gevent: the watcher does blocking file I/O and
    # the werkzeug server with simple-websocket needs no monkey-patching.
    socketio.init_app(app, async_mode="threading")
    # In front of Engine.IO: malformed long-polling POSTs get a 400 (app/sockguard.py).
    from app.sockguard import SocketGuard
    app.wsgi_app = SocketGuard(app.wsgi_app)
    return app


def rankwatch() -> Rankwatch:
    """The current app's state, watcher and nav."""
    return current_app.extensions["rankwatch"]
