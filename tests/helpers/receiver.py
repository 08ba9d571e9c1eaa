"""A real HTTP webhook receiver on a loopback port, for alert tests and the incidents benchmark.

It records every JSON body POSTed to it. It can be started on a port chosen
before it exists (``Receiver(port).start()`` later), so a test can let the
dashboard fail against a receiver that is down, then bring it up.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tests.helpers.liveserver import free_port


def quiet_port() -> int:
    """A free port outside the kernel's ephemeral range.

    A receiver that is down is a port nobody listens on; while the sender
    retries against it, its outgoing connections take ephemeral ports, and
    one may take that very port (a TCP self-connect), so the receiver could
    not start there later. Ports below the ephemeral range are never handed out.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low - 12000), low), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


class Receiver:
    def __init__(self, port: int | None = None, status: int = 200, location: str | None = None):
        self.port = port or free_port()
        self.status = status
        self.location = location  # sent with the status: a redirecting receiver
        self.received: list[dict] = []
        self.arrived: list[float] = []  # time.time() of each, for the benchmark
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook/secret-part"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {"unparsed": body.decode(errors="replace")}
                with receiver._lock:
                    receiver.received.append(payload)
                    receiver.arrived.append(time.time())
                self.send_response(receiver.status)
                if receiver.location:
                    self.send_header("Location", receiver.location)
                self.end_headers()

            def do_GET(self):
                # What a followed redirect turns a POST into: recorded, and answered 200.
                with receiver._lock:
                    receiver.received.append({"GET": self.path})
                    receiver.arrived.append(time.time())
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> Receiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def events(self, event: str | None = None) -> list[dict]:
        with self._lock:
            return [p for p in self.received if event is None or p.get("event") == event]

    def wait_for(self, predicate, what: str, timeout: float = 60.0) -> list[dict]:
        """Poll until ``predicate(received payloads)`` is truthy; returns what it returned."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate(self.events())
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(
            f"receiver: no {what} within {timeout} s; got {json.dumps(self.events())[:2000]}"
        )
