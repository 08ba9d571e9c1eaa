"""``rankwatch launch`` on several nodes without MindSpore: the node's identity, the lock and the mark per
node, the end records and node 0's plan (``app/supervise/nodes.py``), the launch guard's ended launch.

The protocol's tests run on both boards (``app/supervise/board.py``): the run directory's files and a
real ``redis-server``. The real two-node jobs are ``tests/cluster/test_launch_multinode.py``.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from app.supervise import board as boards
from app.supervise import command, lock, nodes, policy, procs
from tests.helpers.app import wait_for
from trainer_bridge.rundir import launchguard, runfiles


def msrun(*opts: str):
    return command.parse(["msrun", *opts, "train.py"])


def end(cause: str, fault_at: float | None, **more) -> dict:
    return {
        "cause": {"kind": cause},
        "host": "h",
        "fault_at": fault_at,
        "ended_at": 5.0,
        "last_step": 7,
        **more,
    }


class Signals:
    count = 0
    wake = threading.Event()


@pytest.fixture(params=["files", "redis"])
def make(request, tmp_path):
    """``make(node, count)``: a node of one run on the board of the test's parameter, each with its own
    connection (as each node's supervisor has)."""
    if request.param == "files":
        return lambda node, count: nodes.Nodes(str(tmp_path), node, count)
    url = request.getfixturevalue("redis_server").url
    return lambda node, count: nodes.Nodes(str(tmp_path), node, count, boards.RedisBoard(url, "job1"))


def test_the_node_comes_from_the_msrun_line_and_node_0_leads(tmp_path):
    assert nodes.Nodes.of(msrun("--worker_num=2", "--local_worker_num=2"), str(tmp_path)) is None
    two = nodes.Nodes.of(msrun("--worker_num=4", "--local_worker_num=2", "--node_rank=1"), str(tmp_path))
    assert (two.node, two.count, two.leader) == (1, 2, False)
    assert nodes.Nodes.of(msrun("--worker_num=3", "--local_worker_num=2", "--node_rank=0"), "r").leader
    for bad in ([], ["--node_rank=-1"], ["--node_rank=2"], ["--node_rank=x"]):
        with pytest.raises(command.NotMsrun, match="needs msrun's --node_rank, from 0 to 1"):
            nodes.Nodes.of(msrun("--worker_num=4", "--local_worker_num=2", *bad), str(tmp_path))


def test_one_supervisor_per_run_directory_and_node(tmp_path):
    held = [lock.acquire(str(tmp_path), node) for node in (None, 1, 2)]  # node 0 takes the one-node lock
    try:
        for node in (None, 0, 1):
            with pytest.raises(lock.Held, match="one supervisor per run directory and node"):
                lock.acquire(str(tmp_path), node)
    finally:
        for fd in held:
            os.close(fd)
    # Two nodes in one process table never share a mark: one never ends the other's processes.
    marks = {procs.run_mark(str(tmp_path), n) for n in (None, 0, 1)}
    assert len(marks) == 3 and procs.run_mark(str(tmp_path)) == procs.run_mark(str(tmp_path) + "/.")


def test_a_failure_on_one_node_is_seen_by_the_others_and_the_first_failure_is_the_cause(make):
    n0, n1, n2 = (make(k, 3) for k in range(3))
    assert n0.peer_failed(4)() is None
    n2.ended(4, end("finished", None))  # a finish ends no other node's attempt
    assert n0.peer_failed(4)() is None
    n1.ended(4, end("crash", 10.0))
    n1.ended(3, end("crash", 1.0))  # another attempt's
    got = n0.peer_failed(4)()
    assert (got["node"], got["attempt"], got["cause"]["kind"]) == (1, 4, "crash")
    assert n1.peer_failed(4)() is None  # its own end is not a peer's
    n0.ended(4, end("peer", 10.5, node=1))
    n2.ended(4, end("hang", 9.0))
    ends = n0.ends(4)
    assert sorted(ends) == [0, 1, 2]
    assert nodes.first_cause(ends)["node"] == 2  # the hang came first
    assert [(s["node"], s["cause"]) for s in nodes.summary(ends)] == [(0, "peer"), (1, "crash"), (2, "hang")]
    n1.ended(4, end("crash", 10.0, gasp="dying gasp: rank 0 saved its replica at global step 9"))
    assert (
        nodes.gasp_words(None, n0.ends(4)) == "node 1: dying gasp: rank 0 saved its replica at global step 9"
    )
    # Junk on the board is ignored, never trusted.
    n0.board.put("end_6_1.json", {"cause": {"kind": "crash"}, "node": 1, "fault_at": "x"})
    n0.board.put("end_6_9.json", end("crash", 1.0, node=9))  # no such node
    assert n0.ends(6) == {} and n1.peer_failed(6)() is None


def test_junk_files_on_the_file_board_are_ignored(tmp_path):
    n0, n1 = (nodes.Nodes(str(tmp_path), k, 3) for k in range(2))
    n1.ended(4, end("crash", 1.0))  # makes the folder
    folder = runfiles.state_dir(tmp_path) / "nodes"
    (folder / "end_5_1.json").write_text(json.dumps({"cause": {"kind": "crash"}, "node": 1, "fault_at": "x"}))
    (folder / "end_5_2.json").write_text("{not json")
    (folder / "end_5_9.json").write_text(json.dumps(end("crash", 1.0, node=9)))  # no such node
    os.mkfifo(folder / "end_5_0.json")
    assert n0.ends(5) == {} and n1.peer_failed(5)() is None


def test_the_other_nodes_follow_node_0s_plan(make, monkeypatch):
    leader, follower = make(0, 2), make(1, 2)
    monkeypatch.setenv("RANKWATCH_TEST_GONE", "1")
    monkeypatch.setenv("RANKWATCH_TEST_KEPT", "same")
    env = {k: v for k, v in os.environ.items() if k != "RANKWATCH_TEST_GONE"}
    env.update({runfiles.RESUME_STEP_ENV: "20", **nodes.ended_env("abc123abc123"), procs.MARK_ENV: "m0"})
    leader.ended(1, end("crash", 1.0, node=0))
    leader.plan(1, policy.OK, env, 2, 4321)
    said: list[str] = []
    plan = follower.follow(1, {"kind": "peer"}, Signals(), said.append)
    assert (plan["action"], plan["next_attempt"], plan["master_port"]) == ("relaunch", 2, 4321)
    assert said[-1] == "node 0's plan: attempt 2 on master port 4321"
    mine = follower.environment(plan, "m1")
    assert mine[runfiles.RESUME_STEP_ENV] == "20" and mine[launchguard.ENDED_ENV] == "abc123abc123"
    assert "RANKWATCH_TEST_GONE" not in mine and mine["RANKWATCH_TEST_KEPT"] == "same"
    assert mine[procs.MARK_ENV] == "m1"  # its own mark, not node 0's
    assert "RANKWATCH_TEST_KEPT" not in plan["set"]  # only what changed travels
    # The end of the run: the same exit status on every node; the previous attempt's files are gone.
    leader.plan(2, policy.BUDGET, None, 3, None)
    assert follower.follow(2, {"kind": "peer"}, Signals(), said.append)["exit_code"] == policy.BUDGET
    assert leader.ends(1) == {} and leader.board.get("plan_1.json") is None


def test_a_plan_that_never_comes_or_is_junk_ends_the_node_with_status_1(make, monkeypatch):
    monkeypatch.setattr(nodes, "PLAN_WAIT_S", 0.5)
    follower = make(1, 2)
    follower.board.put(
        "plan_1.json",
        {"attempt": 1, "action": "relaunch", "exit_code": 0, "next_attempt": 2, "master_port": 99999},
    )
    said: list[str] = []
    plan = follower.follow(
        1, {"kind": "crash", "role": "worker", "rank": 3, "signal": "SIGKILL"}, Signals(), said.append
    )
    assert plan == {"action": "end", "exit_code": policy.FAILED}
    assert said[0] == "attempt 1 ended on node 1 (rank 3 killed by SIGKILL); waiting for node 0's plan"
    assert said[-1] == "node 0 wrote no plan after attempt 1 (waited 0.5 s); ending this node"


def test_a_node_stops_waiting_once_node_0s_supervisor_falls_silent(make, monkeypatch):
    """Node 0's lease (``leader.json``) is a counter read on the follower's own clock: while it moves
    the follower waits on; once it stands still for LEADER_SILENT_S, no plan will come."""
    monkeypatch.setattr(nodes, "LEASE_EVERY_S", 0.05)
    monkeypatch.setattr(nodes, "LEADER_SILENT_S", 1.0)
    monkeypatch.setattr(nodes, "LEASE_READ_S", 0.1)
    leader, follower = make(0, 2), make(1, 2)
    make(1, 2).start_lease()  # only node 0 has one
    assert follower.leader_beat() is None
    leader.start_lease()
    try:
        first = wait_for(follower.leader_beat, "node 0's first beat")
        waited = threading.Thread(target=lambda: result.append(follower.wait_plan(1, Signals())))
        result: list = []
        waited.start()
        waited.join(3.0)  # three times LEADER_SILENT_S: a live leader keeps it waiting
        assert waited.is_alive() and follower.leader_beat() > first
        leader.plan(1, policy.OK, None, 2, None)
        waited.join(10)
        assert result == [leader._read("plan_1.json")] and result[0]["action"] == "end"
    finally:
        leader.stop_lease()
    said: list[str] = []
    plan = follower.follow(2, {"kind": "peer"}, Signals(), said.append)  # node 0 gone before attempt 2's plan
    assert plan == {"action": "end", "exit_code": policy.FAILED}
    assert said[-1] == (
        "node 0 wrote no plan after attempt 2 (node 0's supervisor has been silent for 1 s (its node lost, "
        "or the supervisor killed)); ending this node"
    )


def test_a_plan_carries_only_rankwatchs_own_variables(make, monkeypatch):
    # The plan is a file in the run directory: whoever writes it must not choose LD_PRELOAD for every
    # node, nor unset PATH; the resume step still travels.
    monkeypatch.setenv("PATH", "/usr/bin")
    follower = make(1, 2)
    plan = {
        "action": "relaunch",
        "set": {"LD_PRELOAD": "/tmp/evil.so", runfiles.RESUME_STEP_ENV: "20", procs.MARK_ENV: "node0"},
        "unset": ["PATH", 7],
    }
    mine = follower.environment(plan, "m1")
    assert "LD_PRELOAD" not in mine and mine["PATH"] == "/usr/bin"
    assert mine[runfiles.RESUME_STEP_ENV] == "20" and mine[procs.MARK_ENV] == "m1"
    leader = make(0, 2)
    leader.plan(1, policy.OK, {**os.environ, "LD_PRELOAD": "x.so", runfiles.RESUME_STEP_ENV: "30"}, 2, 4321)
    written = follower.wait_plan(1, Signals())
    assert written["set"] == {runfiles.RESUME_STEP_ENV: "30"} and "PATH" not in written["unset"]


def test_the_launch_guard_passes_over_the_ranks_of_a_launch_every_node_ended():
    now = time.time()
    beat = {"rank": 1, "state": "training", "time": now - 1, "host": "elsewhere", "pid": 5, "launch": "old"}
    assert [r.rank for r in launchguard.live_ranks([(1, beat)], own_launch=None, host="here", now=now)] == [1]
    assert launchguard.live_ranks([(1, beat)], own_launch=None, host="here", now=now, ended="old") == []
    assert len(launchguard.live_ranks([(1, beat)], own_launch=None, host="here", now=now, ended="new")) == 1


def test_node_0_waits_for_every_node_boundedly_and_names_the_silent_one(make, monkeypatch):
    monkeypatch.setattr(nodes, "END_WAIT_S", 0.5)
    leader = make(0, 3)
    leader.ended(1, end("crash", 1.0))
    make(2, 3).ended(1, end("peer", 2.0))
    said: list[str] = []
    assert sorted(leader.wait_ends(1, Signals(), said.append)) == [0, 2]
    assert said == [
        "node(s) 1 did not report the end of attempt 1 within 0.5 s (a lost node, or its supervisor is gone)"
    ]


def test_a_second_ctrl_c_on_any_node_ends_it_at_once(tmp_path):
    follower = nodes.Nodes(str(tmp_path), 1, 2)
    # Its own attempt ended by a second Ctrl-C: no plan awaited (node 0 ends on its end file).
    plan = follower.follow(1, {"kind": "interrupted"}, Signals(), [].append)
    assert plan == {"action": "end", "exit_code": policy.INTERRUPTED}

    class Twice(Signals):
        count = 2

    said: list[str] = []
    assert nodes.Nodes(str(tmp_path), 0, 2).wait_ends(1, Twice(), said.append) == {} and said == []
