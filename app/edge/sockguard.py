"""A guard in front of the Engine.IO endpoint for what python-engineio mishandles.

Found by ``tests/edge/test_faults_fuzz.py`` (python-engineio 4.15): a long-polling
POST that carries a packet a client never sends there (a PING ``2``, a
NOOP ``6``, an OPEN ``0``, an unknown type) or a body over the size limit
makes engineio disconnect the session with ``close(wait=True)``, which waits
for a poll that never comes, so the request's thread blocks for good; and a
POST that races the session's close gets a 500 (``KeyError: Session is
disconnected``). This middleware answers those requests with a 400 before
engineio sees them, and turns any exception escaping engineio into a 400,
so malformed Socket.IO traffic is refused like malformed API requests, in
the same ``{"error", "status"}`` shape (``app.errors``; this runs outside
Flask's request context, so it builds the body itself).
Everything else passes through untouched.
"""

from __future__ import annotations

import io
import json
import logging
import re

log = logging.getLogger(__name__)

# Engine.IO v4 packet types a client may POST over long-polling: CLOSE,
# PONG, MESSAGE, UPGRADE; "b" starts a base64 binary MESSAGE.
CLIENT_POLLING_TYPES = frozenset("1345b")
SEPARATOR = "\x1e"  # Engine.IO v4 record separator between packets in one payload
# A Socket.IO EVENT ("4" MESSAGE + "2" EVENT, an optional namespace and ack id)
# named like a lifecycle event: python-socketio would run the connect handler
# again for it (app/ranks/events.py refuses that too, for WebSocket frames).
RESERVED_EVENT = re.compile(r'^42(?:/[^,]*,)?\d*\s*\[\s*"(?:connect|disconnect|connect_error)"')


class SocketGuard:
    """WSGI middleware: refuse malformed long-polling POSTs to ``path`` with a 400."""

    def __init__(self, wsgi_app, path: str = "/socket.io/", max_bytes: int = 1_000_000):
        self.wsgi_app = wsgi_app
        self.path = path
        self.max_bytes = max_bytes

    def __call__(self, environ, start_response):
        if not environ.get("PATH_INFO", "").startswith(self.path):
            return self.wsgi_app(environ, start_response)
        if environ.get("REQUEST_METHOD") == "POST":
            refused = self._check_post(environ)
            if refused:
                return _refuse(start_response, *refused)
        try:
            return self.wsgi_app(environ, start_response)
        except StopIteration:
            # How engineio ends a WebSocket under gunicorn (the socket is closed
            # already): the server must see it, not a 400 written after the close.
            raise
        except Exception:  # engineio raised instead of answering: a client error, not ours
            log.info("socket.io request refused after an engineio error", exc_info=True)
            return _refuse(start_response, "400 BAD REQUEST", "bad Socket.IO request")

    def _check_post(self, environ) -> tuple[str, str] | None:
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            return "400 BAD REQUEST", "bad Content-Length"
        if length < 0 or length > self.max_bytes:
            return "413 REQUEST ENTITY TOO LARGE", "Socket.IO payload too large"
        body = environ["wsgi.input"].read(length)
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            return "400 BAD REQUEST", "Socket.IO payload is not UTF-8"
        packets = [packet for packet in text.split(SEPARATOR) if packet]
        if not {packet[:1] for packet in packets} <= CLIENT_POLLING_TYPES:
            return "400 BAD REQUEST", "unexpected Engine.IO packet type"
        if any(RESERVED_EVENT.match(packet) for packet in packets):
            return "400 BAD REQUEST", "a client may not send an event named connect or disconnect"
        return None


def _refuse(start_response, status: str, message: str):
    body = json.dumps({"error": message, "status": int(status.split()[0])}).encode()
    start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
    return [body]
