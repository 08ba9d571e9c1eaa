"""The production server: gunicorn's threaded worker, one process, with timeouts.

Chosen by measurement (README, "Production server"): Flask-SocketIO documents
gunicorn with the threaded worker plus ``simple-websocket`` for WebSocket,
which keeps the app's ``threading`` async mode (the watcher does blocking
file I/O, psutil probes and subprocesses; eventlet and gevent would need the
standard library monkey-patched under all of it). One worker process only:
Socket.IO sessions live in that process's memory, and gunicorn cannot route
a client back to the same worker.

The app is built in the parent before the worker is forked, so a bad setting
fails at once and a restarted worker keeps the same token; the watcher
thread, which a fork would not carry over, is started in the worker.

The connections themselves (deadlines on heads and bodies, per-address caps,
reserved threads) are handled by ``app/serve/worker.py``.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from flask import Flask
from gunicorn.app.base import BaseApplication

from app import create_app
from app.edge import login

log = logging.getLogger(__name__)


class Server(BaseApplication):
    """gunicorn, configured from the dashboard's settings, serving one app built here."""

    def __init__(self, config: dict[str, Any]):
        self.flask_app: Flask = create_app(config)
        self.settings = config
        super().__init__()

    def load_config(self):
        host, port = self.settings["HOST"], self.settings["PORT"]
        options = {
            "bind": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
            "workers": 1,
            "worker_class": "app.serve.worker.Worker",
            "threads": self.settings["SERVER_THREADS"],
            "worker_connections": self.settings["MAX_CONNECTIONS"],
            # gunicorn's own start-up lines name its version; ours say what matters.
            "loglevel": "warning",
            "accesslog": None,
            # A stop (Ctrl-C, SIGTERM) should not wait long for open WebSockets.
            "graceful_timeout": 3,
            # No ~/.gunicorn/gunicorn.ctl: several dashboards may run on one host.
            "control_socket_disable": True,
            "proc_name": "rankwatch",
            "when_ready": self._when_ready,
            "post_worker_init": self._post_worker_init,
            "worker_exit": self._worker_exit,
        }
        for key, value in options.items():
            self.cfg.set(key, value)

    def load(self):
        return self.flask_app

    def _when_ready(self, arbiter):
        """Print where to look, with the real port (``--port 0`` picks one)."""
        address = arbiter.LISTENERS[0].sock.getsockname()
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        announce(self.flask_app, f"http://{host}:{address[1]}/")

    def _post_worker_init(self, worker):
        # In the worker: a thread started in the parent would not survive the fork.
        self.flask_app.extensions["rankwatch_runs"].ensure_started()

    def _worker_exit(self, server, worker):
        # A clean stop hands the leader lock over at once (app/cluster.py), not after its TTL.
        self.flask_app.extensions["rankwatch_runs"].stop(timeout=2.0)


def announce(app: Flask, url: str) -> None:
    """The start-up lines; ``Rankwatch: open URL`` is the one to open (the demo repeats it).

    The URL carries a single-use login code, never the token (``app/edge/login.py``):
    these lines end up in logs.
    """
    watched = app.config["RUN_DIR"] or f"the runs under {app.config['RUNS_ROOT']}"
    print(f"Rankwatch: watching {watched} on {url}", file=sys.stderr)
    print(login.announce(app, url, terminal=sys.stderr.isatty()), file=sys.stderr, flush=True)


OPEN_PREFIX = "Rankwatch: open "


def serve(config: dict[str, Any]) -> None:
    """Serve the dashboard until interrupted (Ctrl-C or SIGTERM)."""
    quiet_closed_websockets()
    Server(config).run()


def quiet_closed_websockets() -> None:
    """One log line, not a traceback, when a WebSocket's writer thread finds its socket closed.

    Engine.IO's writer thread ends with an unguarded ``ws.close()`` (``engineio/socket.py``,
    ``writer``). When the server closed the connection first (a client gone, or one the
    connection limits dropped), that close raises ``OSError`` in the library's thread, and
    Python printed a traceback for a client that was simply gone (seen under 500 hostile
    connections). Any other exception in any thread keeps the default report.
    """
    previous = threading.excepthook

    def hook(args) -> None:
        if issubclass(args.exc_type, OSError) and _in_engineio_writer(args.exc_traceback):
            log.info(
                "a WebSocket's writer found its connection closed (the client is gone): %s", args.exc_value
            )
            return
        previous(args)

    threading.excepthook = hook


def _in_engineio_writer(tb) -> bool:
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "writer" and code.co_filename.replace("\\", "/").endswith("engineio/socket.py"):
            return True
        tb = tb.tb_next
    return False
