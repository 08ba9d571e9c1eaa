"""Heartbeats over Redis: a real ``redis-server`` on a loopback port (fixture ``redis_server``, tests/helpers/redisserver.py)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from app.config import from_env
from app.run.heartbeats import REDIS_FILE_SCAN_S as READ_FILES_EVERY
from app.run.state import RunState
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.beatsink import FILE_EVERY_S, BeatSink
from trainer_bridge.rundir import redisbus, runfiles

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def publish(pub: redisbus.Publisher, hb: dict) -> bool:
    return pub.publish(hb["rank"], json.dumps(hb).encode())


def test_the_dashboard_reads_heartbeats_from_redis_not_files(redis_server, run_dir):
    write_job(run_dir, 3)
    job = redisbus.job_key(run_dir)
    pub = redisbus.Publisher(redis_server.url, job, world_size=3)
    state = RunState(run_dir, from_env({}), redis=redisbus.Subscriber(redis_server.url, job))
    now = time.time()
    for r in range(3):
        assert publish(pub, heartbeat(r, 3, seq=1, now=now))
    state.scan(now)
    rows = {row["rank"]: row for row in state.snapshot(now)["ranks"]}
    assert [rows[r]["seq"] for r in range(3)] == [1, 1, 1]
    assert state.snapshot(now)["run"]["transport"] == "redis"
    # Only what is new is read next time: rank 1 again, twice.
    publish(pub, heartbeat(1, 3, seq=2, now=now + 1))
    publish(pub, heartbeat(1, 3, seq=3, now=now + 2))
    state.scan(now + 2)
    rows = {row["rank"]: row for row in state.snapshot(now + 2)["ranks"]}
    assert [rows[r]["seq"] for r in range(3)] == [1, 3, 1]
    assert not any(run_dir.glob("rankwatch/rank_*.json"))  # no file was involved


def test_a_restarted_dashboard_starts_from_the_newest_heartbeat_of_every_rank(redis_server, run_dir):
    write_job(run_dir, 2)
    job = redisbus.job_key(run_dir)
    pub = redisbus.Publisher(redis_server.url, job, world_size=2)
    now = time.time()
    for seq in range(1, 6):
        for r in range(2):
            publish(pub, heartbeat(r, 2, seq=seq, now=now + seq))
    state = RunState(run_dir, from_env({}), redis=redisbus.Subscriber(redis_server.url, job))
    state.scan(now + 6)
    assert [row["seq"] for row in state.snapshot(now + 6)["ranks"]] == [5, 5]


def test_invalid_heartbeats_in_redis_make_that_rank_corrupt(redis_server, run_dir):
    write_job(run_dir, 2)
    job = redisbus.job_key(run_dir)
    pub = redisbus.Publisher(redis_server.url, job, world_size=2)
    state = RunState(run_dir, from_env({}), redis=redisbus.Subscriber(redis_server.url, job))
    now = time.time()
    publish(pub, heartbeat(0, 2, seq=1, now=now))
    pub.publish(1, b'{"rank": 1, "time": 5, "pid": -1}')
    state.scan(now)
    rows = {row["rank"]: row for row in state.snapshot(now)["ranks"]}
    assert rows[0]["health"] == "healthy"
    assert rows[1]["health"] == "corrupt" and "rank 1 in redis: pid" in rows[1]["reason"]


def test_redis_down_falls_back_to_files_and_recovers(redis_server, run_dir):
    write_job(run_dir, 2)
    job = redisbus.job_key(run_dir)
    pub = redisbus.Publisher(redis_server.url, job, world_size=2)
    state = RunState(run_dir, from_env({}), redis=redisbus.Subscriber(redis_server.url, job))
    now = time.time()
    for r in range(2):
        publish(pub, heartbeat(r, 2, seq=1, now=now))
    state.scan(now)
    redis_server.stop()
    # The bridge cannot publish either, so it writes files at the full rate.
    assert not publish(pub, heartbeat(0, 2, seq=2, now=now + 1))
    assert "unreachable" in pub.error
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, seq=2, now=now + 1))
    state.scan(now + 1)
    snap = state.snapshot(now + 1)
    assert snap["run"]["transport"] == "files"
    assert "Redis is unreachable" in snap["run"]["message"]
    assert [row["seq"] for row in snap["ranks"]] == [2, 2]
    # Redis returns (same port); after the retry pause both sides use it again.
    redis_server.start()
    pub._down_until = state._reader.redis._down_until = 0.0  # skip the RETRY_S pause
    for r in range(2):
        assert publish(pub, heartbeat(r, 2, seq=3, now=now + 2))
    state.scan(now + 2)
    snap = state.snapshot(now + 2)
    assert snap["run"]["transport"] == "redis" and [row["seq"] for row in snap["ranks"]] == [3, 3]


def test_a_rank_that_cannot_reach_redis_is_still_read_from_its_file(redis_server, run_dir):
    """Rank 1 cannot reach Redis (its own network path) and writes files at the full rate."""
    write_job(run_dir, 2)
    job = redisbus.job_key(run_dir)
    pub = redisbus.Publisher(redis_server.url, job, world_size=2)
    state = RunState(run_dir, from_env({}), redis=redisbus.Subscriber(redis_server.url, job))
    now = time.time()
    for seq in range(1, 4):
        t = now + 2 * READ_FILES_EVERY * (seq - 1)
        publish(pub, heartbeat(0, 2, seq=seq, now=t))
        write_heartbeat(run_dir, heartbeat(1, 2, seq=seq, now=t))
        state.scan(t)
        snap = state.snapshot(t)
        assert snap["run"]["transport"] == "redis"
        assert [row["seq"] for row in snap["ranks"]] == [seq, seq]
    # Rank 0's file (written every FILE_EVERY_S by its BeatSink) is older than
    # what Redis gave: reading it does not take the rank back in time.
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1, now=now))
    t = now + 2 * READ_FILES_EVERY * 3
    state.scan(t)
    assert [row["seq"] for row in state.snapshot(t)["ranks"]] == [3, 3]


# ------------------------------------------------ the bridge's side: BeatSink


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def beat_bytes(run_dir, seq: int, state: str = "training") -> bytes:
    runfiles.state_dir(run_dir).mkdir(parents=True, exist_ok=True)  # the bridge makes it at start
    return json.dumps(heartbeat(0, 2, seq=seq, state=state)).encode()


def stream_seqs(url: str, run_dir) -> list[int]:
    import redis

    stream, _, _ = redisbus.keys(redisbus.job_key(run_dir))
    return [json.loads(f[b"hb"])["seq"] for _, f in redis.Redis.from_url(url).xrange(stream)]


def file_seq(run_dir) -> int | None:
    path = runfiles.heartbeat_path(run_dir, 0)
    return json.loads(path.read_bytes())["seq"] if path.exists() else None


def test_with_redis_every_heartbeat_is_published_and_the_file_written_less_often(redis_server, run_dir):
    clock = Clock()
    sink = BeatSink(run_dir, 0, 2, url=redis_server.url, clock=clock)
    sink.write(beat_bytes(run_dir, 1), "training")
    assert file_seq(run_dir) == 1  # the first heartbeat always lands in the file
    for seq in range(2, 6):
        clock.t += 1
        sink.write(beat_bytes(run_dir, seq), "training")
    assert stream_seqs(redis_server.url, run_dir) == [1, 2, 3, 4, 5]
    assert file_seq(run_dir) == 1 and sink.warnings == []
    clock.t += FILE_EVERY_S
    sink.write(beat_bytes(run_dir, 6), "training")
    assert file_seq(run_dir) == 6  # the periodic file, for a restarted dashboard and forensics
    clock.t += 1
    sink.write(beat_bytes(run_dir, 7, state="stopping"), "stopping")
    assert file_seq(run_dir) == 7  # a stop's stages always reach the file (rankwatch stop reads it)
    sink.close()
    sink.close()


def test_redis_down_sends_every_heartbeat_to_the_file_with_a_warning_and_recovers(redis_server, run_dir):
    clock = Clock()
    sink = BeatSink(run_dir, 0, 2, url=redis_server.url, clock=clock)
    sink.write(beat_bytes(run_dir, 1), "training")
    redis_server.stop()
    for seq in (2, 3):
        clock.t += 1
        sink.write(beat_bytes(run_dir, seq), "training")  # neither raises nor waits for Redis
        assert file_seq(run_dir) == seq
    assert len(sink.warnings) == 1 and "unreachable" in sink.warnings[0], sink.warnings
    assert "heartbeats go to files" in sink.warnings[0]

    redis_server.start()
    clock.t += redisbus.RETRY_S
    sink.write(beat_bytes(run_dir, 4), "training")
    assert sink.warnings == []
    assert stream_seqs(redis_server.url, run_dir) == [4]  # a fresh server: only what came after
    clock.t += 1
    sink.write(beat_bytes(run_dir, 5), "training")
    assert file_seq(run_dir) == 3  # back to the lower file rate: 4 and 5 went to Redis only


def test_no_redis_url_means_files_only(run_dir, monkeypatch):
    monkeypatch.delenv(redisbus.REDIS_URL_ENV, raising=False)
    sink = BeatSink(run_dir, 0, 2)
    assert sink.publisher is None
    sink.write(beat_bytes(run_dir, 1), "training")
    sink.write(beat_bytes(run_dir, 2), "training")
    assert file_seq(run_dir) == 2 and sink.warnings == []
