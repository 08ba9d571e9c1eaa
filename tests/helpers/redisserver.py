"""A real ``redis-server`` on a loopback port, for the Redis tests (fixture ``redis_server`` in conftest)."""

from __future__ import annotations

import subprocess
import time

from tests.helpers.liveserver import free_port


class RedisServer:
    def __init__(self, tmp_path):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = tmp_path / f"redis-{self.port}.log"
        self.proc = None

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
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
