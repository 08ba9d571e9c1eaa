"""The production server (``app/serve/server.py``) against slow, idle and stalled clients.

A real ``python -m app`` process and real sockets. Waits poll with generous
deadlines; nothing asserts how fast the server is, only what it does.
"""

from __future__ import annotations

import json
import re
import select
import socket
import time
import urllib.request
from urllib.parse import urlparse

import pytest
from playwright.sync_api import expect

SLOW = 100  # connections that send a header line now and then, never the end of the head
IDLE = 100  # connections that send nothing at all
DEADLINE_S = 120


def address(url: str) -> tuple[str, int]:
    parts = urlparse(url)
    return parts.hostname, parts.port


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset); never blocks."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(4096) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def get_json(url: str, timeout: float = 60) -> tuple[dict, dict]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r), dict(r.headers)


@pytest.mark.parametrize(
    "live_env",
    [{"SERVER_THREADS": 4, "HEADER_TIMEOUT_S": 15}],
    indirect=True,
)
def test_slowloris_neither_starves_the_page_nor_lingers(live_server):
    """200 slow or idle connections against 4 threads: a normal request is answered, and they get closed."""
    host, port = address(live_server.url)
    slow, idle = [], []
    try:
        for i in range(SLOW + IDLE):
            s = socket.create_connection((host, port), timeout=10)
            if i < SLOW:
                s.sendall(b"GET /api/summary HTTP/1.1\r\nHost: localhost\r\n")
                slow.append(s)
            else:
                idle.append(s)
        for s in slow:  # one more header line each, so these are not idle
            s.sendall(b"X-Slow: 1\r\n")

        body, headers = get_json(live_server.url + "/api/summary")
        assert "summary" in body
        # It was answered while all 200 were still open, not after they timed out.
        still_open = [s for s in slow + idle if not closed_by_server(s)]
        assert len(still_open) == SLOW + IDLE

        # The server says what it is, not which version (the security review's item 10).
        assert not re.search(r"\d", headers.get("Server", "")), headers

        # Keep trickling; every connection is closed once its head is overdue.
        deadline = time.monotonic() + DEADLINE_S
        open_ = set(slow + idle)
        while open_ and time.monotonic() < deadline:
            for s in list(open_):
                if closed_by_server(s):
                    open_.discard(s)
                elif s in slow:
                    try:
                        s.sendall(b"X")
                    except OSError:
                        open_.discard(s)
            time.sleep(0.5)
        assert not open_, f"{len(open_)} of {SLOW + IDLE} slow connections are still open"

        # And the server still serves.
        assert "summary" in get_json(live_server.url + "/api/summary")[0]
    finally:
        for s in slow + idle:
            s.close()


def test_an_endless_request_head_is_refused_before_it_reaches_a_thread(live_server):
    """Heads wait in memory without a thread, so their size is bounded: 431 past 64 KiB."""
    host, port = address(live_server.url)
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\n")
        try:
            for _ in range(100):
                s.sendall(b"X-Pad: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # closed by the server mid-send: the answer is already waiting
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"error": "request head too large", "status": 431}
    assert "summary" in get_json(live_server.url + "/api/summary")[0]


@pytest.mark.slow
@pytest.mark.parametrize("live_env", [{"READ_TIMEOUT_S": 26}], indirect=True)
def test_a_stalled_body_frees_its_thread(live_server):
    """A POST whose body stops arriving is dropped after READ_TIMEOUT_S, without a 500."""
    host, port = address(live_server.url)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(
            b"POST /api/session HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"tok'
        )
        deadline = time.monotonic() + DEADLINE_S
        while not closed_by_server(s):
            assert time.monotonic() < deadline, "the stalled request is still open"
            time.sleep(0.5)
    assert "unhandled error" not in live_server.log() and "Traceback" not in live_server.log(), (
        live_server.log()
    )
    assert "summary" in get_json(live_server.url + "/api/summary")[0]


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("live_env", [{"READ_TIMEOUT_S": 26}], indirect=True)
def test_an_open_page_keeps_its_websocket_past_the_read_timeout(live_server, page, console_errors):
    """Engine.IO's ping (every 25 s) keeps a live page's WebSocket under READ_TIMEOUT_S."""
    sockets, closed = [], []

    def on_ws(ws):
        sockets.append(ws)
        ws.on("close", lambda _: closed.append(ws.url))

    page.on("websocket", on_ws)
    page.goto(live_server.url + "/")
    expect(page.locator("#connection")).to_have_attribute("data-state", "live", timeout=30_000)
    opened = time.monotonic()
    # Wait past the read timeout (26 s from the socket's last data at most), polling: the socket must
    # stay up throughout. Engine.IO's ping at 25 s is what keeps it; a second window adds nothing.
    while time.monotonic() - opened < 26 + 9:
        assert not closed, f"the WebSocket closed: {closed}"
        page.wait_for_timeout(1000)
    assert sockets and not closed
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    assert console_errors == []
