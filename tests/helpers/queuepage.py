"""A Socket.IO page over long-polling and the message queue's forgeries, for the Redis queue tests.

``PollingPage`` connects like a browser's page (which starts the dashboard's
queue listener) and records every event it receives; ``publish`` puts a
payload on a job's queue channel as anyone who reaches Redis can.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from app.cluster import channel
from tests.helpers.app import TOKEN
from tests.helpers.liveserver import start_dashboard


def until(fn, what: str, timeout: float = 60.0):
    """``fn()`` until it returns something true; fails after ``timeout`` saying ``what``.

    An OSError (a file not written yet, a server not answering yet) means: ask again."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except OSError as e:
            last = e
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s; last: {last!r}")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


class PollingPage:
    """A Socket.IO page over Engine.IO long-polling (protocol 4), in a few lines of urllib.

    Connecting is what makes python-socketio start the message queue's
    listener; ``events`` collects every event the page receives.
    """

    def __init__(self, base: str, auth: dict | None = None):
        self.base = base.rstrip("/") + "/socket.io/?EIO=4&transport=polling"
        with urllib.request.urlopen(self.base, timeout=30) as r:
            opened = r.read().decode()
        assert opened.startswith("0"), opened
        self.url = self.base + "&sid=" + json.loads(opened[1:])["sid"]
        # ``auth``: the connect's payload (``{"page", "token"}``); a refusal arrives as a "connect_error" event.
        self._post("40" + (json.dumps(auth) if auth else ""))
        self.events: list[tuple[str, list]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _post(self, packet: str) -> None:
        req = urllib.request.Request(self.url, data=packet.encode(), method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=60) as r:
                    payload = r.read().decode()
            except OSError:
                return
            for packet in payload.split("\x1e"):
                if packet == "2":
                    self._post("3")  # pong, or the server drops the page
                elif packet.startswith("42"):
                    name, *args = json.loads(packet[2:])
                    self.events.append((name, args))
                elif packet.startswith("44"):
                    self.events.append(("connect_error", [json.loads(packet[2:])]))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    def close(self) -> None:
        self._stop.set()
        try:
            self._post("41")
        except OSError:
            pass


def publish(url: str, job: str, payload: bytes | str) -> None:
    import redis

    assert redis.Redis.from_url(url).publish(channel(job), payload) == 1  # the dashboard heard it


def emit(event: str) -> dict:
    return {
        "method": "emit",
        "event": event,
        "data": [{"forged": True}],
        "binary": False,
        "namespace": "/",
        "room": None,
        "skip_sid": None,
        "callback": None,
        "host_id": "attacker",
    }


def queue_dashboard(redis_server, run_dir, tmp_path, started: list, key: str | None):
    """A real dashboard process on ``redis_server`` with one polling page; both go in ``started``."""
    env = {"RANKWATCH_REDIS_URL": redis_server.url, "RANKWATCH_TOKEN": TOKEN}
    if key:
        env["RANKWATCH_REDIS_KEY"] = key
    server = start_dashboard(run_dir, tmp_path / "dashboard.log", env=env)
    started.append(server)
    page = PollingPage(server.url)
    started.append(page)
    until(lambda: get_json(server.url + "/api/health")["redis"]["relay"], "the relay listens")
    return server, page


def stop_all(started: list) -> None:
    for thing in reversed(started):
        if isinstance(thing, PollingPage):
            thing.close()
        else:
            thing.stop()
