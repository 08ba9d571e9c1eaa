"""Issue 32, P7: one Redis key for every role. A real redis-server, a real dashboard.

The dashboard holds the master key; each rank holds only the key
``rankwatch redis-keys`` wrote for it (a 0600 file, ``{rank}`` in
``RANKWATCH_REDIS_KEY_FILE``). Rank 0 then tries what the review did with
the one shared key:

* sign a "completed" ``stop_status`` to every page;
* sign ``close_room`` (a page froze);
* sign rank 1's heartbeat (rank 0 made rank 1 ``failed`` for good).

And an agent, holding only its host's key, tries to sign another host's
digest, answer and flag (the review: "any agent can sign digests, answers
and the hub's flag for any host").
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import redis as redis_py
from click.testing import CliRunner

from app.agent import ask
from app.agent import digest as dg
from app.agent.runner import Agent
from app.cli.rediskeys import redis_keys
from app.cluster import QueueCodec
from app.config import from_env
from app.run.state import RunState
from tests.helpers.agents import RUN, SimNode
from tests.helpers.app import AUTH, make_app
from tests.helpers.heartbeats import heartbeat, write_job
from tests.helpers.queuepage import emit, get_json, publish, until
from trainer_bridge.beatsink import BeatSink
from trainer_bridge.rundir import redisbus

MASTER = "the-dashboards-master-key-0123456789"


@pytest.fixture
def keys_dir(tmp_path, run_dir):
    """Rank 0's and rank 1's key files, as ``rankwatch redis-keys`` writes them from the master."""
    out = tmp_path / "keys"
    result = CliRunner().invoke(
        redis_keys,
        ["--out", str(out), "--ranks", "0-1", "--run-dir", str(run_dir)],
        env={"RANKWATCH_REDIS_KEY": MASTER},
    )
    assert result.exit_code == 0, result.output
    for name in ("rank_0.key", "rank_1.key"):
        mode = os.stat(out / name).st_mode
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
        assert MASTER not in (out / name).read_text()
    return out


def rank_key(keys_dir, rank: int) -> bytes:
    """What the rank holds: its handed key (``rk1:rank:<job>:<rank>:<hex>``)."""
    return redisbus.read_key_file(str(keys_dir / f"rank_{rank}.key"))


def signed_by(key: bytes, job: str, payload: dict) -> str:
    """A queue message signed the way a dashboard signs it, but with ``key``: the best a rank can do."""
    body = json.dumps(payload, separators=(",", ":"))
    at = f"{time.time():.3f}"
    sig = redisbus.signature(key, "queue", job, at, body.encode()).decode()
    return json.dumps({"rankwatch": at, "sig": sig, "body": body})


def test_a_ranks_key_signs_no_stop_status_and_no_close_room(dashboard, redis_server, run_dir, keys_dir):
    server, page = dashboard(MASTER)
    job = redisbus.job_key(run_dir)
    own = redisbus.parse_handed(rank_key(keys_dir, 0))[1]
    with pytest.raises(ValueError, match="signs only for its own"):
        QueueCodec(job, rank_key(keys_dir, 0))  # the queue's codec takes no rank's key
    completed = emit("stop_status") | {"data": [{"phase": "completed", "request_id": "forged"}]}
    close_room = {"method": "close_room", "room": None, "namespace": "/", "host_id": "rank-0"}
    for payload in (completed, close_room):
        publish(redis_server.url, job, signed_by(own, job, payload))
        publish(redis_server.url, job, signed_by(rank_key(keys_dir, 0), job, payload))  # the file's bytes
    # A dashboard's message, after the forgeries: it reaches the page, which is not frozen.
    publish(redis_server.url, job, QueueCodec(job, MASTER.encode()).dumps(emit("signed_probe")))
    until(lambda: "signed_probe" in page.names(), "the dashboard's event reaches the page")
    forged = [args for name, args in page.events if name == "stop_status" and "forged" in json.dumps(args)]
    assert forged == [], page.events
    refused = get_json(server.url + "/api/health")["redis"]["refused"]
    assert refused["queue"] == 4 and refused["queue_last"] == "a badly signed message", refused


def test_rank_0_cannot_sign_rank_1s_heartbeat(redis_server, run_dir, keys_dir, monkeypatch):
    write_job(run_dir, 2)
    job = redisbus.job_key(run_dir)
    monkeypatch.setenv(redisbus.REDIS_URL_ENV, redis_server.url)
    monkeypatch.delenv(redisbus.REDIS_KEY_ENV, raising=False)
    monkeypatch.setenv(redisbus.REDIS_KEY_FILE_ENV, str(keys_dir / "rank_{rank}.key"))
    # Each rank takes its own file from the template; the key signs for that rank only.
    sinks = [BeatSink(run_dir, r, 2) for r in (0, 1)]
    assert [s.publisher.key for s in sinks] == [rank_key(keys_dir, 0), rank_key(keys_dir, 1)]
    ranks = [s.publisher for s in sinks]
    with pytest.raises(ValueError, match="signs only for its own"):
        ranks[0].publish(1, b"{}")
    # Rank 0's file given to rank 1 (a copy, a wrong template): said, and nothing is published.
    monkeypatch.setenv(redisbus.REDIS_KEY_FILE_ENV, str(keys_dir / "rank_0.key"))
    wrong = BeatSink(run_dir, 1, 2)
    assert wrong.publisher is None and "signs only for its own" in wrong.warnings[0], wrong.warnings
    wrong.close()

    now = time.time()

    def beat(r, seq):
        assert ranks[r].publish(r, json.dumps(heartbeat(r, 2, seq=seq, now=now + seq)).encode())

    config = from_env({}) | {"REDIS_KEY": MASTER}
    subscriber = redisbus.Subscriber(redis_server.url, job, key=MASTER.encode())
    state = RunState(run_dir, config, redis=subscriber)
    beat(0, 1), beat(1, 1)
    state.scan(now + 1)
    assert [row["seq"] for row in state.snapshot(now + 1)["ranks"]] == [1, 1]

    # Rank 0 signs rank 1's "failed" heartbeat, far ahead, with the only key it holds.
    client = redis_py.Redis.from_url(redis_server.url)
    stream, latest, _ = redisbus.keys(job)
    forged = json.dumps(heartbeat(1, 2, seq=10**6, now=now + 2, state="failed")).encode()
    own = redisbus.parse_handed(rank_key(keys_dir, 0))[1]
    for key in (own, rank_key(keys_dir, 0)):
        sig = redisbus.signature(key, "hb", job, "1", forged)
        client.xadd(stream, {"r": 1, "hb": forged, "s": sig})
        client.hset(latest, mapping={"1": forged, "1:s": sig})
    beat(0, 2), beat(1, 2), beat(0, 3), beat(1, 3)
    state.scan(now + 3)
    snap = state.snapshot(now + 3)
    assert [(row["seq"], row["state"]) for row in snap["ranks"]] == [(3, "training"), (3, "training")]
    assert "2 heartbeat(s) refused as unsigned or badly signed" in snap["run"]["message"], snap["run"]
    assert subscriber.refused_last == "rank 1's heartbeat in the stream, badly signed"
    # A dashboard that starts now reads the hash, where the forgery is: refused there too.
    client.hset(latest, mapping={"1": forged, "1:s": redisbus.signature(own, "hb", job, "1", forged)})
    fresh = RunState(run_dir, config, redis=redisbus.Subscriber(redis_server.url, job, key=MASTER.encode()))
    fresh.scan(now + 3)
    assert [row["seq"] for row in fresh.snapshot(now + 3)["ranks"]] == [3, None]
    beat(1, 4)
    fresh.scan(now + 4)
    assert [(row["seq"], row["state"]) for row in fresh.snapshot(now + 4)["ranks"]][1] == (4, "training")
    for sink in sinks:
        sink.close()


def test_a_dashboard_refuses_a_handed_key_and_a_key_file_is_read_safely(tmp_path, keys_dir, run_dir):
    with pytest.raises(ValueError, match="must be the master key"):
        redisbus.Subscriber("redis://127.0.0.1:1/0", "job", key=rank_key(keys_dir, 0))
    link = tmp_path / "link.key"
    link.symlink_to(keys_dir / "rank_0.key")
    with pytest.raises(OSError):
        redisbus.read_key_file(str(link))
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        redisbus.read_key_file(str(fifo))
    big = tmp_path / "big.key"
    big.write_bytes(b"k" * (redisbus.MAX_KEY_BYTES + 1))
    with pytest.raises(ValueError, match="no key"):
        redisbus.read_key_file(str(big))
    with pytest.raises(ValueError, match="malformed"):
        redisbus.own_key(b"rk1:rank:job:0:not-hex", "rank:job:0")


def acl_user(redis_server, role: str) -> str:
    """Create the ``rankwatch-{role}`` user of docs/production.md's ``ACL SETUSER`` line, as written
    there; the URL that logs in as it."""
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "production.md").read_text()
    line = next(x for x in docs.splitlines() if x.startswith(f"ACL SETUSER rankwatch-{role} "))
    password = f"{role.upper()}-PASSWORD"
    redis_py.Redis.from_url(redis_server.url).execute_command(*line.replace(password, "pass").split())
    return redis_server.url.replace("redis://", f"redis://rankwatch-{role}:pass@")


def test_the_documented_acls_let_each_role_do_its_part_and_nothing_else(redis_server, tmp_path):
    """The trainers', the agents' and the dashboards' ``ACL SETUSER`` lines of docs/production.md on a
    real Redis 6+."""
    admin = redis_py.Redis.from_url(redis_server.url)
    job = "J"
    url = acl_user(redis_server, "rank")
    rank = redisbus.Publisher(url, job, 2, key=MASTER.encode())
    assert rank.publish(0, b"{}"), rank.error
    assert admin.xlen(redisbus.keys(job)[0]) == 1
    other = redisbus.Publisher(url, "another-job", 2, key=MASTER.encode())
    assert not other.publish(0, b"{}") and "no permissions" in other.error
    client = redis_py.Redis.from_url(url)
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        client.publish(f"rankwatch:{job}:socketio", "forged")
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        client.set(redisbus.keys(job)[2], "a leader for ever")
    rank.close(), other.close()

    url = acl_user(redis_server, "agent")
    node = SimNode(tmp_path, "node-a", range(0, 2), 2)
    node.beat()
    agent = Agent(node.dir, url, "R", from_env(), key=MASTER.encode(), host="node-a")
    agent.tick(time.time())
    assert agent.outbox.error is None and admin.xlen(dg.keys("R")[0]) == 1, agent.outbox.error
    client = redis_py.Redis.from_url(url)
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        client.publish(f"rankwatch:{job}:socketio", "forged")
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        client.set(redisbus.keys(job)[2], "a leader for ever")
    with pytest.raises(redis_py.exceptions.NoPermissionError):
        client.hset(redisbus.keys(job)[1], "0", "a heartbeat")
    agent.outbox.close()

    # The dashboards' line: a dashboard on it reads the rank's heartbeat, takes the leader lock and
    # relays through the queue's channel; it reaches nothing outside Rankwatch's keys, and no
    # dangerous command.
    url = acl_user(redis_server, "dash")
    reader = redisbus.Subscriber(url, job, key=MASTER.encode())
    assert [r for r, _ in reader.poll()] == [0] and reader.error is None, reader.error
    reader.close()
    run_dir = tmp_path / "dash-run"
    run_dir.mkdir()
    write_job(run_dir, 2)
    app = make_app(run_dir, REDIS_URL=url, REDIS_KEY=MASTER, REDIS_JOB=job)
    try:
        watcher = app.extensions["rankwatch"].watcher
        watcher.tick()
        assert watcher.leading and watcher.cluster.reachable, watcher.cluster
        health = app.test_client().get("/api/health", headers=AUTH).get_json()
        assert health["leader"] == health["id"], health
    finally:
        watcher.stop()
    client = redis_py.Redis.from_url(url)
    for denied in (lambda: client.get("another:key"), client.flushall, lambda: client.config_get("dir")):
        with pytest.raises(redis_py.exceptions.NoPermissionError):
            denied()


def test_an_agents_key_signs_for_its_own_host_only(tmp_path, redis_server):
    out = tmp_path / "keys"
    result = CliRunner().invoke(
        redis_keys,
        ["--out", str(out), "--agent", "node-a", "--agent", "node-b"],
        env={"RANKWATCH_REDIS_KEY": MASTER},
    )
    assert result.exit_code == 0, result.output
    handed = {h: redisbus.read_key_file(str(out / f"agent_{h}.key")) for h in ("node-a", "node-b")}
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = make_app(hub_dir, REDIS_URL=redis_server.url, REDIS_KEY=MASTER, AGENTS=True, AGENT_LOST_S=3600.0)
    hub = app.extensions["rankwatch"].state.source.hub

    def scan():
        app.extensions["rankwatch"].state.scan(time.time())

    nodes = {h: SimNode(tmp_path, h, range(i * 2, i * 2 + 2), 4) for i, h in enumerate(("node-a", "node-b"))}
    agents = {
        h: Agent(n.dir, redis_server.url, RUN, from_env(), key=handed[h], host=h) for h, n in nodes.items()
    }
    with pytest.raises(ValueError, match="signs only for its own"):
        Agent(nodes["node-b"].dir, redis_server.url, RUN, from_env(), key=handed["node-a"], host="node-b")
    scan()  # the hub joins the digest stream
    for h, node in nodes.items():
        node.beat()
        agents[h].tick(time.time())
    scan()
    assert set(hub.hosts) == {"node-a", "node-b"} and hub.refused == 0, hub.refused_last
    own_a = redisbus.parse_handed(handed["node-a"])[1]
    client = redis_py.Redis.from_url(redis_server.url)

    # node-a's agent signs a digest for node-b: rank 2 dead.
    nodes["node-b"].beat()
    digest = agents["node-b"].build(time.time())
    digest["seq"] += 1000
    for entry in digest["rows"]:
        entry["row"] |= {"health": "dead", "reason": "forged by node-a"}
    body = json.dumps(digest, separators=(",", ":")).encode()
    with pytest.raises(ValueError, match="signs only for its own"):
        dg.encode(digest, handed["node-a"])
    for key in (own_a, handed["node-a"]):
        sig = redisbus.signature(key, "digest", RUN, "node-b", body)
        client.xadd(dg.keys(RUN)[0], {"h": b"node-b", "d": body, "s": sig})
    scan()
    assert hub.refused == 2 and hub.refused_last == "a digest for host 'node-b', badly signed", (
        hub.refused_last
    )
    assert all(hub.rows[r]["health"] != "dead" for r in (2, 3)), hub.rows

    # ... and the flag node-b's agent applies: refused, said, never written.
    now = time.time()
    forged = dg.flag_value(b'{"GracefulExit": 1}', now, own_a, RUN, request_id=None, at=now)
    client.set(dg.flag_key(RUN, "node-b"), forged)
    agents["node-b"].tick(now)
    assert agents["node-b"].flag_error == "an unsigned or badly signed flag value", agents[
        "node-b"
    ].flag_error
    assert not (nodes["node-b"].dir / "rankwatch" / "flag.json").exists()

    # ... and an answer to a request the hub sent node-b.
    rid = "b" * 32
    answer = {"id": rid, "host": "node-b", "kind": "rank", "error": "forged"} | dict.fromkeys(ask.KINDS)
    with pytest.raises(ValueError, match="badly signed"):
        ask.check(dg.seal(answer, "answer", f"node-b/{rid}", own_a, RUN), hub, "node-b", rid, ("rank", 2))
    assert (
        ask.check(
            dg.seal(answer, "answer", f"node-b/{rid}", agents["node-b"].key, RUN),
            hub,
            "node-b",
            rid,
            ("rank", 2),
        )
        == "the agent on host node-b answered: forged"
    )
    for agent in agents.values():
        agent.outbox.close()


def test_the_hubs_resync_request_is_signed_for_each_host(tmp_path, redis_server):
    """The request that makes an agent send all its rows again was one unsigned value for every agent:
    whoever could write to Redis could make each send everything every tick. It is now one per host,
    signed with that host's key; an unsigned, forged, other host's or replayed one is refused."""
    agent_key = redisbus.own_key(MASTER.encode(), redisbus.agent_label("node-a"))
    node = SimNode(tmp_path, "node-a", range(4), 4)
    # A rolling resync of one row a digest (every 1,000 s): a digest with all 4 is a resync taken.
    handed = redisbus.hand_out(MASTER.encode(), redisbus.agent_label("node-a")).encode()
    agent = Agent(node.dir, redis_server.url, RUN, from_env(), key=handed, host="node-a", resync_s=1000.0)

    def rows() -> int:
        node.beat()
        return len(agent.tick(time.time())["rows"])

    assert rows() == 4  # a new agent sends everything
    assert rows() == 1
    client = redis_py.Redis.from_url(redis_server.url)
    key = dg.resync_key(RUN, "node-a")
    node_b = redisbus.own_key(MASTER.encode(), redisbus.agent_label("node-b"))
    forged = [
        f"{time.time() + 1:.6f}".encode(),  # today's value before: a bare time
        dg.resync_value(None, RUN, time.time() + 2),  # unsigned
        dg.resync_value(node_b, RUN, time.time() + 3),  # another host's key
        dg.resync_value(MASTER.encode(), RUN, time.time() + 4),  # no derived key at all
    ]
    for n, value in enumerate(forged, 1):
        client.set(key, value)
        assert rows() == 1 and rows() == 1, value
        assert agent.resyncs_refused == n

    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = make_app(hub_dir, REDIS_URL=redis_server.url, REDIS_KEY=MASTER, AGENTS=True, AGENT_LOST_S=3600.0)
    state = app.extensions["rankwatch"].state
    state.scan(time.time())  # the hub joins the digest stream
    assert rows() == 1
    state.scan(time.time())  # it hears node-a for the first time: it asks node-a for everything
    assert set(state.source.hub.hosts) == {"node-a"}
    asked = client.get(key)
    assert dg.open_resync(asked, agent_key, RUN) > agent.boot
    assert rows() == 1  # the request is read after this digest is built...
    assert rows() == 4  # ...and the next carries every row
    assert rows() == 1 and agent.resyncs_refused == len(forged)
    # The hub's request replayed after a newer one was taken: refused.
    client.set(key, dg.resync_value(agent_key, RUN, time.time()))
    assert rows() == 1 and rows() == 4
    client.set(key, asked)
    assert rows() == 1 and rows() == 1 and agent.resyncs_refused == len(forged) + 1
    agent.outbox.close()
