"""``rankwatch agent`` and the hub, with a real redis-server and real agent processes.

The heartbeat files are written in the bridge's exact format by the test
(``tests/helpers/heartbeats.py``), one run directory per simulated node, each at
its own local path with the same base name, as on nodes without a shared
filesystem. The hub is the dashboard's app (``hub_app``) on a run
directory of that base name that holds no heartbeat at all, scanned by the
test. Jobs under msrun are in ``tests/cluster/test_agent_msrun.py``. Every wait
polls for an event; nothing asserts a duration.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
import redis as redis_py

from app.agent import digest as dg
from app.agent.runner import Agent
from app.config import from_env
from tests.helpers.agents import KEY, RUN, AgentProcess, SimNode, hub_app, ranks_healthy, view
from tests.helpers.app import make_app, wait_for
from tests.helpers.heartbeats import heartbeat, write_heartbeat
from trainer_bridge.rundir import runfiles


@pytest.fixture
def hub(tmp_path, redis_server):
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = hub_app(hub_dir, redis_server.url, AGENT_LOST_S=3.0)
    app.hub_dir = hub_dir
    yield app
    app.extensions["rankwatch"].state.source.hub.close()


def test_two_nodes_without_a_shared_directory_show_every_rank_from_digests(tmp_path, hub, agents):
    a = SimNode(tmp_path, "node-a", range(0, 4), 8)
    b = SimNode(tmp_path, "node-b", range(4, 8), 8)
    agents(a)
    agents(b)
    v = wait_for(lambda: ranks_healthy(hub, [a, b], 8), "8 healthy ranks from two agents", timeout=120)
    assert not runfiles.state_dir(hub.hub_dir).exists()  # nothing read from the hub's own directory
    assert [r["rank"] for r in v["ranks"]] == list(range(8))
    assert {r["host"] for r in v["ranks"][:4]} == {"node-a"} and {r["host"] for r in v["ranks"][4:]} == {
        "node-b"
    }
    # The same fields as a dashboard reading the files itself.
    assert set(v["ranks"][0]) == set(dg.ROW_FIELDS) | {"heartbeat_age_s"}
    assert v["run"]["transport"] == "agents" and v["run"]["hosts"] == 2 and v["run"]["refused"] == 0
    assert v["summary"]["counts"]["healthy"] == 8 and v["world_size"] == 8
    hosts = {h["host"]: h for h in v["hosts"]}
    assert hosts["node-a"]["ranks"] == [0, 3] and hosts["node-b"]["ranks"] == [4, 7]
    assert hosts["node-a"]["status"] == "reporting" and hosts["node-a"]["counts"] == {"healthy": 4}

    # A verdict judged on the node reaches the hub: rank 5 reports it failed.
    def failed():
        a.beat()
        b.seq += 1
        for r in b.ranks:
            write_heartbeat(
                b.dir,
                heartbeat(
                    r, 8, seq=b.seq, host="node-b", **({"state": "failed", "error": "boom"} if r == 5 else {})
                ),
            )
        rows = view(hub)["ranks"]
        return rows if rows[5]["health"] == "failed" else None

    rows = wait_for(failed, "rank 5 failed at the hub", timeout=60)
    assert rows[5]["state"] == "failed" and [r["health"] for r in rows[:5]] == ["healthy"] * 5


def test_hostile_digests_are_refused_counted_and_change_nothing(tmp_path, hub, agents, redis_server):
    a = SimNode(tmp_path, "node-a", range(0, 2), 2)
    agents(a)
    wait_for(lambda: ranks_healthy(hub, [a], 2), "2 healthy ranks", timeout=120)
    client = redis_py.Redis.from_url(redis_server.url)
    stream = dg.keys(RUN)[0]
    # Taken now: the hub has accepted it, so adding it again is a replay.
    replay = client.xrevrange(stream, count=1)[0][1]
    state = hub.extensions["rankwatch"].state
    before = {r: dict(row) for r, row in state.source.hub.rows.items()}
    seq = state.source.hub.hosts["node-a"].digest["seq"]
    key = KEY.encode()

    def good(**over) -> dict:
        d = {
            "v": 1, "run": RUN, "host": "node-a", "agent": "x", "boot": time.time() + 1000, "seq": 1,
            "time": time.time(), "attempt": None, "world_size": 2, "ranks": [0, 1], "n": 2,
            "counts": {"dead": 2}, "global_step": None, "step_time_ms": None, "slowest": None,
            "stalest": None, "last_step_at": None, "samples_per_s": None, "stop_stages": {}, "rows": [],
        }  # fmt: skip
        return {**d, **over}

    dead_row = {**state.source.hub.rows[0], "health": "dead", "reason": "forged"}
    hostile = [
        # too big
        {"h": b"node-a", "d": b"{" + b" " * (dg.MAX_DIGEST_BYTES + 10) + b"}"},
        # malformed: not JSON, then a field of the wrong type, then an unknown field
        {"h": b"node-a", "d": b"\xff\xfenot json"},
        dg.encode(good(seq="7"), key),
        dg.encode(good(extra=1), key),
        # unsigned and badly signed
        {"h": b"node-a", "d": dg.encode(good(), key)["d"]},
        {**dg.encode(good(), key), "s": b"0" * 64},
        # signed (a leaked key), but claiming node-a's rank 0 from node-b
        dg.encode(good(host="node-b", ranks=[0, 1], rows=[{"row": {**dead_row, "host": "node-b"}}]), key),
        # a row outside the digest's own ranks
        dg.encode(good(ranks=[5, 6], rows=[{"row": dead_row}]), key),
        # a replay of a digest the hub accepted
        replay,
    ]
    for fields in hostile:
        client.xadd(stream, fields)
    v = wait_for(
        lambda: (v := view(hub))["run"]["refused"] >= len(hostile) and v,
        "every hostile digest refused",
        timeout=60,
    )
    assert v["run"]["refused"] == len(hostile), v["run"]
    health = hub.test_client().get("/api/health").get_json()["hub"]
    assert health["refused"] == len(hostile) and health["accepted"] > 0 and health["hosts"] == 1, health
    assert "refused" in v["run"]["message"]
    assert [h["host"] for h in v["hosts"]] == ["node-a"]
    # Nothing else changed: the rows are the agent's, no forged verdict, and its next digest is taken.
    assert (
        all(r["health"] == "healthy" for r in v["ranks"])
        and state.source.hub.hosts["node-a"].digest["seq"] >= seq
    )
    assert {r: row["pid"] for r, row in state.source.hub.rows.items()} == {
        r: row["pid"] for r, row in before.items()
    }

    def heard_again():
        a.beat()
        v = view(hub)
        return v if state.source.hub.hosts["node-a"].digest["seq"] > seq + 1 else None

    later = wait_for(heard_again, "the agent heard again")
    assert later["run"]["refused"] == len(hostile)


def two_healthy_nodes(tmp_path, hub, agents) -> tuple[SimNode, SimNode, AgentProcess]:
    """node-a (ranks 0-1) and node-b (ranks 2-3), each with its agent, all 4 ranks healthy at the hub."""
    a = SimNode(tmp_path, "node-a", range(0, 2), 4)
    b = SimNode(tmp_path, "node-b", range(2, 4), 4)
    agents(a)
    agent_b = agents(b)
    wait_for(lambda: ranks_healthy(hub, [a, b], 4), "4 healthy ranks", timeout=120)
    return a, b, agent_b


def test_agent_killed_is_agent_lost_then_back(tmp_path, hub, agents):
    a, b, agent_b = two_healthy_nodes(tmp_path, hub, agents)
    agent_b.kill()

    def lost():
        a.beat()
        b.beat()  # node-b's ranks go on: only its agent is gone
        v = view(hub)
        return (
            v
            if [r["health"] for r in v["ranks"]] == ["healthy", "healthy", "agent_lost", "agent_lost"]
            else None
        )

    v = wait_for(lost, "node-b's ranks agent lost", timeout=60)
    assert (
        "agent on host node-b" in v["ranks"][2]["reason"] and "last known: healthy" in v["ranks"][2]["reason"]
    )

    def known_training():
        v = lost()
        return v if v and "they are training; only the agent is gone" in v["ranks"][2]["reason"] else None

    # node-a's ranks keep stepping, which they could not without node-b's: node-b's ranks train.
    v = wait_for(known_training, "node-a's progress shows node-b's ranks training", timeout=60)
    assert v["summary"]["counts"]["agent_lost"] == 2 and v["run"]["agents_lost"] == 1
    assert {h["host"]: h["status"] for h in v["hosts"]} == {"node-a": "reporting", "node-b": "agent_lost"}
    agents(b)
    v = wait_for(lambda: ranks_healthy(hub, [a, b], 4), "node-b back", timeout=120)
    assert v["run"]["agents_lost"] == 0


def test_a_node_gone_with_its_agent_while_the_others_stall_is_node_lost(tmp_path, hub, agents):
    a, b, agent_b = two_healthy_nodes(tmp_path, hub, agents)
    # node-b goes away whole: its agent and its ranks. node-a's ranks, blocked in the step's
    # collective, keep writing heartbeats but step no more.
    agent_b.kill()
    frozen_step, frozen_at = a.seq * 20, time.time()

    def node_lost():
        a.beat(global_step=frozen_step, last_step_at=frozen_at)
        v = view(hub)
        healths = [r["health"] for r in v["ranks"]]
        return v if healths == ["stalled", "stalled", "node_lost", "node_lost"] else None

    v = wait_for(node_lost, "node-b node lost, node-a's ranks stalled", timeout=90)
    assert "host node-b" in v["ranks"][2]["reason"] and "node is likely gone" in v["ranks"][2]["reason"]
    assert v["summary"]["counts"]["node_lost"] == 2
    assert {h["host"]: h["status"] for h in v["hosts"]} == {"node-a": "reporting", "node-b": "agent_lost"}
    # The node comes back (a relaunch): its agent's first digest ends the judgement.
    agents(b)
    wait_for(lambda: ranks_healthy(hub, [a, b], 4), "node-b back", timeout=120)


def test_the_hubs_slowest_rank_is_the_boards(tmp_path, hub, agents):
    """The tile through agents and the tile of a dashboard reading the same files: one rule (app/run/peers.py)."""
    a = SimNode(tmp_path, "node-a", range(0, 4), 8)
    b = SimNode(tmp_path, "node-b", range(4, 8), 8)
    agents(a)
    agents(b)
    step_ms = {r: 50.0 + r for r in range(8)} | {5: 200.0}  # rank 5 a straggler; no two alike

    def beat():
        for node in (a, b):
            node.seq += 1
            for r in node.ranks:
                # 20 steps a beat, whatever the step time: every rank warms up alike.
                hb = heartbeat(r, 8, seq=node.seq, host=node.host, step_ms=step_ms[r], steps=20)
                write_heartbeat(node.dir, hb)
        v = view(hub)
        s = v["summary"]["slowest"]
        return v if s and s["straggler"] and len(v["ranks"]) == 8 else None

    v = wait_for(beat, "rank 5 the slowest at the hub", timeout=120)
    at_hub = v["summary"]["slowest"]
    assert at_hub["rank"] == 5 and at_hub["step_time_ms"] == 200.0
    # The same heartbeats read by a dashboard of its own, without agents.
    here = tmp_path / "files" / RUN
    for node in (a, b):
        for r in node.ranks:
            src = runfiles.heartbeat_path(node.dir, r)
            dst = runfiles.heartbeat_path(here, r)
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    board = view(make_app(here))["summary"]["slowest"]
    assert board == at_hub, (board, at_hub)
    assert at_hub["median_ms"] == 53.0  # the others' median: of 50..54, 56 and 57


def test_redis_killed_and_restarted_the_agent_buffers_and_everything_recovers(
    tmp_path, hub, agents, redis_server
):
    a = SimNode(tmp_path, "node-a", range(0, 2), 2)
    agent = agents(a)
    wait_for(lambda: ranks_healthy(hub, [a], 2), "2 healthy ranks", timeout=120)
    state = hub.extensions["rankwatch"].state
    redis_server.stop()
    down_at = time.time()
    seq = state.source.hub.hosts["node-a"].digest["seq"]
    v = wait_for(
        lambda: (a.beat(), v := view(hub))[0] is None and "unreachable" in v["run"]["message"] and v,
        "Redis down",
    )
    assert all(r["health"] == "healthy" for r in v["ranks"])  # as last heard; nobody judged lost
    wait_for(lambda: "unreachable" in agent.log(), "the agent saying Redis is unreachable")
    # The digest whose sending failed (the agent's words above) waits in the agent's buffer.
    redis_server.start()
    up_at = time.time()

    def recovered():
        a.beat()
        v = view(hub)
        back = state.source.hub.hosts["node-a"].digest["seq"] > seq + 1
        return v if back and "unreachable" not in v["run"]["message"] else None

    v = wait_for(recovered, "the hub hearing the agent again", timeout=120)
    assert agent.alive() and all(r["health"] == "healthy" for r in v["ranks"])
    # Digests made while Redis was down went out when it came back (the agent's buffer).
    entries = redis_py.Redis.from_url(redis_server.url).xrange(dg.keys(RUN)[0])
    times = [json.loads(fields[b"d"])["time"] for _, fields in entries]
    assert any(down_at < t < up_at for t in times), (down_at, up_at, times[:5])


def test_a_digest_stays_small_however_many_ranks_the_host_has(tmp_path, redis_server):
    sizes = {}
    for n in (8, 1024):
        node = SimNode(tmp_path / str(n), "node-a", range(n), n)
        node.beat()
        agent = Agent(node.dir, redis_server.url, RUN, from_env(), host="node-a")
        built = [agent.tick(time.time()) for _ in range(3)]
        assert all(len(d["rows"]) <= dg.MAX_ROWS for d in built)
        sizes[n] = max(len(dg.encode(d, None)["d"]) for d in built)
        agent.outbox.close()
    assert sizes[1024] < dg.MAX_DIGEST_BYTES / 2, sizes


def test_the_hub_flag_reaches_every_agent_run_directory(tmp_path, hub, agents):
    a = SimNode(tmp_path, "node-a", range(0, 2), 4)
    b = SimNode(tmp_path, "node-b", range(2, 4), 4)
    agents(a)
    agents(b)
    wait_for(lambda: ranks_healthy(hub, [a, b], 4), "4 healthy ranks", timeout=120)
    r = hub.test_client().post(
        "/api/exit",
        json={"reason": "through the agents", "who": "tester"},
        headers={"Authorization": f"Bearer {hub.config['TOKEN']}"},
    )
    assert r.status_code == 202, r.get_data(as_text=True)
    written = runfiles.read_flag(hub.hub_dir)
    assert written.exit

    def everywhere():
        view(hub)
        flags = [runfiles.read_flag(n.dir) for n in (a, b)]
        return flags if all(f is not None and f.raw == written.raw for f in flags) else None

    flags = wait_for(everywhere, "the flag in both nodes' run directories", timeout=60)
    assert flags[0].request_id == written.request_id and flags[0].exit


def test_hubs_of_their_own_each_read_every_digest_hubs_of_one_group_split_them(tmp_path, redis_server):
    from app.agent.hub import Hub

    node = SimNode(tmp_path, "node-a", range(0, 2), 2)
    node.beat()
    agent = Agent(node.dir, redis_server.url, RUN, from_env(), host="node-a")
    own = [Hub(redis_server.url, RUN, None, 30.0) for _ in range(2)]
    shared = [Hub(redis_server.url, RUN, None, 30.0, group="hubs") for _ in range(2)]
    hubs = own + shared
    try:
        for hub in hubs:
            hub.poll(time.time())  # each joins (its group starts at the stream's end)
        for _ in range(3):
            agent.tick(time.time())
            for hub in hubs:
                hub.poll(time.time())
        # Each own group gets every digest; the shared group's first reader takes them all.
        assert [hub.accepted for hub in hubs] == [3, 3, 3, 0]
        agent.tick(time.time())
        shared[1].poll(time.time())
        shared[0].poll(time.time())
        assert [hub.accepted for hub in shared] == [3, 1]
        assert sorted(own[0].rows) == sorted(own[1].rows) == [0, 1]
    finally:
        for hub in hubs:
            hub.close()
        agent.outbox.close()
    # A hub's own group goes with it; the shared one stays for the others.
    groups = redis_py.Redis.from_url(redis_server.url).xinfo_groups(dg.keys(RUN)[0])
    assert [g["name"] for g in groups] == [b"hubs"]


def test_hubs_of_one_group_each_see_every_change_the_others_read(tmp_path, redis_server):
    """An agent sends a changed row once; the process that reads it forwards it to the others."""
    from app.agent.hub import Hub

    node = SimNode(tmp_path, "node-a", range(0, 2), 2)
    node.beat()
    agent = Agent(node.dir, redis_server.url, RUN, from_env(), key=KEY.encode(), host="node-a")
    hubs = [Hub(redis_server.url, RUN, KEY.encode(), 30.0, group="hubs") for _ in range(2)]
    try:
        for hub in hubs:
            hub.poll(time.time())
        agent.tick(time.time())  # every row is new: a change
        hubs[0].poll(time.time())  # the first reader takes the digest and forwards it
        hubs[1].poll(time.time())
        assert [h.accepted for h in hubs] == [1, 0] and hubs[1].forwarded == 1
        assert sorted(hubs[1].rows) == [0, 1] and hubs[1].hosts["node-a"].digest["seq"] == 1
        # Only rank 1's state changes; the digest that carries it is read by the second process.
        node.seq += 1
        write_heartbeat(node.dir, heartbeat(1, 2, seq=node.seq, host="node-a", state="stopping"))
        agent.tick(time.time())
        hubs[1].poll(time.time())
        hubs[0].poll(time.time())
        assert [h.rows[1]["state"] for h in hubs] == ["stopping", "stopping"]
        assert hubs[0].forwarded == 1
        # A routine digest (rolling resync only) is not forwarded: each process takes its share.
        before = redis_py.Redis.from_url(redis_server.url).xlen(dg.peers_key(RUN))
        agent.tick(time.time())
        for hub in hubs:
            hub.poll(time.time())
        assert redis_py.Redis.from_url(redis_server.url).xlen(dg.peers_key(RUN)) == before
        # A forward replayed later, or forged, changes nothing and the forgery is counted.
        client = redis_py.Redis.from_url(redis_server.url)
        first = client.xrange(dg.peers_key(RUN), count=1)[0][1]
        client.xadd(dg.peers_key(RUN), {**first, b"c": b"someone"})
        client.xadd(dg.peers_key(RUN), {b"h": b"node-a", b"d": b"{}", b"c": b"someone"})
        refused = [h.refused for h in hubs]
        for hub in hubs:
            hub.poll(time.time())
        assert [h.rows[1]["state"] for h in hubs] == ["stopping", "stopping"]
        assert [h.refused for h in hubs] == [n + 1 for n in refused]
        assert "unsigned" in hubs[0].refused_last
    finally:
        for hub in hubs:
            hub.close()
        agent.outbox.close()


def test_a_relaunch_with_fewer_ranks_on_a_host_drops_the_others_from_the_view(tmp_path, hub, agents):
    a = SimNode(tmp_path, "node-a", range(0, 4), 4)
    agents(a)
    wait_for(lambda: ranks_healthy(hub, [a], 4), "4 healthy ranks", timeout=120)
    for r in (2, 3):
        runfiles.heartbeat_path(a.dir, r).unlink()
    a.ranks, a.world = range(0, 2), 2
    v = wait_for(lambda: ranks_healthy(hub, [a], 2), "only ranks 0 and 1 left", timeout=120)
    assert [r["rank"] for r in v["ranks"]] == [0, 1] and v["summary"]["counts"]["healthy"] == 2
    assert v["hosts"][0]["ranks"] == [0, 1] and v["world_size"] == 2
    # Those who watch get a whole snapshot: a removal is no delta.
    state = hub.extensions["rankwatch"].state
    assert state.take_delta(time.time())[0] == "ranks_snapshot"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--redis", "foo"], "Invalid value for --redis"),
        (["--redis", "redis://127.0.0.1:1/0", "--run", "no spaces/here"], "Invalid value for --run"),
    ],
)
def test_agent_refuses_a_bad_url_or_run_name_at_once(tmp_path, args, said):
    from click.testing import CliRunner

    from app.cli import main

    result = CliRunner().invoke(main, ["agent", "--run-dir", str(tmp_path / "run"), *args])
    assert result.exit_code == 2 and said in result.output, result.output


def test_ranks_without_the_bridge_reach_the_hub_from_their_worker_logs(tmp_path, hub, agents, start_process):
    """Log mode on a node: each "rank" is a real process whose stdout is its worker log, as msrun starts them."""
    node = SimNode(tmp_path, "node-a", range(0), 2)
    logs = node.dir / "msrun_logs"
    logs.mkdir()
    script = (
        "import sys, time\n"
        "for step in range(1, 100000):\n"
        "    print(f'epoch: 1 step: {step}, loss is {2.0 / step:.4f}', flush=True)\n"
        "    time.sleep(0.1)\n"
    )
    ranks = []
    for r in (0, 1):
        with open(logs / f"worker_{r}.log", "ab") as out:
            ranks.append(start_process([sys.executable, "-c", script], stdout=out))
    agents(node)

    def log_rows():
        rows = view(hub)["ranks"]
        return rows if len(rows) == 2 and all((r["step"] or 0) >= 3 for r in rows) else None

    rows = wait_for(log_rows, "two ranks from their worker logs at the hub", timeout=120)
    assert [r["source"] for r in rows] == ["log", "log"] and {r["host"] for r in rows} == {"node-a"}
    assert [r["pid"] for r in rows] == [p.pid for p in ranks]  # the agent found the writers on its host
    ranks[1].kill()
    ranks[1].wait()
    # Probed by the agent on its host: the process is gone.
    wait_for(lambda: view(hub)["ranks"][1]["health"] == "dead", "rank 1 dead at the hub", timeout=60)


def test_an_agent_lost_is_alerted(tmp_path, redis_server, agents):
    from tests.helpers.receiver import Receiver

    a = SimNode(tmp_path, "node-a", range(0, 2), 4)
    b = SimNode(tmp_path, "node-b", range(2, 4), 4)
    hub_dir = tmp_path / "alerting-hub" / RUN
    hub_dir.mkdir(parents=True)
    with Receiver() as receiver:
        app = hub_app(
            hub_dir, redis_server.url, AGENT_LOST_S=3.0, WEBHOOK_URL=receiver.url, ALERT_GROUP_S=0.5
        )
        watcher = app.extensions["rankwatch"].watcher
        try:
            agents(a)
            agent_b = agents(b)

            def tick_until(health: str, count: int):
                a.beat()
                b.beat()
                watcher.tick()
                counts = app.extensions["rankwatch"].state.summary(time.time())["summary"]["counts"]
                return counts[health] == count

            wait_for(lambda: tick_until("healthy", 4), "4 healthy ranks", timeout=120)
            agent_b.kill()
            wait_for(lambda: tick_until("agent_lost", 2), "node-b's ranks agent lost", timeout=60)
            got = receiver.wait_for(
                lambda got: [p for p in got if "agent_lost" in json.dumps(p)] or (watcher.tick() and None),
                "an alert naming agent_lost",
            )
            assert "agent on host node-b" in json.dumps(got) or "agent lost" in json.dumps(got), got
        finally:
            app.extensions["rankwatch"].incidents.alerts.sender.close()
            app.extensions["rankwatch"].state.source.hub.close()
            watcher.stop()
