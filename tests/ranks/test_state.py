"""RunState against real run directories: change detection, deltas, history, job phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from app.config import from_env
from app.ranks import charts
from app.run import heartbeats as reader_module
from app.run.heartbeats import Stopped, probe_process, read_history_tail
from app.run.state import RunState
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.heartbeats import gone_pid, heartbeat, process_started, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles, schema


def make_state(run_dir, **overrides) -> RunState:
    return RunState(run_dir, {**from_env({}), **FAST_SETTINGS, **overrides})


def beat(run_dir, rank, world, seq, now=None, **kw):
    return write_heartbeat(run_dir, heartbeat(rank, world, seq=seq, now=now, **kw))


@pytest.fixture
def reads(monkeypatch):
    """Every path RunState reads and validates, in order."""
    seen = []
    real = schema.load

    def counting(model, path):
        seen.append(os.path.basename(path))
        return real(model, path)

    monkeypatch.setattr(reader_module.schema, "load", counting)
    return seen


def test_only_changed_heartbeat_files_are_read(run_dir, reads):
    write_job(run_dir, 4)
    for r in range(4):
        beat(run_dir, r, 4, seq=1)
    st = make_state(run_dir)
    st.scan(time.time())
    assert sorted(reads) == ["job.json", "rank_0.json", "rank_1.json", "rank_2.json", "rank_3.json"]
    reads.clear()
    st.scan(time.time())
    assert reads == []
    beat(run_dir, 2, 4, seq=2)
    st.scan(time.time())
    assert reads == ["rank_2.json"]


def test_first_push_carries_every_row_then_deltas_only_changed_fields(run_dir):
    write_job(run_dir, 2)
    now = time.time()
    beat(run_dir, 0, 2, seq=1, now=now)
    beat(run_dir, 1, 2, seq=1, now=now)
    st = make_state(run_dir)
    st.scan(now)
    event, payload = st.take_delta(now)
    assert event == "ranks_delta"
    assert [r["rank"] for r in payload["rows"]] == [0, 1]
    assert {"host", "pid", "health"} <= set(payload["rows"][0])
    assert st.take_delta(now) is None

    beat(run_dir, 1, 2, seq=2, now=now + 1)
    st.scan(now + 1)
    event, payload = st.take_delta(now + 1)
    assert event == "ranks_delta"
    (row,) = payload["rows"]
    assert row["rank"] == 1
    assert {"seq", "time", "global_step", "last_step_at"} <= set(row)
    assert not {"host", "pid", "health", "rss_bytes"} & set(row)
    assert st.take_delta(now + 1) is None


def test_time_alone_changes_a_verdict_and_pushes_it(run_dir):
    now = time.time()
    beat(run_dir, 0, 1, seq=1, now=now)
    st = make_state(run_dir)
    st.scan(now)
    st.take_delta(now)
    later = now + FAST_SETTINGS["STALL_MIN_S"] + 0.5
    st.scan(later)
    _, payload = st.take_delta(later)
    (row,) = payload["rows"]
    assert row["health"] == "stalled"
    assert set(row) <= {"rank", "health", "reason", "score"}
    assert payload["summary"]["counts"]["stalled"] == 1


def test_a_bad_file_keeps_the_last_good_heartbeat(run_dir):
    now = time.time()
    beat(run_dir, 0, 1, seq=5, now=now)
    st = make_state(run_dir)
    st.scan(now)
    runfiles.heartbeat_path(run_dir, 0).write_text('{"torn": ')
    st.scan(now + 0.1)
    assert st.snapshot(now + 0.1)["ranks"][0]["seq"] == 5


def test_missing_empty_started_partial_running_ended(run_dir):
    now = time.time()
    missing = make_state(run_dir / "nope")
    missing.scan(now)
    assert missing.snapshot(now)["run"]["status"] == "missing"
    assert "does not exist" in missing.snapshot(now)["run"]["message"]

    st = make_state(run_dir)
    st.scan(now)
    assert st.snapshot(now)["run"]["status"] == "waiting"
    assert "has not started" in st.snapshot(now)["run"]["message"]

    write_job(run_dir, 4)
    st.scan(now)
    snap = st.snapshot(now)
    assert snap["run"]["status"] == "starting" and "no rank has written" in snap["run"]["message"]
    assert [r["health"] for r in snap["ranks"]] == ["pending"] * 4

    pid = gone_pid()  # the ranks' process, gone by the end: a probe here proves the end
    beat(run_dir, 0, 4, seq=1, now=now, pid=pid)
    beat(run_dir, 1, 4, seq=1, now=now, pid=pid)
    st.scan(now)
    snap = st.snapshot(now)
    assert snap["world_size"] == 4
    assert "2 of 4 ranks have reported; waiting for ranks 2, 3" in snap["run"]["message"]
    assert [r["health"] for r in snap["ranks"]] == ["healthy", "healthy", "pending", "pending"]
    assert snap["summary"]["counts"]["pending"] == 2

    for r in range(4):
        beat(run_dir, r, 4, seq=2, now=now, state="finished", pid=pid)
    st.scan(now)
    assert st.snapshot(now)["run"] == {
        "status": "ended",
        "run_dir": str(run_dir),
        "message": "The job has ended: 4 finished.",
        "transport": "files",
        "proven": True,
    }


def test_world_size_from_heartbeats_when_job_json_is_missing(run_dir):
    now = time.time()
    beat(run_dir, 1, 3, seq=1, now=now)
    st = make_state(run_dir)
    st.scan(now)
    snap = st.snapshot(now)
    assert snap["world_size"] == 3
    assert "job.json is missing" in snap["run"]["message"]


def test_removed_ranks_force_a_snapshot(run_dir):
    now = time.time()
    for r in range(3):
        beat(run_dir, r, 3, seq=1, now=now)
    st = make_state(run_dir)
    st.scan(now)
    st.take_delta(now)
    runfiles.heartbeat_path(run_dir, 2).unlink()
    for r in range(2):
        beat(run_dir, r, 2, seq=2, now=now)
    st.scan(now)
    event, payload = st.take_delta(now)
    assert event == "ranks_snapshot"
    assert [r["rank"] for r in payload["ranks"]] == [0, 1]


def test_dead_pid_on_this_host_is_dead_before_the_heartbeat_timeout(run_dir):
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    pid = int(child.stdout)
    now = time.time()
    beat(run_dir, 0, 1, seq=1, now=now - 2, pid=pid, started_at=now - 3)
    st = make_state(run_dir)
    st.scan(now)
    row = st.snapshot(now)["ranks"][0]
    assert row["health"] == "dead"
    assert f"process {pid} is gone" in row["reason"]


def test_reused_pid_is_not_the_rank():
    assert probe_process(os.getpid(), process_started()) is None
    assert "newer process" in probe_process(os.getpid(), process_started() - 3600)


def test_fresh_ranks_are_not_probed(run_dir):
    probed = []
    now = time.time()
    beat(run_dir, 0, 1, seq=1, now=now)
    st = RunState(run_dir, {**from_env({}), **FAST_SETTINGS}, probe=lambda pid, started: probed.append(pid))
    st.scan(now + 0.5)
    assert probed == []
    st.scan(now + FAST_SETTINGS["PROCESS_CHECK_AFTER_S"] + 0.1)
    assert probed == [os.getpid()]


def test_a_rank_stopped_just_after_its_probe_is_never_announced_as_running(run_dir):
    """The silent rule says whether the process runs: the probe behind it is taken as the rank crosses
    STALL_MIN_S, not PROCESS_CHECK_AFTER_S earlier (CI: a SIGSTOP between the two read "still runs")."""
    settings = {**from_env({}), **FAST_SETTINGS, "PROCESS_CHECK_AFTER_S": 2.0}
    stopped = Stopped(f"process {os.getpid()} is stopped (SIGSTOP or a debugger)")
    answers = [None]  # what the probe finds: running, until the test stops it

    def probe(pid, started):
        return answers[-1]

    now = time.time()
    beat(run_dir, 0, 1, seq=1, now=now, pid=os.getpid(), started_at=process_started())
    st = RunState(run_dir, settings, probe=probe)
    st.scan(now + 2.0)  # late: probed, it runs
    answers.append(stopped)  # SIGSTOP now, before the rank crosses STALL_MIN_S (2.5 s)
    st.scan(now + 2.6)  # within PROCESS_CHECK_AFTER_S of the last probe, yet past the edge
    row = st.snapshot(now + 2.6)["ranks"][0]
    assert row["health"] == "stalled"
    assert row["reason"].startswith(f"process {os.getpid()} is stopped"), row["reason"]


def test_history_is_seeded_from_both_segments_and_bounded(run_dir):
    hist = runfiles.history_path(run_dir, 0)
    hist.parent.mkdir(parents=True)
    old = [
        {"time": 1000.0 + i, "global_step": i, "loss": 1.0, "step_time_ms": 5.0, "step_time_mean_ms": 5.0}
        for i in range(10)
    ]
    new = [
        {
            "time": 1010.0 + i,
            "global_step": 10 + i,
            "loss": 0.5,
            "step_time_ms": 6.0,
            "step_time_mean_ms": 6.0,
        }
        for i in range(3)
    ]
    hist.with_name(hist.name + ".1").write_text("".join(json.dumps(e) + "\n" for e in old))
    hist.write_text("".join(json.dumps(e) + "\n" for e in new) + '{"time": 10')
    entries = read_history_tail(run_dir, 0, 5)
    assert [gstep for _, gstep, _, _ in entries] == [8, 9, 10, 11, 12]

    beat(run_dir, 0, 1, seq=1, now=1013.0, history=False)
    st = make_state(run_dir, HISTORY_POINTS=6)
    st.scan(1013.5)
    matrix = charts.history(st)
    assert matrix["ranks"] == [0]
    assert matrix["t"] == [1008.0, 1009.0, 1010.0, 1011.0, 1012.0, 1013.0]
    assert matrix["step_time_ms"] == [[5.0, 5.0, 6.0, 6.0, 6.0, 50.0]]
    assert st.rank(0, 1013.5)["history"][-1]["global_step"] == 20


def test_history_matrix_buckets_and_gaps(run_dir):
    beat(run_dir, 0, 2, seq=1, now=2000.2, step_ms=10.0, history=False)
    beat(run_dir, 1, 2, seq=1, now=2000.7, step_ms=20.0, history=False)
    st = make_state(run_dir)
    st.scan(2001.0)
    beat(run_dir, 0, 2, seq=2, now=2002.1, step_ms=11.0, history=False)
    st.scan(2002.5)
    matrix = charts.history(st)
    assert matrix["t"] == [2000.0, 2001.0, 2002.0]
    assert matrix["step_time_ms"] == [[10.0, None, 11.0], [20.0, None, None]]
    assert charts.history(st, points=1)["t"] == [2002.0]
