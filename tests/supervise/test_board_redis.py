"""The nodes' board in a real ``redis-server`` (``app/supervise/board.py``): what a writer without the
launch key, a record too large, junk or Redis down can do to it (nothing but be ignored or said)."""

from __future__ import annotations

import pytest
import redis
from click.testing import CliRunner

from app.cli.rediskeys import redis_keys
from app.supervise import board as boards
from app.supervise import command, nodes
from trainer_bridge.rundir import redisbus

MASTER = b"m" * 32


def end(kind: str = "crash") -> dict:
    return {"cause": {"kind": kind}, "host": "h", "fault_at": 1.0, "ended_at": 2.0, "last_step": 7, "node": 1}


def test_with_a_key_only_records_signed_for_the_job_s_launch_are_read(redis_server, monkeypatch):
    key = redisbus.own_key(MASTER, redisbus.launch_label("job1"))
    mine = boards.RedisBoard(redis_server.url, "job1", key)
    mine.put("end_3_1.json", end())
    assert nodes.Nodes("run", 0, 2, boards.RedisBoard(redis_server.url, "job1", key)).ends(3)[1]["node"] == 1
    raw = redis.Redis.from_url(redis_server.url)
    # A writer without the key (a rank, an agent, anyone on the network) and one with another job's key.
    raw.hset(mine.hash, "plan_3.json", b'{"attempt":3,"action":"end","exit_code":0}')
    other = boards.RedisBoard(
        redis_server.url, "job2", redisbus.own_key(MASTER, redisbus.launch_label("job2"))
    )
    other.hash = mine.hash
    other.put("end_3_0.json", end())
    assert mine.get("plan_3.json") is None and sorted(mine.read(["end_3_0.json", "end_3_1.json"])) == [
        "end_3_1.json"
    ]
    # A rank's handed key signs nothing for the launch: refused when the board is made, with the way out.
    monkeypatch.setenv(redisbus.REDIS_URL_ENV, redis_server.url)
    monkeypatch.setenv(redisbus.REDIS_KEY_ENV, redisbus.hand_out(MASTER, redisbus.rank_label("job1", 0)))
    line = command.parse(["msrun", "--worker_num=2", "--local_worker_num=1", "--node_rank=1", "t.py"])
    with pytest.raises(command.NotMsrun, match="give rankwatch launch RANKWATCH_LAUNCH_KEY_FILE"):
        nodes.Nodes.of(line, "run")


def test_the_launch_key_file_signs_as_the_master_does(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv(redisbus.REDIS_KEY_ENV, MASTER.decode())
    got = CliRunner().invoke(redis_keys, ["--out", str(tmp_path / "keys"), "--job", "job1", "--launch"])
    assert got.exit_code == 0, got.output
    monkeypatch.delenv(redisbus.REDIS_KEY_ENV)
    monkeypatch.setenv(redisbus.REDIS_URL_ENV, redis_server.url)
    monkeypatch.setenv(redisbus.REDIS_JOB_ENV, "job1")
    monkeypatch.setenv(boards.LAUNCH_KEY_FILE_ENV, str(tmp_path / "keys" / "launch.key"))
    node1 = boards.for_run(str(tmp_path))
    assert isinstance(node1, boards.RedisBoard) and node1.key == redisbus.own_key(MASTER, "launch:job1")
    node1.put("end_1_1.json", end())
    assert boards.RedisBoard(redis_server.url, "job1", redisbus.own_key(MASTER, "launch:job1")).get(
        "end_1_1.json"
    )
    assert boards.RedisBoard(redis_server.url, "job1", None).get("end_1_1.json")  # no key: nothing is checked


def test_junk_and_oversized_records_are_skipped_and_listing_is_bounded(redis_server, monkeypatch):
    board = boards.RedisBoard(redis_server.url, "job1")
    raw = redis.Redis.from_url(redis_server.url)
    raw.hset(
        board.hash,
        mapping={
            "end_1_0.json": b"{not json",
            "end_1_1.json": b"[1, 2]",
            "end_1_2.json": b'{"x": "' + b"y" * boards.MAX_RECORD + b'"}',
            "end_1_3.json": b"\xff\xfe",
            "e" * 100: b"{}",
        },
    )
    board.put("end_1_4.json", end())
    assert board.read([f"end_1_{k}.json" for k in range(5)]) == {"end_1_4.json": end()}
    assert "e" * 100 not in board.names()
    monkeypatch.setattr(boards, "MAX_NAMES", 3)
    assert len(board.names()) == 3
    board.drop(["end_1_4.json"])
    assert board.get("end_1_4.json") is None and raw.ttl(board.hash) > 0


def test_redis_down_fails_writes_as_a_full_disk_would_and_reads_give_nothing(redis_server, monkeypatch):
    board = boards.RedisBoard(redis_server.url, "job1")
    board.put("end_1_1.json", end())
    redis_server.stop()
    with pytest.raises(OSError, match="unreachable"):
        board.put("end_1_1.json", end())
    # Within READ_RETRY_S of the failure, reads give nothing without a connection tried (the attempt
    # loop's 0.2 s poll is not slowed by a connect timeout each time).
    connects: list[str] = []
    real = redisbus.connect
    monkeypatch.setattr(redisbus, "connect", lambda url: connects.append(url) or real(url))
    assert board.get("end_1_1.json") is None and board.names() == [] and board.read(["end_1_1.json"]) == {}
    assert connects == []
    said: list[str] = []

    class Outcome:
        spawned_at = fault_at = detected_at = ended_at = 1.0
        gasp = None

    nodes.Nodes("run", 1, 2, board).tell(1, Outcome(), {"kind": "crash"}, 7, "h", said.append)
    assert said and said[0].startswith(
        "WARNING: this node's end of attempt 1 not written for the other nodes"
    )
    # Redis back: the first write that gets through opens reads again at once.
    redis_server.start()
    board.put("end_1_1.json", end())
    assert board.get("end_1_1.json") == end() and connects
