"""Issue 32, P4: the stop through agents cannot be blocked through Redis.

A real hub (the dashboard app with ``AGENTS`` on) and a real agent (``Agent``,
ticked by the test) on a real redis-server; attacker R writes the flag key.

* Without a key, one ``SET`` of the flag with version 1e300 made the agent
  write ``GracefulExit 0`` and ignore every later stop.
* With a key, R wrote an older signed value over the hub's signed stop: the
  agent never wrote the stop, and the hub never published it again.
* A replayed signed stop made a restarted agent write a stale stop.
"""

from __future__ import annotations

import time

import redis as redis_py

from app.agent import digest as dg
from app.agent.runner import Agent
from app.config import from_env
from tests.helpers.agents import KEY, RUN, SimNode
from tests.helpers.app import make_app, operator
from trainer_bridge.rundir import runfiles


def stop(app, reason: str = "P4") -> str:
    r = app.test_client().post("/api/exit", json={"reason": reason}, headers=operator())
    assert r.status_code == 202, r.get_json()
    return r.get_json()["request_id"]


def scan(app, now: float | None = None) -> None:
    """The hub's watcher tick: read the digests, publish the flag."""
    app.extensions["rankwatch"].state.scan(time.time() if now is None else now)


def setup(tmp_path, redis_server, key: str):
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = make_app(hub_dir, REDIS_URL=redis_server.url, REDIS_KEY=key, AGENTS=True)
    node = SimNode(tmp_path, "node-a", range(0, 2), 2)
    node.beat()
    agent = Agent(node.dir, redis_server.url, RUN, from_env(), key=key.encode() or None, host="node-a")
    # The hub publishes the flag to the hosts it has heard (one value per host, signed with that
    # host's key, P7): it joins the digest stream, then hears node-a.
    scan(app)
    agent.tick(time.time())
    scan(app)
    assert "node-a" in app.extensions["rankwatch"].state.source.hub.hosts
    return app, node, agent, redis_py.Redis.from_url(redis_server.url)


def node_flag(node):
    return runfiles.read_flag(node.dir)


def test_an_unsigned_flag_of_version_1e300_disarms_no_keyless_agent(tmp_path, redis_server):
    app, node, agent, r = setup(tmp_path, redis_server, key="")
    flag_key = dg.flag_key(RUN, "node-a")
    forged = {"flag": '{"GracefulExit": 0}', "version": 1e300, "request_id": None, "at": time.time()}
    r.set(flag_key, dg.seal(forged, "flag", "hub", None, RUN))
    agent.tick(time.time())
    assert node_flag(node) is None, "the forged flag was written"
    assert "out of bounds" in (agent.flag_error or ""), agent.flag_error

    request_id = stop(app)
    scan(app)
    agent.tick(time.time())
    flag = node_flag(node)
    assert flag is not None and flag.exit and flag.request_id == request_id, flag
    agent.outbox.close()


def test_an_older_signed_value_written_over_the_stop_delays_it_one_tick_and_is_said(tmp_path, redis_server):
    app, node, agent, r = setup(tmp_path, redis_server, key=KEY)
    flag_key = dg.flag_key(RUN, "node-a")
    first = stop(app, "first")
    scan(app)
    agent.tick(time.time())
    assert node_flag(node).request_id == first
    old = r.get(flag_key)  # R keeps the first stop's signed value
    c = app.test_client().post("/api/exit/cancel", json={"reason": "go on"}, headers=operator())
    assert c.status_code == 200, c.get_json()
    scan(app)
    agent.tick(time.time())
    assert not node_flag(node).exit
    second = stop(app, "second")
    scan(app)  # the hub publishes the second stop...
    r.set(flag_key, old)  # ...and R writes the older signed value over it
    agent.tick(time.time())
    assert not node_flag(node).exit, "the older value was taken as new"
    scan(app)  # the hub's next tick publishes its flag again
    agent.tick(time.time())
    flag = node_flag(node)
    assert flag.exit and flag.request_id == second, flag
    assert "older" in (agent.flag_error or ""), agent.flag_error
    # Its digests (built before each tick reads the flag) say so, and the page and /api/health
    # name the node whose agent refused a flag.
    digest = agent.tick(time.time())
    assert "older" in (digest["flag_problem"] or ""), "the refusal went out of sight at once"
    app.extensions["rankwatch"].state.scan(time.time())
    run = app.test_client().get("/api/ranks?limit=10", headers=operator()).get_json()["run"]
    assert run["flag_refused_by"] == ["node-a"] and "refuses the hub's stop flag" in run["message"], run
    health = app.test_client().get("/api/health").get_json()["hub"]
    assert health["flag_refused_by"] == ["node-a"], health
    agent.outbox.close()


def test_a_replayed_signed_stop_is_not_written_by_a_restarted_agent(tmp_path, redis_server):
    app, node, agent, r = setup(tmp_path, redis_server, key=KEY)
    flag_key = dg.flag_key(RUN, "node-a")
    stop(app, "yesterday's")
    scan(app)
    replay = r.get(flag_key)
    c = app.test_client().post("/api/exit/cancel", json={"reason": "go on"}, headers=operator())
    assert c.status_code == 200, c.get_json()
    agent.outbox.close()
    # Two minutes later the agent restarts, and R puts the old stop back.
    later = time.time() + 120
    restarted = Agent(node.dir, redis_server.url, RUN, from_env(), key=KEY.encode(), host="node-a")
    r.set(flag_key, replay)
    restarted.tick(later)
    assert node_flag(node) is None, "the replayed stop was written"
    assert "replayed" in (restarted.flag_error or ""), restarted.flag_error
    scan(app, later)  # the hub's own value, published now, is taken
    restarted.tick(later)
    flag = node_flag(node)
    assert flag is not None and not flag.exit, flag
    restarted.outbox.close()
