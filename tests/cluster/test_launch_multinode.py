"""``rankwatch launch`` on two nodes: network namespaces, one shared run directory, a supervisor per node.

Node 0 (the leader: msrun's scheduler and rank 0) and node 1 (rank 1) each
run ``rankwatch launch`` around their own msrun (``tests/helpers/netns.py``).
A ``kill -9`` of rank 1 on node 1 ends attempt 1 on both nodes (after
rank 0, on node 0, saved its replica: the dying gasp across nodes); node 0
decides the relaunch and both start attempt 2 together, on one new master
port, from that set (``app/supervise/nodes.py``). Then ``rankwatch stop``
from the shell stops attempt 2 gracefully: both ranks save at one step, and
neither supervisor relaunches (a stop is never a failure).
One rank per node keeps the job small: the whole relaunch path runs, and
the suite pays for two ranks, not four. The supervisors meet once in the run
directory and once in a real ``redis-server`` in node 0's namespace
(``RANKWATCH_REDIS_URL``, ``app/supervise/board.py``).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from app.supervise import procs
from tests.helpers.faults import measure
from tests.helpers.jobs import BATCH, SAMPLES, UNTIL_STOPPED
from tests.helpers.launch import wait_gone
from tests.helpers.netns import LAUNCH_TIMEOUT_S, kill_tree, steps_logged
from tests.helpers.redisserver import RedisServer
from trainer_bridge.demo.__main__ import free_port
from trainer_bridge.demo.mnist import write_mnist
from trainer_bridge.rundir import attempts, ckptindex, runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.netns]

# 500 samples, 2 ranks, batch 8: 31 steps an epoch; sets every 10 steps. The job trains until the
# stop ends it (a job that could finish first would race the stop).
FAST = ["--backoff-s", "0.5", "--grace-s", "5"]


@pytest.fixture
def nodes(uplinked_nodes):
    return uplinked_nodes


def node_procs(run_dir, node: int) -> list[psutil.Process]:
    """The live processes of node ``node``'s supervisor (its own mark: the nodes share one process table)."""
    return procs.marked(procs.run_mark(str(run_dir), node))


def worker(run_dir, node: int) -> psutil.Process:
    for p in node_procs(run_dir, node):
        try:
            if p.environ().get("MS_ROLE") == "MS_WORKER" and any(a.endswith(".py") for a in p.cmdline()):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of node {node} found")


def step(run_dir, rank: int) -> int:
    hb = runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, rank)) or {}
    return hb.get("global_step") or 0


def ports(log: str) -> dict[int, int]:
    """attempt -> the master port its msrun command line named, from a supervisor's output."""
    return {int(n): int(p) for n, p in re.findall(r"attempt (\d+): .*--master_port=(\d+)", log)}


def wait_until(predicate, what: str, sups: list[subprocess.Popen], logs) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        if predicate():
            return
        if any(p.poll() is not None for p in sups):
            raise AssertionError(f"a supervisor exited before {what}\n{output(logs)}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}\n{output(logs)}")


def trained_again(run_dir, rank: int) -> bool:
    """Rank ``rank`` of attempt 2 (resumed from a set) trained three steps past its set."""
    hb = runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, rank)) or {}
    resumed = (hb.get("resumed_from") or {}).get("global_step")
    return resumed is not None and (hb.get("global_step") or 0) >= resumed + 3


def redis_fields(redis: RedisServer) -> set[str]:
    import redis as client

    got = client.Redis.from_url(redis.url).hkeys("rankwatch:two:nodes")
    return {f.decode() for f in got}


def output(logs) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}" for p in logs if p.exists())


@pytest.mark.parametrize("board", ["files", "redis"])
def test_a_rank_killed_on_node_1_ends_the_attempt_on_both_nodes_and_both_relaunch_together(
    nodes, tmp_path, board
):
    run_dir = tmp_path / "run"
    redis = env = None
    if board == "redis":
        node0 = nodes.nodes[0]
        redis = RedisServer(
            tmp_path, bind=(nodes.uplink_addr, node0.addr), prefix=["ip", "netns", "exec", node0.netns]
        ).start()
        env = {"RANKWATCH_REDIS_URL": f"redis://{node0.addr}:{redis.port}/0", "RANKWATCH_REDIS_JOB": "two"}
    data = write_mnist(run_dir / "mnist", samples=SAMPLES)
    train = ["--run-dir", str(run_dir), "--data-dir", str(data), "--epochs", str(UNTIL_STOPPED), "--step-log"]
    train += ["--step-delay", "0.05", "--ckpt-every", "10", "--batch-size", str(BATCH)]
    logs = [tmp_path / f"node{n}.launch.log" for n in range(2)]
    first_port = free_port()
    sups = [
        nodes.supervised(
            n, run_dir, train, FAST, local_workers=1, master_port=first_port, log_path=logs[n], env=env
        )
        for n in range(2)
    ]
    try:
        wait_until(lambda: step(run_dir, 1) >= 12, "rank 1 past global step 12", sups, logs)
        first = [p.pid for n in range(2) for p in node_procs(run_dir, n)]
        killed_at = step(run_dir, 1)
        worker(run_dir, 1).send_signal(signal.SIGKILL)
        t_kill = time.time()
        wait_until(lambda: len(attempts.fold(attempts.read_lines(run_dir)[0])) >= 2, "attempt 2", sups, logs)
        # Both nodes ended attempt 1 before either started attempt 2: nothing of it is left.
        assert wait_gone(first, timeout=5) == [], "a process of attempt 1 outlived it"
        wait_until(lambda: all(trained_again(run_dir, r) for r in (0, 1)), "attempt 2 training", sups, logs)
        # A graceful stop from the shell, through the run directory both nodes share.
        stop = subprocess.run(
            [sys.executable, "-m", "app.cli", "stop", "--run-dir", str(run_dir), "--reason", "two nodes"],
            capture_output=True,
            text=True,
            timeout=LAUNCH_TIMEOUT_S,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in sups]
        assert codes == [0, 0], output(logs)
    finally:
        for p in sups:
            kill_tree(p)
        for n in range(2):
            for p in node_procs(run_dir, n):
                p.kill()
        if redis is not None:
            met = redis_fields(redis)
            redis.stop()
    if board == "redis":
        # They met in Redis alone: no record in the run directory, the last attempt's plan in the hash.
        assert not (runfiles.state_dir(run_dir) / "nodes").exists()
        assert "plan_2.json" in met and "end_2_1.json" in met, met
    said = [log.read_text(errors="replace") for log in logs]
    # The same new master port on both nodes' attempt 2 (node 0 chose it; node 1 followed the plan).
    assert ports(said[0])[1] == ports(said[1])[1] == first_port, said
    assert ports(said[0])[2] == ports(said[1])[2] != first_port, said
    assert "node 0's plan: attempt 2 on master port" in said[1]
    where = "Redis at redis://" if board == "redis" else "the run directory"
    assert all(f"node {n} of 2; the nodes meet in {where}" in said[n] for n in (0, 1)), said
    # One supervised line per attempt (node 0's), with both nodes' ends inside.
    lines = attempts.read_lines(run_dir, with_refused=True)[0]
    assert [r["attempt"] for r in lines if r["kind"] == "supervised"] == [1, 2], lines
    # Rank 0 of attempt 2 did not take rank 1's fresh heartbeat on node 1 (no pid to probe across hosts)
    # for a live launch: node 0's plan named attempt 1's launch as ended on every node.
    assert attempts.refused(lines) == []
    a, b = attempts.fold(attempts.read_lines(run_dir)[0])
    cause = a["cause"]
    assert (cause["kind"], cause["rank"], cause["signal"]) == ("crash", 1, "SIGKILL"), cause
    assert cause["host"] == nodes.nodes[1].hostname
    assert [(n["node"], n["cause"]) for n in a["supervisor"]["nodes"]] == [(0, "peer"), (1, "crash")]
    assert a["restarted_by"] == "launch"
    # Node 1 had no survivor: it asked the other node's ranks, and rank 0 (on node 0) saved its replica
    # at its last finished step before node 0 ended; attempt 2 resumed on both ranks from that set.
    resumed = b["resumed_from"]["global_step"]
    assert a["supervisor"]["resume"]["global_step"] == resumed and resumed >= killed_at - 1
    assert b["resumed_from"]["set"].startswith("ttp_checkpoints/ttp_saved_checkpoints-step_{G}/"), b
    assert f"node 1: dying gasp: rank 0 saved its replica at global step {resumed}" in a["supervisor"]["note"]
    # Attempt 2 stopped gracefully on both nodes at one step, each rank's checkpoint there, and was
    # not relaunched: no attempt 3, and both supervisors exited 0.
    beats = [runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, r)) for r in (0, 1)]
    stopped_at = {hb["stop"]["stop_step"] for hb in beats}
    assert len(stopped_at) == 1 and all(hb["state"] == "exited" for hb in beats), beats
    (stop_step,) = stopped_at
    assert resumed < stop_step and b["last_step"] == stop_step
    for rank in (0, 1):
        logged = steps_logged(run_dir, rank)
        assert logged[0] == resumed + 1 and logged[-1] == stop_step, (rank, logged[:3], logged[-3:])
    assert ckptindex.scan(run_dir, 2).newest_complete.global_step == stop_step
    assert b["end"] == "graceful_stop" and b["supervisor"]["nodes"] and b["cause"]["kind"] == "stop", b
    assert b["restarted_by"] is None
    assert node_procs(run_dir, 0) == node_procs(run_dir, 1) == []
    sup = a["supervisor"]
    measure("launch on two nodes: kill -9 to node 1's detection", sup["detected_at"] - t_kill)
    measure("launch on two nodes: kill -9 to the relaunch", sup["relaunched_at"] - t_kill)
