"""The bytes of HTTP/1.1 that the server's poller reads and writes itself (app/serve/worker.py).

Heads and bodies are read without a thread, so the worker must know a
little of each request before gunicorn parses it: where it goes, whether it
carries the operator token, how long its body is. ``Head.parse`` finds
that; gunicorn then parses the same bytes again, and remains the judge of
what is valid (a malformed head is passed on for it to answer 400).
"""

from __future__ import annotations

import json

# A request head larger than this is refused (431) before a thread sees it:
# a browser's is a few KiB, and waiting heads cost at most this much memory
# each (MAX_CONNECTIONS of them).
MAX_HEAD_BYTES = 64 * 1024
RECV_BYTES = 16 * 1024
HEAD_ENDS = (b"\r\n\r\n", b"\n\n")


def answer(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP answer with the API's error shape, that closes the connection."""
    body = json.dumps({"error": message, "status": status}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


TOO_LARGE = answer(431, "Request Header Fields Too Large", "request head too large")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class Head:
    """What the worker needs from a request head to route it; ``parse`` returns None until it is complete."""

    __slots__ = ("size", "path", "bearer", "length", "chunked", "expect_continue", "websocket")

    @classmethod
    def parse(cls, buf: bytes | bytearray) -> Head | None:
        ends = [(i, end) for end in HEAD_ENDS if (i := buf.find(end)) >= 0]
        if not ends:
            return None
        at, end = min(ends)
        head = cls()
        head.size = at + len(end)
        lines = bytes(buf[:at]).split(b"\n")
        target = lines[0].split(b" ")[1] if len(lines[0].split(b" ")) > 1 else b""
        head.path = target.split(b"?", 1)[0].decode("latin-1")
        head.bearer = head.length = None
        head.chunked = head.expect_continue = head.websocket = False
        lengths = []
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    head.bearer = token.strip()
            elif name == b"content-length":
                lengths.append(value)
            elif name == b"transfer-encoding":
                head.chunked = True
            elif name == b"expect":
                head.expect_continue = value.lower() == b"100-continue"
            elif name == b"upgrade":
                head.websocket = value.lower() == b"websocket"
        if len(lengths) == 1 and lengths[0].isdigit():
            head.length = int(lengths[0])
        # Several or malformed lengths: gunicorn answers 400 without reading a body.
        return head
