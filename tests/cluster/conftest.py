"""The cluster tests' fixtures; their helpers are in ``tests/helpers/agents.py``."""

from __future__ import annotations

import pytest

from tests.helpers.agents import KEY, AgentProcess, SimNode
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.netns import TwoNodes, skip_reason
from tests.helpers.queuepage import queue_dashboard, stop_all


@pytest.fixture
def agents(tmp_path, redis_server, start_agent):
    """``agents(node, **kw)``: a started ``rankwatch agent`` on a ``SimNode``'s directory, stopped after the test."""

    def start(node: SimNode, **kw) -> AgentProcess:
        env = {"RANKWATCH_REDIS_KEY": KEY, **{f"RANKWATCH_{k}": str(v) for k, v in FAST_SETTINGS.items()}}
        return start_agent(
            node.dir, redis_server.url, tmp_path / f"agent-{node.host}.log", host=node.host, env=env, **kw
        )

    return start


@pytest.fixture
def dashboard(redis_server, run_dir, tmp_path):
    """``start(key)``: a real dashboard process on ``redis_server``, with one polling page."""
    started: list = []
    yield lambda key: queue_dashboard(redis_server, run_dir, tmp_path, started, key)
    stop_all(started)


def _two_nodes(uplink: bool):
    why = skip_reason()
    if why:
        pytest.skip(why)
    with TwoNodes(uplink=uplink) as two:
        yield two


@pytest.fixture
def nodes():
    """Two network namespaces on this machine (``tests/helpers/netns.py``), removed after the test;
    skips, with the reason, where they cannot be made."""
    yield from _two_nodes(uplink=False)


@pytest.fixture
def uplinked_nodes():
    """The same, with node 0 also reachable from the test's process (a server there, checked from here)."""
    yield from _two_nodes(uplink=True)
