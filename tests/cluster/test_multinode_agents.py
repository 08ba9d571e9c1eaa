"""A real two-node job with no shared directory, seen through one agent per node (issue 20).

Each namespaced node (``tests/helpers/netns.py``) keeps its run directory on
a path of its own (``node0/job``, ``node1/job``: the same base name, as on
two machines' local disks) and runs a real ``rankwatch agent`` on it with
the node's network and host name. Redis runs in node 0, on the address node
1 reaches and on the uplink the test reaches; the dashboard runs on a third,
empty directory of the same base name. So the rows, the stop flag (each
agent writes its own node's copy) and the stop stages all cross the veth
through Redis: no file is shared.
"""

from __future__ import annotations

import pytest

from tests.cluster.test_multinode import LAUNCH_TIMEOUT_S, WORLD, launch, launcher_logs, steps_logged
from tests.helpers.agents import AgentProcess
from tests.helpers.faults import Dashboard, poll_until
from tests.helpers.jobs import dump
from tests.helpers.netns import TwoNodes, skip_reason
from tests.helpers.redisserver import RedisServer
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.netns]

RUN = "job"
AGENT_LOST_S = 5.0


@pytest.fixture
def nodes():
    why = skip_reason()
    if why:
        pytest.skip(why)
    with TwoNodes(uplink=True) as nodes:
        yield nodes


def node_of(rank: int) -> int:
    return rank // (WORLD // 2)


def test_two_nodes_with_local_run_dirs_through_one_agent_each(nodes, tmp_path):
    node0, node1 = nodes.nodes
    run_dirs = [tmp_path / f"node{n}" / RUN for n in range(2)]
    hub_dir = tmp_path / "hub" / RUN
    for d in (*run_dirs, hub_dir):
        d.mkdir(parents=True)

    def beat(rank: int) -> dict:
        return runfiles.read_json_or_none(runfiles.heartbeat_path(run_dirs[node_of(rank)], rank)) or {}

    redis = RedisServer(
        tmp_path, bind=(nodes.uplink_addr, node0.addr), prefix=["ip", "netns", "exec", node0.netns]
    )
    agents = [
        AgentProcess(
            run_dirs[n],
            f"redis://{node0.addr}:{redis.port}/0",
            tmp_path / f"agent{n}.log",
            run=RUN,
            prefix=node.prefix(),
        )
        for n, node in enumerate(nodes.nodes)
    ]
    dash = None
    try:
        redis.start()
        for agent in agents:
            agent.start()
        dash = Dashboard(
            hub_dir,
            tmp_path / "dashboard.log",
            prefix=node0.hostname_prefix(),
            REDIS_URL=redis.url,
            RUN=RUN,
            AGENT_LOST_S=AGENT_LOST_S,
        )
        launchers = launch(nodes, run_dirs, tmp_path, "job")

        # --- every rank live, each node's through its own agent ---------------------------
        view = dash.wait(
            lambda v: (
                v
                if len(v["ranks"]) == WORLD
                and all(r["health"] == "healthy" and (r["global_step"] or 0) >= 3 for r in v["ranks"])
                else None
            ),
            "4 healthy ranks from the two agents",
            timeout=LAUNCH_TIMEOUT_S,
        )
        hosts = [node0.hostname] * 2 + [node1.hostname] * 2
        assert [(r["rank"], r["host"]) for r in view["ranks"]] == list(enumerate(hosts)), dump(view["ranks"])
        assert view["run"]["transport"] == "agents", dump(view["run"])
        assert sorted((h["host"], h["n"]) for h in view["hosts"]) == [
            (node0.hostname, 2),
            (node1.hostname, 2),
        ]
        assert not runfiles.state_dir(hub_dir).exists(), "the dashboard's directory must hold no heartbeat"
        assert not runfiles.heartbeat_path(run_dirs[0], 2).exists(), "node 0 must not see node 1's files"

        # --- node 1's agent killed: its ranks are `agent lost`, node 0's stay healthy -----
        agents[1].kill()
        rows = dash.wait_rows(
            lambda rows: rows if rows[2]["health"] == rows[3]["health"] == "agent_lost" else None,
            "node 1's ranks shown as agent lost",
            timeout=AGENT_LOST_S + 60,
        )
        assert rows[0]["health"] == rows[1]["health"] == "healthy", dump(rows)
        step = max(beat(r).get("global_step") or 0 for r in (2, 3))
        poll_until(
            lambda: all((beat(r).get("global_step") or 0) > step + 5 for r in (2, 3)),
            "node 1's ranks training on without their agent",
        )
        agents[1].start()
        step = max(beat(r).get("global_step") or 0 for r in (2, 3))
        dash.wait_rows(
            lambda rows: (
                all(r["health"] == "healthy" for r in rows.values())
                and all((rows[r]["global_step"] or 0) > step for r in (2, 3))
            ),
            "node 1's agent back, its rows moving again",
        )

        # --- a stop from the dashboard reaches both nodes' own directories --------------
        status, body = dash.post("/api/exit", {"reason": "two nodes, no shared directory"})
        assert status == 202, body
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in launchers]
        assert codes == [0, 0], launcher_logs(tmp_path)
        rid = body["request_id"]
        for n, agent in enumerate(agents):
            # The only way the flag reaches a node's directory is its agent.
            assert f"(GracefulExit 1, request {rid}) in {run_dirs[n]}" in agent.log(), agent.log()
        beats = [beat(r) for r in range(WORLD)]
        assert all(b.get("state") == "exited" for b in beats), dump(beats)
        assert {b["stop"]["request_id"] for b in beats} == {rid}, dump(beats)
        stop_steps = {b["stop"]["stop_step"] for b in beats}
        assert len(stop_steps) == 1, stop_steps
        for rank, b in enumerate(beats):
            own, other = run_dirs[node_of(rank)], run_dirs[1 - node_of(rank)]
            assert steps_logged(own, rank)[-1] in stop_steps
            assert (own / b["stop"]["checkpoint"]["path"]).is_file()
            assert not (other / b["stop"]["checkpoint"]["path"]).exists()
        dash.wait_rows(
            lambda rows: all(r["stop_stage"] == "exited" for r in rows.values()),
            "every rank's stop stage back at the dashboard",
        )
    finally:
        if dash is not None:
            dash.stop()
        for agent in agents:
            agent.stop()
        redis.stop()
