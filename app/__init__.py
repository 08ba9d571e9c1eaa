"""Rankwatch's dashboard: a Flask + Flask-SocketIO application factory.

Nothing happens at import time, and nothing heavy is imported: every
``app.*`` import runs this file first, and ``rankwatch --version`` must not
pay for Flask. ``create_app`` imports what it builds: the app, its
``RunState`` and its (not yet started) ``Watcher``; the server
(``app/serve/server.py``) starts the watcher in its worker, or else the first
Socket.IO client does. The shared objects live in ``app/extensions.py``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flask import Flask

HERE = Path(__file__).resolve().parent
# In a checkout (and an editable install) static/ and templates/ sit at the
# top of the repository, beside app/; that layout is fixed, because tests and
# users rely on it. A wheel carries them inside the package, as app/static
# and app/templates (pyproject.toml maps them there).
ROOT = HERE.parent


def asset_dirs() -> tuple[Path, Path]:
    """(static, templates): inside the installed package if there, else the checkout's."""
    if (HERE / "templates").is_dir():
        return HERE / "static", HERE / "templates"
    return ROOT / "static", ROOT / "templates"


def create_app(config: Mapping[str, Any] | None = None) -> Flask:
    """Build the dashboard. ``config`` overrides the settings read from the environment."""
    from flask import Flask

    from app.config import coerce_all, from_env
    from app.edge.auth import Limits, ensure_token, token_weakness
    from app.edge.login import LOGIN_COMMAND, LoginCodes
    from app.extensions import socketio

    static, templates = asset_dirs()
    app = Flask(__name__, static_folder=str(static), template_folder=str(templates))
    app.config.update(from_env())
    app.config.update(coerce_all(config or {}))
    app.config["TOKEN_GENERATED"] = ensure_token(app.config)
    app.extensions["rankwatch_limits"] = Limits.from_config(app.config)
    app.extensions["rankwatch_login"] = LoginCodes(ttl_s=app.config["LOGIN_TTL_S"])
    weakness = None if app.config["TOKEN_GENERATED"] else token_weakness(app.config["TOKEN"])
    if weakness:
        app.logger.warning(
            "RANKWATCH_TOKEN is weak (%s): anyone who can reach the port may guess it; "
            "use a long random one, e.g. python -c 'import secrets; print(secrets.token_urlsafe(24))'",
            weakness,
        )
    app.config["MAX_CONTENT_LENGTH"] = app.config["MAX_BODY_BYTES"]

    from app import errors

    errors.register(app)

    from app.cluster import Cluster
    from app.compose import build

    # Several dashboards behind one Redis: its message queue and leader lock (app/cluster.py).
    cluster = Cluster.from_config(app.config, app.config["RUN_DIR"] or None)
    # One run (--run-dir): its container is the app's, at today's URLs. A root of
    # runs (--runs): the registry holds one per run, and this one stands empty.
    rw = app.extensions["rankwatch"] = build(
        None if app.config["RUNS_ROOT"] else (app.config["RUN_DIR"] or None), app.config, cluster=cluster
    )
    incidents = rw.incidents
    # A flood of wrong tokens or codes (app.edge.auth.settle) is an alert, once a minute at most.
    app.extensions["rankwatch_limits"].on_flood = lambda text: incidents.alerts.once(
        f"auth-flood:{int(time.time() // 60)}", "auth_flood", text
    )
    app.context_processor(lambda: {"nav_links": rw.nav, "login_command": LOGIN_COMMAND})

    # Blueprints before init_app: importing one registers its Socket.IO
    # handlers, which Flask-SocketIO carries over to every later init_app only
    # while no server exists yet (one app per test relies on that).
    from app.checkpoints import routes as checkpoints_routes
    from app.edge import routes as edge_routes
    from app.incidents import routes as incidents_routes
    from app.prometheus import routes as metrics_routes
    from app.ranks import routes as ranks_routes
    from app.runs import routes as runs_routes
    from app.stop import routes as stop_routes

    # Under --runs, "/" is the runs table: its rule first, the one "/" matches (app/runs/routes.py).
    if app.config["RUNS_ROOT"]:
        app.register_blueprint(runs_routes.bp)
    # In nav order: the ranks page first.
    for routes in (
        ranks_routes,
        stop_routes,
        checkpoints_routes,
        incidents_routes,
        edge_routes,
        metrics_routes,
    ):
        app.register_blueprint(routes.bp)
    # Every route above, once more per run (/runs/<id>/, /api/runs/<id>/...), and the runs table.
    from app.runs import scoping
    from app.runs.registry import Registry, single_id
    from app.runs.rows import Rows

    registry = Registry(
        app.config,
        lambda path, run_id: build(path, app.config, run_id=run_id, room=run_id),
        single=None if app.config["RUNS_ROOT"] else (single_id(app.config["RUN_DIR"] or "."), rw),
        start_task=socketio.start_background_task,
        sleep=socketio.sleep,
    )
    scoping.install(app, registry)
    runs_routes.register(app, Rows(registry, functools.partial(build, live=False), app.config))

    # Threading, not eventlet/gevent: the watcher does blocking file I/O, and
    # gunicorn's threaded worker with simple-websocket (app/serve/server.py) needs
    # no monkey-patching.
    # client_manager is passed even when None: init_app keeps the options of
    # an earlier call (an earlier app in the same process, in tests).
    socketio.init_app(app, async_mode="threading", client_manager=cluster.queue if cluster else None)
    # The middleware, outermost last, in the order app/edge/__init__.py describes.
    from app.edge import wrap

    wrap(app)
    return app
