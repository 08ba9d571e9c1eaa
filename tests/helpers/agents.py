"""Real ``rankwatch agent`` processes for the agent tests (``python -m app.cli agent ...``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.heartbeats import heartbeat, write_heartbeat
from tests.helpers.liveserver import REPO

KEY = "agent-test-key"
RUN = "job"


class Node:
    """A simulated node: its own run directory and the heartbeats of its ranks, kept fresh by ``beat``."""

    def __init__(self, root, host: str, ranks: range, world: int):
        self.dir = root / host / RUN
        self.dir.mkdir(parents=True)
        self.host, self.ranks, self.world, self.seq = host, ranks, world, 0

    def beat(self, **overrides) -> None:
        self.seq += 1
        for r in self.ranks:
            write_heartbeat(self.dir, heartbeat(r, self.world, seq=self.seq, host=self.host, **overrides))


class AgentProcess:
    """One agent subprocess; its output goes to ``log``.

    ``prefix`` runs it through another command first (a node of
    ``tests/helpers/netns.py``, whose commands all ``exec``: the process
    killed is the agent itself).
    """

    def __init__(
        self,
        run_dir: Path,
        url: str,
        log: Path,
        *,
        run: str | None = None,
        host: str | None = None,
        env=None,
        prefix: list[str] | None = None,
    ):
        self.cmd = [*(prefix or []), sys.executable, "-m", "app.cli", "agent"]
        self.cmd += ["--run-dir", str(run_dir), "--redis", url]
        self.cmd += ["--run", run] if run else []
        self.cmd += ["--host", host] if host else []
        self.env = {**os.environ, **(env or {})}
        self.log_path = log
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProcess:
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: an agent that dies without a word."""
        if self.alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
