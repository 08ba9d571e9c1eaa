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

**Timeouts (slowloris).** gunicorn's threaded worker hands a connection to a
thread as soon as its first bytes arrive, and the thread then blocks reading
the rest of the request head; a client that sends a header line every few
seconds holds a thread for ever, and a few dozen of them starve every
page. ``Worker`` reads each request head in the main loop's poller instead,
without a thread, and closes a connection whose head is not complete within
``HEADER_TIMEOUT_S`` (the connections that send nothing go the same way).
Only a complete head reaches a thread, which then reads the body and writes
the answer under a socket timeout of ``READ_TIMEOUT_S``; a WebSocket keeps
that timeout, which Engine.IO's ping every 25 s keeps from firing while the
page is alive. TLS is not offered (terminate it in a reverse proxy, see the
README's security section), so the head is plain bytes.
"""

from __future__ import annotations

import selectors
import socket
import sys
import time
from functools import partial
from typing import Any

from flask import Flask
from gunicorn.app.base import BaseApplication
from gunicorn.workers.gthread import ThreadWorker

from app import create_app, login

# A request head larger than this is refused (431) before a thread sees it:
# a browser's is a few KiB, and waiting heads cost at most this much memory
# each (worker_connections, 1000, of them).
MAX_HEAD_BYTES = 64 * 1024
RECV_BYTES = 16 * 1024
_TOO_LARGE_BODY = b'{"error": "request head too large", "status": 431}'
TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_TOO_LARGE_BODY), _TOO_LARGE_BODY)
)
HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


class Worker(ThreadWorker):
    """gunicorn's threaded worker, with a deadline on every request head and a socket timeout after it.

    Overrides only the points where a connection enters or leaves the thread
    pool: ``enqueue_req`` (every new connection and every kept-alive one that
    becomes readable passes there) and ``handle_request`` (a thread starts
    serving a parsed head); ``murder_keepalived``, called once per loop turn,
    also closes the heads that ran out of time.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        config = self.app.flask_app.config
        self.header_timeout_s = config["HEADER_TIMEOUT_S"]
        self.read_timeout_s = config["READ_TIMEOUT_S"]
        # Connections whose head is still arriving, oldest first (every one
        # has the same timeout, so insertion order is deadline order).
        self.heads: dict[Any, float] = {}

    def enqueue_req(self, conn):
        if conn.initialized and conn.parser.unreader.buf.getvalue():
            # A pipelined request already read ahead: the head is in memory.
            super().enqueue_req(conn)
            return
        conn.head = bytearray()
        self.heads[conn] = time.monotonic() + self.header_timeout_s
        conn.sock.setblocking(False)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_head_data, conn))

    def _on_head_data(self, conn, sock):
        try:
            data = sock.recv(RECV_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop_head(conn)
            return
        if conn.head is None:  # refused: drain until the client closes or the deadline
            return
        conn.head += data
        if not any(end in conn.head for end in HEAD_ENDS):
            if len(conn.head) > MAX_HEAD_BYTES:
                # Answer, then drain instead of closing at once: closing with
                # unread input would reset the connection and lose the answer.
                conn.head = None
                try:
                    sock.send(TOO_LARGE)
                    sock.shutdown(socket.SHUT_WR)
                except OSError:
                    self._drop_head(conn)
            return
        self.poller.unregister(sock)
        del self.heads[conn]
        conn.init()  # the parser (once per connection); sets the socket blocking
        conn.parser.unreader.unread(bytes(conn.head))
        conn.head = None
        super().enqueue_req(conn)

    def _drop_head(self, conn):
        self.heads.pop(conn, None)
        try:
            self.poller.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        self.nr_conns -= 1
        conn.close()

    def murder_keepalived(self, force=False):
        super().murder_keepalived(force)
        now = time.monotonic()
        for conn, deadline in list(self.heads.items()):
            if not force and deadline > now:
                break
            self._drop_head(conn)

    def handle_request(self, req, conn):
        # Bounds the body read, the answer's writes and a WebSocket's silence.
        conn.sock.settimeout(self.read_timeout_s)
        return super().handle_request(req, conn)


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
            "worker_class": f"{__name__}.Worker",
            "threads": self.settings["SERVER_THREADS"],
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
        self.flask_app.extensions["rankwatch"].watcher.ensure_started()

    def _worker_exit(self, server, worker):
        # A clean stop hands the leader lock over at once (app/cluster.py), not after its TTL.
        self.flask_app.extensions["rankwatch"].watcher.stop(timeout=2.0)


def announce(app: Flask, url: str) -> None:
    """The start-up lines; ``Rankwatch: open URL`` is the one to open (the demo repeats it).

    The URL carries a single-use login code, never the token (``app/login.py``):
    these lines end up in logs.
    """
    print(f"Rankwatch: watching {app.config['RUN_DIR']} on {url}", file=sys.stderr)
    print(login.announce(app, url, terminal=sys.stderr.isatty()), file=sys.stderr, flush=True)


OPEN_PREFIX = "Rankwatch: open "


def serve(config: dict[str, Any]) -> None:
    """Serve the dashboard until interrupted (Ctrl-C or SIGTERM)."""
    Server(config).run()
