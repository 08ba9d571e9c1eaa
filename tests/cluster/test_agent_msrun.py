"""A real 2-rank msrun job seen only through its node's agent (issue 20).

The job writes its heartbeats into its own run directory, where the agent
(a real ``rankwatch agent`` process) reads them; the dashboard runs on a
different directory of the same base name that holds no heartbeat, with
``RANKWATCH_AGENTS``, so every row it shows came from a digest. Redis is
Debian's ``redis-server`` on a loopback port. Every wait polls for an
event; nothing asserts a duration.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.helpers.app import AUTH, FAST_SETTINGS, TOKEN, wait_for
from tests.helpers.jobs import dump
from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.msrun

KEY = "agent-msrun-key"


def api(server, path: str = "/api/ranks") -> dict:
    with urllib.request.urlopen(server.url + path, timeout=30) as r:
        return json.loads(r.read())


def settings() -> dict:
    return {f"RANKWATCH_{k}": str(v) for k, v in FAST_SETTINGS.items()}


@pytest.fixture
def node(run_dir, tmp_path, redis_server, start_job, start_agent, start_server):
    """The job, its agent and a dashboard on an empty directory of the run's base name; all ended after."""
    hub_dir = tmp_path / "hub" / run_dir.name
    hub_dir.mkdir(parents=True)
    job = start_job(run_dir, epochs=40, step_delay=0.05)
    env = {**settings(), "RANKWATCH_REDIS_KEY": KEY}
    agent = start_agent(run_dir, redis_server.url, tmp_path / "agent.log", env=env)
    server = start_server(
        hub_dir,
        tmp_path / "dashboard.log",
        env={
            **env,
            "RANKWATCH_REDIS_URL": redis_server.url,
            "RANKWATCH_AGENTS": "1",
            "RANKWATCH_AGENT_LOST_S": "3",
            "RANKWATCH_TOKEN": TOKEN,
        },
    )
    return hub_dir, job, agent, server


def healthy(server, min_step: int = 0):
    v = api(server)
    rows = v["ranks"]
    ok = len(rows) == 2 and all(r["health"] == "healthy" and (r["global_step"] or 0) > min_step for r in rows)
    return v if ok else None


def test_job_through_its_agent_agent_lost_while_training_and_redis_restarted(redis_server, node):
    hub_dir, job, agent, server = node
    v = wait_for(lambda: healthy(server), "both ranks healthy from digests", timeout=240)
    assert not runfiles.state_dir(hub_dir).exists(), "the dashboard's directory must hold no heartbeat"
    assert v["run"]["transport"] == "agents" and [h["n"] for h in v["hosts"]] == [2], v["run"]
    assert [r["rank"] for r in v["ranks"]] == [0, 1] and all(r["pid"] for r in v["ranks"])

    agent.kill()
    step = max(h["global_step"] for h in job.heartbeats())
    lost = wait_for(
        lambda: (v := api(server)) and all(r["health"] == "agent_lost" for r in v["ranks"]) and v,
        "both ranks agent lost",
    )
    assert lost["hosts"][0]["status"] == "agent_lost", dump(lost["hosts"])
    # Only the agent is gone: the job trains on.
    job.wait_until(lambda hbs: all(h and h["global_step"] > step + 20 for h in hbs), "training on")
    agent.start()
    step = max(h["global_step"] for h in job.heartbeats())
    wait_for(lambda: healthy(server, step), "the agent back, the rows moving again", timeout=120)

    redis_server.stop()
    step = max(h["global_step"] for h in job.heartbeats())
    down = wait_for(
        lambda: "Redis is unreachable" in (v := api(server))["run"]["message"] and v, "Redis down"
    )
    assert all(r["health"] == "healthy" for r in down["ranks"]), dump(down["ranks"])
    job.wait_until(lambda hbs: all(h and h["global_step"] > step + 20 for h in hbs), "training on")
    assert agent.alive(), agent.log()
    redis_server.start()
    step = max(h["global_step"] for h in job.heartbeats())
    back = wait_for(lambda: healthy(server, step), "rows moving again after Redis returned", timeout=120)
    assert "unreachable" not in back["run"]["message"] and back["hosts"][0]["status"] == "reporting"


def test_a_stop_from_the_dashboard_reaches_the_job_through_its_agent(run_dir, node):
    hub_dir, job, agent, server = node
    wait_for(lambda: healthy(server, 5), "both ranks healthy from digests", timeout=240)
    req = urllib.request.Request(
        server.url + "/api/exit",
        data=json.dumps({"reason": "stop through the agent", "who": "tester"}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **AUTH},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 202
        rid = json.loads(r.read())["request_id"]
    # The only way the flag reaches the job's directory is the agent.
    assert job.wait() == 0, job.logs() + agent.log()
    stop_step, stops = job.stopped_together()
    assert {s["request_id"] for s in stops} == {rid}
    view = wait_for(
        lambda: (v := api(server)) and all(r["stop_stage"] == "exited" for r in v["ranks"]) and v,
        "both ranks' stop stage exited at the dashboard",
    )
    assert all(r["state"] == "exited" for r in view["ranks"]), dump(view["ranks"])
    assert view["hosts"][0]["stop_stages"] == {"exited": 2}
    status = wait_for(
        lambda: (s := api(server, "/api/exit"))["state"] in ("completed", "rearmed") and s["summary"] and s,
        "the stop completed at the dashboard",
    )
    assert status["summary"].startswith("all 2 ranks stopped after step"), dump(status)
    # Re-armed after completion (AUTO_REARM): the cleared flag reaches the job's directory too.
    wait_for(
        lambda: (f := runfiles.read_flag(run_dir)) is not None and not f.exit,
        "the re-armed flag on the node",
    )
