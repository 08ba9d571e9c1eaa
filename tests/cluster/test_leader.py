"""The leader lock and the watcher's roles (app/cluster.py) against a real redis-server, in process.

The browser tests with two dashboard processes are in tests/cluster/test_cluster.py.
"""

from __future__ import annotations

import time

import pytest

from app import create_app
from app.cluster import Cluster, Leader
from app.config import from_env
from app.extensions import socketio
from app.push import DELTA_EVENT, SNAPSHOT_EVENT
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import redisbus

TTL_S = 1.0


def until(fn, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{what} within {timeout} s")


def test_exactly_one_takes_the_lock_and_another_takes_it_over_when_it_expires(redis_server):
    a, b = (Leader(redis_server.url, "job", TTL_S) for _ in range(2))
    assert a.step() is True and b.step() is False
    assert a.step() is True and b.step() is False  # renewed, not taken twice
    assert b.holder() == a.token
    # a stops renewing (a dead process): b takes over once the key expires.
    until(b.step, "b takes over")
    assert b.holder() == b.token
    assert a.step() is False  # a came back: it finds the lock taken and follows


def test_release_hands_the_lock_over_at_once(redis_server):
    a, b = (Leader(redis_server.url, "job", 60.0) for _ in range(2))
    assert a.step() and not b.step()
    a.release()
    assert b.step() is True


def test_redis_down_keeps_each_role_and_one_leads_again_after(redis_server):
    a, b = (Leader(redis_server.url, "job", TTL_S) for _ in range(2))
    assert a.step() and not b.step()
    redis_server.stop()
    assert a.step() is True and b.step() is False  # no election without Redis
    assert a.error and "unreachable" in a.error and a.holder() is None
    redis_server.start()  # empty: the lock is gone
    a._down_until = b._down_until = 0.0  # skip redisbus.RETRY_S
    assert b.step() is True  # the quicker one takes it
    assert a.step() is False and a.error is None


def _cluster_app(run_dir, url: str, **extra):
    return create_app(
        {"RUN_DIR": str(run_dir), "REDIS_URL": url, "TICK_S": 0.2, "LEADER_TTL_S": TTL_S, **extra}
    )


def test_a_follower_pushes_nothing_while_redis_answers_and_its_own_view_while_it_is_down(
    redis_server, run_dir
):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2))
    holder = Leader(redis_server.url, redisbus.job_key(run_dir), 60.0)
    assert holder.step()  # another dashboard leads
    # With the same LEADER_TTL_S: a lock with more left than this one's TTL is stale (redisbus.Leader).
    app = _cluster_app(run_dir, redis_server.url, LEADER_TTL_S=60.0)
    watcher = app.extensions["rankwatch"].watcher
    assert socketio.server.manager is watcher.cluster.queue
    # No page yet, so no relay to wait for (tests/cluster/test_cluster.py has pages on both).
    assert watcher.tick() is None and not watcher.leading  # it reads, but the leader pushes
    assert watcher.state.scanned_at is not None

    redis_server.stop()
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=3))
    out = watcher.tick()  # pushed to this process's pages only
    assert out is not None and out[0] == DELTA_EVENT and not watcher.leading
    assert "Redis is unreachable" in out[1]["run"]["message"]
    assert watcher._stop_pushed.pushed  # the stop panel too


def test_a_new_leader_and_a_leader_back_from_an_outage_send_everyone_a_snapshot(redis_server, run_dir):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2))
    app = _cluster_app(run_dir, redis_server.url)
    watcher = app.extensions["rankwatch"].watcher
    out = watcher.tick()
    assert watcher.leading and out[0] == SNAPSHOT_EVENT
    assert watcher.tick() is None  # then deltas, when something changed
    # After an outage the other processes' pages missed its pushes: a snapshot again.
    redis_server.stop()
    assert watcher.tick()[0] == DELTA_EVENT and watcher.leading  # "Redis is unreachable"
    redis_server.start()
    watcher.cluster.lock._down_until = 0.0  # skip redisbus.RETRY_S
    watcher.state._reader.redis._down_until = 0.0
    assert watcher.tick()[0] == SNAPSHOT_EVENT and watcher.leading
    watcher.stop()
    assert watcher.cluster.lock.holder() is None  # released: a follower need not wait


def test_without_redis_url_the_app_has_no_cluster_and_socketio_no_queue(run_dir, redis_server):
    _cluster_app(run_dir, redis_server.url)
    app = create_app({"RUN_DIR": str(run_dir)})
    assert app.extensions["rankwatch"].watcher.cluster is None
    assert type(socketio.server.manager).__name__ == "Manager"  # not the earlier app's queue
    assert app.test_client().get("/api/health").get_json()["role"] == "only"


def test_a_lock_ttl_shorter_than_two_ticks_is_refused(run_dir):
    config = from_env({}) | {"REDIS_URL": "redis://127.0.0.1:1/0", "TICK_S": 1.0, "LEADER_TTL_S": 1.5}
    with pytest.raises(ValueError, match="LEADER_TTL_S"):
        Cluster.from_config(config, str(run_dir))
