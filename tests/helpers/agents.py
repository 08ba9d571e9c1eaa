"""The agent tests' parts: real ``rankwatch agent`` processes, simulated nodes, a hub on Redis.

A simulated node (``SimNode``, not ``tests/helpers/netns.py``'s namespaced
``Node``) is a run directory of its own whose heartbeats the test writes in
the bridge's format; the hub is the dashboard's app with ``AGENTS`` on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.app import make_app, operator
from tests.helpers.heartbeats import heartbeat, write_heartbeat
from tests.helpers.liveserver import REPO
from trainer_bridge.rundir import redisbus, runfiles

# The Redis key of the agent tests' digests, and the base name every node's run directory shares.
KEY = "agent-test-key"
RUN = "job"


def agent_key(host: str) -> bytes:
    """The key ``host``'s agent signs with: derived from ``KEY`` (the master) for that host (issue 32, P7)."""
    return redisbus.derive(KEY.encode(), redisbus.agent_label(host))


class SimNode:
    """A simulated node: its own run directory and the heartbeats of its ranks, kept fresh by ``beat``."""

    def __init__(self, root, host: str, ranks: range, world: int):
        self.dir = root / host / RUN
        self.dir.mkdir(parents=True)
        self.host, self.ranks, self.world, self.seq = host, ranks, world, 0

    def beat(self, **overrides) -> None:
        self.seq += 1
        for r in self.ranks:
            write_heartbeat(self.dir, heartbeat(r, self.world, seq=self.seq, host=self.host, **overrides))


def hub_app(hub_dir, redis_url: str, **settings):
    """The test dashboard (``make_app``) as a hub on ``redis_url``: ``AGENTS`` on, ``KEY``; ``settings`` override."""
    return make_app(hub_dir, REDIS_URL=redis_url, REDIS_KEY=KEY, AGENTS=True, **settings)


def view(app) -> dict:
    """Scan once and answer ``/api/ranks``, as a page would get it."""
    state = app.extensions["rankwatch"].state
    state.scan(time.time())
    r = app.test_client().get("/api/ranks?limit=10000", headers=operator())
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()


def ranks_healthy(app, nodes: list[SimNode], expect: int):
    """One beat of every node, then ``/api/ranks`` if it shows ``expect`` ranks all healthy, else None."""
    for node in nodes:
        node.beat()
    v = view(app)
    return v if len(v["ranks"]) == expect and all(r["health"] == "healthy" for r in v["ranks"]) else None


def write_set(node: SimNode, global_step: int, ranks) -> None:
    """Rank files as the bridge saves them on a stop, on this node's own disk."""
    # Imports MindSpore: conftest imports this module, and only the tests that save should pay for it.
    from tests.helpers.checkpoints import save_small

    for r in ranks:
        save_small(
            runfiles.checkpoint_path(node.dir, r, 1, global_step),
            {
                "epoch_num": 1,
                "step_num": global_step,
                "global_step": global_step,
                "rankwatch_rank": r,
                "rankwatch_world_size": node.world,
            },
        )


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
