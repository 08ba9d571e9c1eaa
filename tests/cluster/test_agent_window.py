"""The windowed ranks page of a hub (``app/ranks/window.py`` over ``app/agent/hubsource.py``).

Real agents and a real redis-server, as ``tests/cluster/test_agent.py``, and
a hub that windows any job above 4 ranks. Its windows are read directly:
with ``REDIS_URL`` Flask-SocketIO runs a message queue, which its test
client refuses (the page's own events are ``tests/ranks/test_window*.py``).
"""

from __future__ import annotations

import time

import pytest

from app.ranks.window import RanksView
from tests.helpers.agents import RUN, SimNode, hub_app, ranks_healthy
from tests.helpers.app import wait_for


@pytest.fixture
def windowed_hub(tmp_path, redis_server):
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = hub_app(hub_dir, redis_server.url, AGENT_LOST_S=30.0, PAGE_WINDOW_RANKS=4)
    yield app
    app.extensions["rankwatch"].state.source.hub.close()


def test_a_hub_window_carries_the_host_rows_of_its_ranks_only(tmp_path, windowed_hub, agents):
    a = SimNode(tmp_path, "node-a", range(0, 4), 8)
    b = SimNode(tmp_path, "node-b", range(4, 8), 8)
    agents(a)
    agents(b)
    wait_for(lambda: ranks_healthy(windowed_hub, [a, b], 8), "8 healthy ranks from two agents", timeout=120)

    rw = windowed_hub.extensions["rankwatch"]
    windows = rw.watcher.windows
    assert windows.active(rw.state.world_size())
    windows.join("page")
    snap = windows.snapshot(rw.state, time.time(), "page")
    assert snap["window"]["total"] == 8 and [r["rank"] for r in snap["ranks"]] == list(range(8))
    assert [h["host"] for h in snap["hosts"]] == ["node-a", "node-b"]

    windows.set_view("page", RanksView(page=3, per_page=2))
    [(sid, event, snap)] = windows.pushes(rw.state, time.time())
    assert (sid, event) == ("page", "ranks_snapshot")
    assert [r["rank"] for r in snap["ranks"]] == [4, 5]
    # Only the hosts of the window's ranks: what the page receives does not grow with the hosts.
    assert [h["host"] for h in snap["hosts"]] == ["node-b"]
    assert snap["run"]["transport"] == "agents" and sum(snap["summary"]["counts"].values()) == 8
