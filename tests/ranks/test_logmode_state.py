"""Ranks shown from msrun's worker logs: rows, verdicts, world size, the bridge winning, the stop panel.

Real files in a real run directory; a rank's "process" is a real child
process whose stdout is its worker log, as msrun starts them, so liveness is
probed for real. Time is the ``now`` given to ``scan`` and the files' mtimes
(set with ``os.utime``), never a sleep.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.config import from_env
from app.run import judging, stepcost
from app.run.health import judge_all
from app.run.logmode import resolve_dir
from app.run.logmode.patterns import LAUNCHER, SCHEDULER, WORKER
from app.run.state import RunState
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.ranks import TH as JUDGING_TH
from tests.helpers.ranks import Rank as JudgedRank
from tests.helpers.workerlogs import LOSS, logs_dir


def make_state(run_dir, **overrides) -> RunState:
    return RunState(run_dir, {**from_env({}), **FAST_SETTINGS, **overrides})


def write(path: Path, text: str, mtime: float | None = None) -> None:
    with open(path, "a") as f:
        f.write(text)
    if mtime is not None:
        os.utime(path, (mtime, mtime))


def rows(st: RunState, now: float) -> dict[int, dict]:
    return {r["rank"]: r for r in st.snapshot(now)["ranks"]}


def test_log_ranks_show_step_loss_step_time_and_age(run_dir):
    logs = logs_dir(run_dir)
    t0 = time.time() - 100
    for r in (0, 1):
        write(logs / f"worker_{r}.log", "some start-up chatter\n", t0)
    st = make_state(run_dir)
    st.scan(t0 + 1)
    first = rows(st, t0 + 1)
    assert [first[r]["source"] for r in (0, 1)] == ["log", "log"]
    assert first[0]["state"] == "starting" and first[0]["health"] == "starting"
    assert first[0]["reason"] == "up, no step in its log yet (compiling?)"
    # Five steps, 0.2 s apart, each rank; the dashboard looks after each.
    for s in range(1, 6):
        for r in (0, 1):
            write(logs / f"worker_{r}.log", LOSS.format(e=1, s=s, loss=2.3 - s / 100), t0 + 1 + s * 0.2)
        st.scan(t0 + 1.05 + s * 0.2)
    now = t0 + 2.5
    got = rows(st, now)
    for r in (0, 1):
        row = got[r]
        assert (row["source"], row["state"], row["health"]) == ("log", "training", "healthy")
        assert (row["epoch"], row["step"], row["global_step"], row["loss"]) == (1, 5, 5, 2.25)
        assert row["step_time_ms"] == pytest.approx(200.0, abs=0.5)
        assert row["heartbeat_age_s"] == pytest.approx(now - (t0 + 2.0), abs=0.05)
        assert row["cpu_percent"] is None and row["rss_bytes"] is None and row["stop_stage"] is None
    assert st.snapshot(now)["world_size"] == 2
    assert "from msrun's worker logs" in st.summary(now)["run"]["message"]
    # Chart history comes from the same slots.
    history = st.rank(0, now)["history"]
    assert history[-1]["global_step"] == 5 and history[-1]["loss"] == 2.25


def test_a_quiet_log_is_stalled_after_its_own_pace_not_after_a_heartbeat_timeout(run_dir):
    logs = logs_dir(run_dir)
    t0 = time.time() - 1000
    path = logs / "worker_0.log"
    st = make_state(run_dir)
    # A log printed every 3 s (per_print_times=30 at 100 ms a step): quiet for 3 s is normal.
    for i in range(1, 5):
        write(path, LOSS.format(e=1, s=30 * i, loss=2.0), t0 + 3 * i)
        st.scan(t0 + 3 * i + 0.01)
    last = t0 + 12
    st.scan(last + 10)  # 10 s quiet: more than STALL_MIN_S (2.5 s), less than 5 x its 3 s pace
    assert rows(st, last + 10)[0]["health"] == "healthy"
    st.scan(last + 16)
    row = rows(st, last + 16)[0]
    assert row["health"] == "stalled"
    assert row["reason"].startswith("no step in its log for over 15 s (last: global step 120)")
    assert "cannot be checked from this host" in row["reason"]
    # Never "dead" from silence alone: a log has no heartbeat to lose.
    st.scan(last + 5000)
    assert rows(st, last + 5000)[0]["health"] == "stalled"


def test_a_traceback_fails_the_rank_with_the_error_from_its_log(run_dir):
    logs = logs_dir(run_dir)
    write(logs / "worker_0.log", LOSS.format(e=1, s=1, loss=2.3))
    write(
        logs / "worker_1.log",
        LOSS.format(e=1, s=1, loss=2.3)
        + 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\n'
        + "RuntimeError: Out of memory: device 1 could not allocate 512 MB\n",
    )
    st = make_state(run_dir)
    now = time.time()
    st.scan(now)
    row = rows(st, now)[1]
    assert (row["health"], row["state"]) == ("failed", "failed")
    assert row["reason"] == "failed: RuntimeError: Out of memory: device 1 could not allocate 512 MB"


def test_the_bridge_wins_where_it_writes_heartbeats(run_dir):
    logs = logs_dir(run_dir)
    for r in (0, 1):
        write(logs / f"worker_{r}.log", LOSS.format(e=1, s=3, loss=1.0))
    now = time.time()
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1, now=now, global_step=40))
    st = make_state(run_dir)
    st.scan(now)
    got = rows(st, now)
    assert (got[0]["source"], got[0]["global_step"], got[0]["cpu_percent"]) == ("bridge", 40, 98.5)
    assert (got[1]["source"], got[1]["global_step"]) == ("log", 3)
    # The stop panel counts only the rank no bridge reports.
    assert st.log_stop_facts()["ranks"] == 1


def test_world_size_from_the_scheduler_log_and_ranks_not_yet_logging_are_pending(run_dir):
    logs = logs_dir(run_dir)
    registered = next(p for p in SCHEDULER if p.kind == "registered").example
    write(
        logs / "scheduler.log",
        registered.replace("expected node number: 2", "expected node number: 4") + "\n",
    )
    write(logs / "worker_0.log", LOSS.format(e=1, s=1, loss=2.3))
    write(logs / "worker_1.log", LOSS.format(e=1, s=1, loss=2.3))
    st = make_state(run_dir)
    now = time.time()
    st.scan(now)
    snap = st.snapshot(now)
    assert snap["world_size"] == 4
    assert [r["health"] for r in snap["ranks"]] == ["healthy", "healthy", "pending", "pending"]
    assert snap["ranks"][0]["host"] == "vm"  # as the scheduler registered it
    # job.json, the bridge's word, wins over the logs'.
    write_job(run_dir, 3)
    st.scan(now + 0.1)
    assert st.snapshot(now + 0.1)["world_size"] == 3


def test_a_rank_the_scheduler_saw_leave_cleanly_finished(run_dir):
    logs = logs_dir(run_dir)
    write(logs / "worker_0.log", LOSS.format(e=2, s=10, loss=0.5))
    left = next(p for p in SCHEDULER if p.kind == "unregistered").example
    write(logs / "scheduler.log", left + "\n")
    st = make_state(run_dir)
    now = time.time()
    st.scan(now)
    row = rows(st, now)[0]
    assert (row["health"], row["reason"]) == ("finished", "finished training at epoch 2 step 10")
    assert st.summary(now)["run"]["status"] == "ended"


@pytest.fixture
def worker(run_dir):
    """A real process whose stdout is worker_1.log, as msrun starts a rank; killed after the test."""
    path = logs_dir(run_dir) / "worker_1.log"
    code = (
        "import time\n"
        "for s in range(1, 4):\n"
        "    print(f'epoch: 1 step: {s}, loss is 2.{s}', flush=True)\n"
        "time.sleep(600)\n"
    )
    with open(path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def poll(st: RunState, rank: int, predicate, what: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    row = None
    while time.monotonic() < deadline:
        now = time.time()
        st.scan(now)
        row = rows(st, now).get(rank)
        if row is not None and predicate(row):
            return row
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} never {what}: {row}")


def test_a_killed_rank_is_dead_with_its_pid_and_msruns_words(run_dir, worker):
    st = make_state(run_dir)
    row = poll(st, 1, lambda r: r["step"] == 3 and r["pid"] == worker.pid, "showed its pid")
    assert row["host"] == st._hostname and row["health"] == "healthy"
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    # msrun's own output, redirected into the log directory, names the pid and the signal.
    exit_line = next(p for p in LAUNCHER if p.kind == "worker_exit").example.replace("10211", str(worker.pid))
    write(logs_dir(run_dir) / "msrun.log", exit_line + "\n")
    row = poll(st, 1, lambda r: r["health"] == "dead", "turned dead")
    assert row["reason"] == (
        f"process {worker.pid} is gone (host {st._hostname}); msrun: Worker process {worker.pid} exit with "
        "exception. Error code: -9 (killed by SIGKILL, signal 9)"
    )


def test_msruns_word_alone_marks_a_rank_dead_once_its_log_is_late(run_dir):
    logs = logs_dir(run_dir)
    t0 = time.time() - 50
    write(logs / "worker_0.log", LOSS.format(e=1, s=3, loss=2.0), t0)
    timed_out = next(p for p in SCHEDULER if p.kind == "timed_out").example
    write(logs / "scheduler.log", timed_out + "\n")
    st = make_state(run_dir)
    st.scan(t0 + 0.5)  # the log is fresh: an old line cannot outweigh it
    assert rows(st, t0 + 0.5)[0]["health"] == "healthy"
    st.scan(t0 + 30)
    row = rows(st, t0 + 30)[0]
    assert row["health"] == "dead"
    assert row["reason"].startswith("msrun's scheduler: The node: 0 is timed out.")


def test_stop_facts_look_for_on_request_exit_in_the_logs(run_dir, app, client):
    logs = logs_dir(run_dir)
    write(logs / "worker_0.log", LOSS.format(e=1, s=1, loss=2.3))
    body = client.get("/api/exit").get_json()
    assert body["bridge_seen"] is False
    assert body["logs"]["ranks"] == 1 and body["logs"]["on_request_exit"] is None
    assert body["logs"]["cannot_show"] == ["cpu_percent", "rss_bytes", "device", "stop_stage"]
    assert body["estimate"]["seconds"] is None  # nothing reports a step time to estimate from
    triggered = next(p for p in WORKER if p.kind == "graceful_exit").example
    write(logs / "worker_0.log", triggered + "\n")
    body = client.get("/api/exit").get_json()
    assert body["logs"]["on_request_exit"] == "worker_0.log: Graceful exit is triggered, stop training."
    ranks = client.get("/api/ranks").get_json()["ranks"]
    assert ranks[0]["state"] == "stopping" and ranks[0]["source"] == "log"


def test_bad_log_files_are_bounded_and_harmless(run_dir):
    logs = logs_dir(run_dir)
    (logs / "worker_0.log").write_bytes(os.urandom(200_000))
    (logs / "worker_99999999.log").write_text(LOSS.format(e=1, s=1, loss=1))  # beyond any job
    os.mkfifo(logs / "worker_1.log")  # opening it would block: not a regular file, not read
    (logs / "worker_2.log").symlink_to("/dev/zero")
    st = make_state(run_dir)
    now = time.time()
    st.scan(now)
    got = rows(st, now)
    # Only the regular file within bounds is a rank (the FIFO, the symlink and rank 99999999 are not).
    assert sorted(got) == [0]
    assert got[0]["state"] == "starting" and got[0]["source"] == "log"


def test_log_dir_setting():
    assert resolve_dir("/runs/a", "") == Path("/runs/a/msrun_logs")
    assert resolve_dir("/runs/a", "logs/msrun") == Path("/runs/a/logs/msrun")
    assert resolve_dir("/runs/a", "/var/log/job") == Path("/var/log/job")
    assert resolve_dir(None, "") is None


def test_a_log_without_any_step_line_says_so_after_a_while(run_dir):
    logs = logs_dir(run_dir)
    write(
        logs / "worker_0.log", "".join(f"my own format: iteration {i}, objective 0.5\n" for i in range(250))
    )
    st = make_state(run_dir)
    now = time.time()
    st.scan(now)
    row = rows(st, now)[0]
    assert row["state"] == "starting"
    assert row["warnings"] == [
        "no line of worker_0.log looks like a training step yet (250 lines read): "
        "see the formats understood in docs/training-scripts.md, Log mode"
    ]


@pytest.mark.parametrize("seed", range(20))
def test_the_verdict_board_equals_judge_all_for_log_ranks(seed):
    """The incremental board (app.run.judging) and the reference rules agree when some ranks are log ranks."""
    rnd = random.Random(seed)
    world = rnd.choice([2, 5, 9])
    now = 1_800_000_000.0
    ranks: dict[int, JudgedRank] = {}
    from_log = {r for r in range(world) if rnd.random() < 0.6}
    pace = {r: rnd.choice([None, 50.0, 3000.0, 20000.0]) for r in from_log}
    board = judging.VerdictBoard(JUDGING_TH)
    probes: dict[int, tuple] = {}
    for _tick in range(60):
        now += rnd.choice([0.1, 0.5, 1.0, 3.0, 7.0, 30.0])
        board.set_view(set(range(world)) | set(ranks))
        for r in range(world):
            if rnd.random() < 0.4:
                ranks.setdefault(r, JudgedRank(r, world, rnd, now)).beat(now)
                rk = ranks[r]
                board.observe(
                    r,
                    stepcost.RankReport.of(rk.hb, rk.window, from_log=r in from_log, log_pace_ms=pace.get(r)),
                )
        if ranks and rnd.random() < 0.3:
            r = rnd.choice(sorted(ranks))
            probes[r] = rnd.choice(
                [("process 1 is gone", None, False), (None, None, True), (None, None, False)]
            )
            board.set_probe(r, *probes[r])
        # A straggler stays one until clearly back (hysteresis): both sides are told who was one.
        before = {r for r, v in board.verdicts.items() if v.health == "straggler"}
        board.update(now)
        view = set(range(world)) | set(ranks)
        expected = judge_all(
            {r: (ranks[r].hb if r in ranks else None) for r in view},
            {r: (ranks[r].window.median_ms if r in ranks else None) for r in view},
            now,
            JUDGING_TH,
            {r: p[0] for r, p in probes.items() if p[0]},
            {r: (ranks[r].window.split_ms if r in ranks else None) for r in view},
            process_alive={r for r, p in probes.items() if p[2]},
            steps={r: ranks[r].window.steps for r in view if r in ranks},
            log_pace={r: pace[r] for r in from_log if r in ranks},
            stragglers=before,
        )
        assert board.verdicts == expected, f"seed {seed}, t={now}"
    # Log ranks are never "dead" from silence alone, nor a lost node.
    silent = {r: v for r, v in board.verdicts.items() if r in from_log and r not in probes}
    assert all(
        v.health not in ("dead", "node_lost") or v.reason.startswith("process") for v in silent.values()
    )
