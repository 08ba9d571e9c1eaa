"""A real ``redis-server`` on a loopback port, for the Redis tests (fixture ``redis_server`` in conftest).

``bind`` and ``prefix`` put it elsewhere: ``prefix`` runs it through another
command first (a network namespace, ``tests/helpers/netns.py``) and ``bind``
lists its addresses there, the first of which ``url`` names (protected mode is
off then, or Redis would refuse the other namespaces' clients).
"""

from __future__ import annotations

import subprocess
import time

from tests.helpers.liveserver import free_port


class RedisServer:
    def __init__(self, tmp_path, bind: tuple[str, ...] = ("127.0.0.1",), prefix: list[str] | None = None):
        self.port = free_port()
        self.bind = bind
        self.prefix = prefix or []
        self.url = f"redis://{bind[0]}:{self.port}/0"
        self.log = tmp_path / f"redis-{self.port}.log"
        self.proc = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                *self.prefix,
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                *self.bind,
                "--save",
                "",
                "--appendonly",
                "no",
                # Bound beyond loopback (only in a test's own network namespace), it must accept peers.
                "--protected-mode",
                "yes" if self.bind == ("127.0.0.1",) else "no",
            ],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
        )
        import redis

        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                return self
            except redis.ConnectionError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
