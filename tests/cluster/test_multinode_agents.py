"""A real two-node job with no shared directory, seen through one agent per node (issue 20).

Each namespaced node (``tests/helpers/netns.py``) keeps its run directory on
a path of its own (``node0/job``, ``node1/job``: the same base name, as on
two machines' local disks) and runs a real ``rankwatch agent`` on it with
the node's network and host name. Redis runs in node 0, on the address node
1 reaches and on the uplink the test reaches; the dashboard runs on a third,
empty directory of the same base name. So the rows, the stop flag (each
agent writes its own node's copy) and the stop stages all cross the veth
through Redis: no file is shared.

One job tells the whole story: every rank live; node 1's agent killed
(``agent lost``) and back; a stop from the dashboard, each rank's
checkpoint on its own node's disk, and the checkpoint browser listing that
set across both nodes, complete only while every rank's file is on its
node; a relaunch that resumes from that set
on every rank; node 1's launcher and workers killed while its agent
reports them (``dead``), then its agent too (``node lost``).
"""

from __future__ import annotations

import pytest

from tests.helpers.agents import AgentProcess
from tests.helpers.faults import Dashboard, poll_until
from tests.helpers.jobs import dump
from tests.helpers.netns import (
    LAUNCH_TIMEOUT_S,
    WORLD,
    kill_tree,
    launch,
    launcher_logs,
    steps_logged,
)
from tests.helpers.redisserver import RedisServer
from trainer_bridge.rundir import ckptindex, ckptpaths, runfiles
from trainer_bridge.rundir.attempts import resumed_text

pytestmark = [pytest.mark.msrun, pytest.mark.netns]

RUN = "job"
AGENT_LOST_S = 5.0
DEAD_AFTER_S = 30.0  # the default: node 1's agent finds its ranks dead sooner, by its process check


@pytest.fixture
def nodes(uplinked_nodes):
    return uplinked_nodes


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
        # The stop's checkpoint set, as each node's own disk holds it: its ranks' files, none of the other's.
        (stop_step,) = stop_steps
        stop_sets = [ckptindex.scan(d, world_size=WORLD).sets[0] for d in run_dirs]
        for n, cset in enumerate(stop_sets):
            assert (cset.origin, cset.global_step) == (ckptpaths.ORIGIN_BRIDGE, stop_step), cset
            assert cset.ranks_present == tuple(r for r in range(WORLD) if node_of(r) == n), cset
            assert cset.ranks_missing == tuple(r for r in range(WORLD) if node_of(r) != n), cset
        assert stop_sets[0].id == stop_sets[1].id

        # --- the checkpoint browser, through the agents: one set across both nodes' disks --
        def browsed(complete: bool):
            sets = {c["id"]: c for c in dash.get("/api/checkpoints")["sets"]}
            cset = sets.get(stop_sets[0].id)
            return cset if cset is not None and cset["complete"] is complete else None

        cset = poll_until(lambda: browsed(True), "the stop's set complete across both nodes", timeout=60)
        assert {f["rank"]: f.get("host") for f in cset["files"]} == {
            r: nodes.nodes[node_of(r)].hostname for r in range(WORLD)
        }, dump(cset)
        # Complete only while every rank's file is on its node: rank 3's set aside, then back.
        own3 = run_dirs[node_of(3)] / beats[3]["stop"]["checkpoint"]["path"]
        aside = own3.with_name(own3.name + ".aside")
        own3.rename(aside)
        cset = poll_until(lambda: browsed(False), "the set incomplete without rank 3's file", timeout=60)
        assert cset["ranks_missing"] == [3], dump(cset)
        aside.rename(own3)
        poll_until(lambda: browsed(True), "the set complete again", timeout=60)

        # --- the relaunch: every rank agrees on the set, each loading its own node's file --
        launchers = launch(nodes, run_dirs, tmp_path, "second")
        resumed = resumed_text(stop_step, stop_sets[0].id)
        dash.wait_rows(
            lambda rows: all(
                r["state"] == "training"
                and r["resumed_from"] == resumed
                and (r["global_step"] or 0) > stop_step + 3
                for r in rows.values()
            ),
            f"every rank {resumed} and training on, through its agent",
            timeout=LAUNCH_TIMEOUT_S,
        )
        for rank in range(WORLD):
            assert beat(rank)["resumed_from"]["global_step"] == stop_step, dump(beat(rank))
            assert steps_logged(run_dirs[node_of(rank)], rank)[0] == stop_step + 1

        # --- node 1's launcher and workers killed, its agent up: it reports them dead ------
        kill_tree(launchers[1])
        rows = dash.wait_rows(
            lambda rows: rows if rows[2]["health"] == rows[3]["health"] == "dead" else None,
            "node 1's agent reporting its ranks dead",
            timeout=DEAD_AFTER_S + 60,
        )
        view = dash.get("/api/ranks")
        assert {h["host"]: h["status"] for h in view["hosts"]}[node1.hostname] == "reporting", dump(
            view["hosts"]
        )
        # The collective broke: node 0's ranks stop stepping, and the page says so.
        dash.wait_rows(
            lambda rows: rows[0]["health"] != "healthy" and rows[1]["health"] != "healthy",
            "node 0's ranks no longer shown healthy",
        )

        # --- then the rest of the node (its agent) goes too: node lost, not agent lost -----
        agents[1].kill()
        rows = dash.wait_rows(
            lambda rows: rows if rows[2]["health"] == rows[3]["health"] == "node_lost" else None,
            "node 1's ranks shown as a lost node",
            timeout=AGENT_LOST_S + 60,
        )
        assert all(node1.hostname in rows[r]["reason"] for r in (2, 3)), dump(rows)
    finally:
        if dash is not None:
            dash.stop()
        for agent in agents:
            agent.stop()
        redis.stop()
