"""Issue 32, P3 and P9: retention deletes only what this disk proves, and leftovers only where saves put them.

P3 runs the attack through a real redis-server and a real agent: the agent of
"node-b" (any agent holds the key, so it may list what it likes) lists three
complete checkpoint sets newer than every set on the hub's own disk, sets the
hub does not have. Before the fix the hub's retention took them as the newest
three and deleted every real local set, the newest complete one included.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from app import create_app
from app.agent.runner import Agent, run_forever
from app.config import from_env
from tests.helpers.agents import KEY, RUN, SimNode
from tests.helpers.app import FAST_SETTINGS, TOKEN, operator, wait_for
from tests.helpers.checkpoints import OLD, periodic, sid
from tests.helpers.heartbeats import write_job

WORLD = 2
LOCAL = (10, 20, 30, 40, 50)
FORGED = (60, 70, 80)


@pytest.fixture
def hub_and_agent(tmp_path, redis_server):
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = create_app(
        {
            "RUN_DIR": str(hub_dir),
            "TESTING": True,
            "TOKEN": TOKEN,
            "REDIS_URL": redis_server.url,
            "REDIS_KEY": KEY,
            "AGENTS": True,
            "AGENT_LOST_S": 30.0,
            "CHECKPOINT_SCAN_S": 0.2,
            "RETENTION_KEEP": 3,
            **FAST_SETTINGS,
        }
    )
    node = SimNode(tmp_path, "node-b", range(WORLD), WORLD)
    agent = Agent(
        node.dir, redis_server.url, RUN, {**from_env(), **FAST_SETTINGS}, key=KEY.encode(), host=node.host
    )
    stopping = threading.Event()
    thread = threading.Thread(target=run_forever, args=(agent, stopping), daemon=True)
    thread.start()
    yield app, hub_dir, node
    stopping.set()
    thread.join(30)
    agent.outbox.close()
    app.extensions["rankwatch"].state.source.hub.close()


def test_an_agents_listing_of_newer_sets_never_deletes_a_local_set(hub_and_agent):
    app, hub_dir, node = hub_and_agent
    write_job(hub_dir, WORLD)
    for step in LOCAL:
        periodic(hub_dir, step)
    for step in FORGED:  # what the agent lists: not on the hub's disk
        periodic(node.dir, step)
    client = app.test_client()

    def plan_with_forged_sets():
        node.beat()
        app.extensions["rankwatch"].state.scan(time.time())
        body = client.get("/api/checkpoints/retention", headers=operator()).get_json()
        ids = {s["id"] for s in body.get("sets", [])}
        return body if {sid(s) for s in FORGED} <= ids else None

    plan = wait_for(plan_with_forged_sets, "the agent's listing in the retention plan", timeout=120)
    actions = {s["id"]: (s["action"], s["why"]) for s in plan["sets"]}
    # Only what the local disk proves goes: its two oldest, past its own newest three complete.
    assert {i for i, (a, _) in actions.items() if a == "delete"} == {sid(10), sid(20)}, actions
    for step in (30, 40, 50):
        assert (
            actions[sid(step)][1]
            == "kept: only an agent's listing shows the newer sets; this disk does not prove them"
        )

    r = client.post("/api/checkpoints/retention/apply", json={"hash": plan["hash"]}, headers=operator())
    assert r.status_code == 200, r.get_json()
    left = sorted(int(p.name.split("_")[-1].split(".")[0]) for p in (hub_dir / "ckpt/rank_0").iterdir())
    assert left == [30, 40, 50]
    assert all((hub_dir / f"ckpt/rank_{r}/net-1_50.ckpt").exists() for r in range(WORLD))


def test_leftovers_only_where_checkpoint_layouts_put_them_judged_by_the_newest_mtime_inside(run_dir):
    """P9: ``*-unfinished`` data outside the checkpoint folders is never a leftover; one beside
    the checkpoints whose content changed recently is kept; the plan names what it will delete."""
    from tests.helpers.checkpoints import retention

    write_job(run_dir, WORLD)
    for step in (10, 20):
        periodic(run_dir, step)
    data = run_dir / "data/imagenet-unfinished"
    data.mkdir(parents=True)
    (data / "train.bin").write_bytes(b"x" * 100)
    notes = run_dir / "notes/paper-draft-unfinished"
    notes.parent.mkdir()
    notes.write_text("draft")
    old_tmp = run_dir / "ckpt/rank_0/net-1_30.ckpt.orbax-checkpoint-tmp-1"
    old_tmp.mkdir()
    (old_tmp / "part").write_bytes(b"y" * 10)
    live_tmp = run_dir / "ckpt/rank_1/net-1_30-unfinished"
    live_tmp.mkdir()
    fresh = live_tmp / "part"
    fresh.write_bytes(b"z" * 10)  # written just now, inside a directory that looks old
    for path in (data, data / "train.bin", notes, old_tmp, old_tmp / "part", live_tmp):
        os.utime(path, (OLD, OLD))

    p = retention(run_dir).plan(WORLD, {})
    temps = {e.id: e for e in p.entries if e.kind == "temp"}
    assert set(temps) == {
        "ckpt/rank_0/net-1_30.ckpt.orbax-checkpoint-tmp-1",
        "ckpt/rank_1/net-1_30-unfinished",
    }
    assert temps["ckpt/rank_0/net-1_30.ckpt.orbax-checkpoint-tmp-1"].action == "delete"
    assert temps["ckpt/rank_1/net-1_30-unfinished"].action == "keep"

    r = retention(run_dir).apply(p.hash, WORLD, {}, who="test")
    assert "ckpt/rank_0/net-1_30.ckpt.orbax-checkpoint-tmp-1" in r["deleted"]
    assert (data / "train.bin").exists() and notes.exists() and fresh.exists()
    assert not old_tmp.exists()
