"""The hub asks the agents over Redis (app/agent/ask.py): full rows on demand, every node's checkpoints.

A real redis-server; agents are in-process ``Agent`` objects ticking on a
thread (``run_forever``, as ``rankwatch agent`` runs them), each on its own
run directory with the same base name and no shared directory. A node whose
agent must not answer is ticked by the test alone. Checkpoints are real
MindSpore files (``tests/helpers/checkpoints.py``). Every wait polls for an
event.
"""

from __future__ import annotations

import json
import threading
import time
import types

import pytest
import redis as redis_py

from app.agent import ask
from app.agent import digest as dg
from app.agent.runner import Agent, run_forever
from app.config import from_env
from tests.helpers.agents import KEY, RUN, SimNode, agent_key, hub_app, write_set
from tests.helpers.app import FAST_SETTINGS, operator, wait_for
from tests.helpers.checkpoints import bridge_id
from trainer_bridge.rundir import runfiles

WORLD = 4


@pytest.fixture
def make_hub(tmp_path, redis_server):
    made = []

    def make(**config):
        hub_dir = tmp_path / "hub" / RUN
        hub_dir.mkdir(parents=True, exist_ok=True)
        app = hub_app(hub_dir, redis_server.url, AGENT_LOST_S=30.0, **config)
        made.append(app)
        return app

    yield make
    for app in made:
        app.extensions["rankwatch"].state.source.hub.close()


@pytest.fixture
def agent_of(redis_server):
    """An in-process agent for a node; ``run=True`` ticks it on a thread until the test ends."""
    threads = []

    def start(node: SimNode, run: bool = True) -> Agent:
        agent = Agent(
            node.dir, redis_server.url, RUN, {**from_env(), **FAST_SETTINGS}, key=KEY.encode(), host=node.host
        )
        if run:
            stopping = threading.Event()
            thread = threading.Thread(target=run_forever, args=(agent, stopping), daemon=True)
            thread.start()
            threads.append((stopping, thread, agent))
        return agent

    yield start
    for stopping, thread, agent in threads:
        stopping.set()
        thread.join(30)
        agent.outbox.close()


def get(app, url: str):
    r = app.test_client().get(url, headers=operator())
    return r.status_code, r.get_json()


def hosts_reporting(app, nodes, expect_ranks: int, tick=()):
    for node in nodes:
        node.beat()
    for agent in tick:
        agent.tick(time.time())
    state = app.extensions["rankwatch"].state
    state.scan(time.time())
    return len(state.source.hub.rows) == expect_ranks and all(
        r["health"] == "healthy" for r in state.source.hub.rows.values()
    )


def two_nodes(tmp_path, hub, agent_of, run_b: bool = True):
    a = SimNode(tmp_path, "node-a", range(0, 2), WORLD)
    b = SimNode(tmp_path, "node-b", range(2, 4), WORLD)
    agent_of(a)
    agent_b = agent_of(b, run=run_b)
    # Not running: ticked here only, so it publishes digests, and answers nothing while the hub waits.
    tick = () if run_b else (agent_b,)
    wait_for(lambda: hosts_reporting(hub, [a, b], WORLD, tick), "4 healthy ranks from two nodes", timeout=120)
    return a, b, agent_b


def test_a_rank_full_row_and_history_come_from_its_node_agent(tmp_path, make_hub, agent_of):
    hub = make_hub()
    a, b, _ = two_nodes(tmp_path, hub, agent_of)

    def full():
        a.beat()
        b.beat()
        status, body = get(hub, "/api/ranks/3")
        assert status == 200, body
        return body if body.get("agent", {}).get("answered") and len(body["history"]) >= 3 else None

    body = wait_for(full, "rank 3's full row with three chart points from node-b's agent", timeout=120)
    assert body["agent"] == {"host": "node-b", "answered": True, "error": None}
    row = body["rank"]
    assert row["rank"] == 3 and row["host"] == "node-b" and row["health"] == "healthy"
    assert set(row) == set(dg.ROW_FIELDS) | {"heartbeat_age_s"}  # the direct path's fields
    steps = [p["global_step"] for p in body["history"]]
    assert steps == sorted(steps) and steps[-1] <= row["global_step"]
    assert set(body["history"][0]) == {"t", "global_step", "loss", "step_time_ms"}
    status, missing = get(hub, "/api/ranks/9")
    assert status == 404 and missing["status"] == 404
    # Opening a node: every row of its ranks, from its agent.
    status, node = get(hub, "/api/hosts/node-b/ranks")
    assert status == 200 and node["agent"]["answered"] is True, node
    assert [r["rank"] for r in node["ranks"]] == [2, 3] and {r["host"] for r in node["ranks"]} == {"node-b"}
    assert get(hub, "/api/hosts/node-z/ranks")[0] == 404


def test_an_agent_that_does_not_answer_gives_the_digest_row_within_the_bound(tmp_path, make_hub, agent_of):
    hub = make_hub(AGENT_ASK_TIMEOUT_S=1.0)
    a, b, agent_b = two_nodes(tmp_path, hub, agent_of, run_b=False)
    started = time.monotonic()
    status, body = get(hub, "/api/ranks/2")
    waited = time.monotonic() - started
    assert status == 200, body
    assert body["agent"]["answered"] is False and body["agent"]["host"] == "node-b"
    assert "did not answer within 1 s" in body["agent"]["error"]
    assert body["rank"]["rank"] == 2 and body["rank"]["host"] == "node-b" and body["history"] == []
    # Bounded, not blocked: far under anything but the bound (a loose guard against a hang, not a timing).
    assert waited < 20, waited
    _, health = get(hub, "/api/health")
    assert health["hub"]["ask_timeouts"] == 1 and health["hub"]["refused"] == 0
    status, node = get(hub, "/api/hosts/node-b/ranks")
    assert status == 200 and node["agent"]["answered"] is False and "did not answer" in node["agent"]["error"]
    assert [r["rank"] for r in node["ranks"]] == [2, 3]  # the digests' rows
    assert get(hub, "/api/health")[1]["hub"]["ask_timeouts"] == 2
    # The agent pops the request it missed at its next tick; the hub asked no more, so nothing waits.
    agent_b.tick(time.time())
    ask_list = ask.ask_key(RUN, "node-b")
    assert redis_py.Redis.from_url(agent_b.outbox.url).llen(ask_list) == 0


def hostile_answers(url: str, stop: threading.Event, written: list) -> None:
    """Play a stranger on Redis: pop node-b's requests and answer each with garbage, one at a time."""
    client = redis_py.Redis.from_url(url)
    key = agent_key("node-b")  # node-b's own key, leaked
    while not stop.is_set():
        got = client.brpop(ask.ask_key(RUN, "node-b"), timeout=0.2)
        if got is None:
            continue
        req = json.loads(json.loads(got[1])["body"])
        rid = req["id"]

        def answer(rid=rid, **over):
            return {
                "id": rid,
                "host": "node-b",
                "kind": "rank",
                "error": None,
                "rank": None,
                "ckpt": None,
            } | over

        forged_row = {k: None for k in dg.ROW_FIELDS} | {
            "rank": 2,
            "health": "dead",
            "reason": "forged",
            "host": "node-b",
            "warnings": [],
            "source": "bridge",
        }
        hostile = [
            b"x" * (ask.MAX_ANSWER_BYTES + 1),  # too big
            b"\xff\xfe{not json",  # malformed
            dg.seal(answer(rank={"row": forged_row, "history": []}), "answer", f"node-b/{rid}", None, RUN),  # unsigned
            # signed (a leaked key) but sealed for another request: a replay
            dg.seal(answer(rank={"row": forged_row, "history": []}), "answer", f"node-b/{'0' * 32}", key, RUN),
            dg.seal(answer(rank={"row": {"rank": 2}, "history": []}), "answer", f"node-b/{rid}", key, RUN),  # bad row
            dg.seal(answer(rank={"row": forged_row | {"rank": 3}, "history": []}), "answer", f"node-b/{rid}", key, RUN),
        ]  # fmt: skip
        target = ask.answer_key(RUN, rid)
        for value in hostile:
            client.set(target, value, ex=30)
            # The hub reads and deletes each before the next goes in.
            while client.exists(target) and not stop.is_set():
                time.sleep(0.01)
            written.append(value)
        return


def test_hostile_answers_are_refused_counted_and_change_nothing(tmp_path, make_hub, agent_of, redis_server):
    hub = make_hub(AGENT_ASK_TIMEOUT_S=8.0)
    a, b, agent_b = two_nodes(tmp_path, hub, agent_of, run_b=False)
    state = hub.extensions["rankwatch"].state
    before = dict(state.source.hub.rows[2])
    stop, written = threading.Event(), []
    stranger = threading.Thread(target=hostile_answers, args=(redis_server.url, stop, written), daemon=True)
    stranger.start()
    status, body = get(hub, "/api/ranks/2")
    stop.set()
    stranger.join(30)
    assert status == 200, body
    assert len(written) == 6
    # Every one refused: the row is the digest's, with no forged verdict.
    assert body["agent"]["answered"] is False and "did not answer" in body["agent"]["error"]
    assert body["rank"]["health"] == "healthy" and body["rank"]["reason"] != "forged"
    _, health = get(hub, "/api/health")
    assert health["hub"]["refused"] == 6, health["hub"]
    assert "answer for host 'node-b'" in health["hub"]["refused_last"]
    assert state.source.hub.rows[2] == before
    # The real agent still gets through once it ticks.
    stopping = threading.Event()
    ticking = threading.Thread(target=run_forever, args=(agent_b, stopping), daemon=True)
    ticking.start()

    def answered():
        b.beat()
        return get(hub, "/api/ranks/2")[1]["agent"]["answered"]

    wait_for(answered, "node-b's agent answering", timeout=60)
    stopping.set()
    ticking.join(30)
    assert get(hub, "/api/health")[1]["hub"]["refused"] == 6


def test_the_checkpoint_browser_lists_sets_across_nodes(tmp_path, make_hub, agent_of):
    hub = make_hub(CHECKPOINT_SCAN_S=0.2)
    a, b, _ = two_nodes(tmp_path, hub, agent_of)
    write_set(a, 8, (0, 1))
    write_set(b, 8, (2, 3))  # complete: every rank's file on its own node
    write_set(a, 16, (0, 1))  # node-b saved nothing at step 16
    write_set(a, 24, (0, 1, 2))  # rank 2's file on node-a: not where rank 2 runs
    write_set(b, 24, (3,))

    def listed():
        # Both agents' listings merged: node-a's alone already names all three sets, so wait
        # for node-b's files too (rank 3's at 8 and at 24), never on how long that takes.
        status, body = get(hub, "/api/checkpoints")
        assert status == 200, body
        sets = {s["id"]: s for s in body["sets"]}
        if not {bridge_id(g) for g in (8, 16, 24)} <= set(sets):
            return None
        from_b = [any(f["rank"] == 3 for f in sets[bridge_id(g)]["files"]) for g in (8, 24)]
        return body if all(from_b) else None

    body = wait_for(listed, "three sets listed from the two agents", timeout=120)
    sets = {s["id"]: s for s in body["sets"]}
    full, half, misplaced = sets[bridge_id(8)], sets[bridge_id(16)], sets[bridge_id(24)]
    assert body["world_size"] == WORLD
    assert full["complete"] and full["ranks_present"] == [0, 1, 2, 3]
    assert {f["rank"]: f["host"] for f in full["files"]} == {
        0: "node-a",
        1: "node-a",
        2: "node-b",
        3: "node-b",
    }
    assert not half["complete"] and half["ranks_missing"] == [2, 3]
    assert not misplaced["complete"] and misplaced["ranks_missing"] == [2]
    moved = next(f for f in misplaced["files"] if f["rank"] == 2)
    assert moved["status"] == "misplaced" and "runs on host node-b" in moved["reason"]
    assert body["newest_complete"] == bridge_id(8)
    # Files on another node are named, not served: a 409 that says where they are.
    path = next(f["path"] for f in full["files"] if f["rank"] == 2)
    status, err = get(hub, f"/api/checkpoints/file?path={path}")
    assert status == 409 and "on host node-b" in err["error"], err
    r = hub.test_client().post(
        "/api/checkpoints/delete",
        json={"set": bridge_id(16), "reason": "test", "force": True},
        headers=operator(),
    )
    assert r.status_code == 409 and "on host node-a" in r.get_json()["error"], r.get_json()
    assert all(runfiles.checkpoint_path(a.dir, rank, 1, 16).exists() for rank in (0, 1))


def test_garbage_requests_never_cost_an_agent_its_digests(tmp_path, redis_server):
    node = SimNode(tmp_path, "node-a", range(2), 2)
    node.beat()
    agent = Agent(
        node.dir, redis_server.url, RUN, {**from_env(), **FAST_SETTINGS}, key=KEY.encode(), host="node-a"
    )
    client = redis_py.Redis.from_url(redis_server.url)
    stream, asks = dg.keys(RUN)[0], ask.ask_key(RUN, "node-a")
    req = {"id": "a" * 32, "kind": "rank", "rank": 0, "time": time.time()}
    client.lpush(
        asks,
        b"x" * (ask.MAX_REQUEST_BYTES + 1),  # too big
        b"not json",
        dg.seal(req, "ask", "node-a", None, RUN),  # unsigned
        dg.seal(req, "ask", "node-b", agent_key("node-b"), RUN),  # signed for another host
        dg.seal(req | {"kind": "shell"}, "ask", "node-a", agent_key("node-a"), RUN),  # no such request
    )
    agent.tick(time.time())
    assert agent.asks_refused == 5 and agent.outbox.error is None
    assert client.keys(ask.answer_key(RUN, "*")) == [] and client.xlen(stream) == 1
    # A key of another type where the requests go: the digest still goes out.
    client.delete(asks)
    client.set(asks, b"junk")
    agent.tick(time.time())
    assert agent.outbox.error is None and client.xlen(stream) == 2
    # And a real request is answered, signed, with the rank's row.
    client.delete(asks)
    client.lpush(asks, dg.seal(req, "ask", "node-a", agent_key("node-a"), RUN))
    node.beat()
    agent.tick(time.time())
    value = client.get(ask.answer_key(RUN, req["id"]))
    hub = types.SimpleNamespace(agent_key=agent_key, run=RUN)
    data = ask.check(value, hub, "node-a", req["id"], ("rank", 0))
    assert data["row"]["rank"] == 0 and data["row"]["host"] == "node-a" and data["history"]
    agent.outbox.close()


def test_the_watchers_tick_never_waits_behind_a_request_waiting_for_an_agent(tmp_path):
    """A request's scan may wait for a node's first listing; the tick meanwhile takes the last index."""
    import threading

    from app.audit import AuditLog
    from app.checkpoints.service import CheckpointService
    from app.checkpoints.verify import Verifier

    run_dir = tmp_path / "hub" / RUN
    run_dir.mkdir(parents=True)
    service = CheckpointService(
        str(run_dir), AuditLog(tmp_path / "audit.sqlite3"), scan_s=0.0, verifier=Verifier(None, None)
    )
    entered, release = threading.Event(), threading.Event()

    def remote(wait: bool):
        if wait:  # a request: its first listing of a node takes a while
            entered.set()
            release.wait(60)
        return [], []

    service.remote = remote
    first = service.index(4, wait=False)
    request = threading.Thread(target=service.index, args=(4,))
    request.start()
    try:
        assert entered.wait(60), "the request's scan did not start"
        assert service.index(4, wait=False) is first  # not blocked on the request's lock
    finally:
        release.set()
        request.join(60)
    assert service.index(4, wait=False) is not first  # once free, the tick scans again (scan_s 0)
