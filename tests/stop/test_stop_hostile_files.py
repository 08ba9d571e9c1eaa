"""Issue 19: the graceful stop completes on a real 2-rank msrun job with hostile files in the run directory.

One job carries every hostile file at once (the per-path, per-kind fuzzer
is ``tests/stop/test_security_files.py``): a FIFO at ``stacks/all.request.json``
and at a rank's request (which froze every rank's reporter thread, so no
rank ever saw the flag), a FIFO at the flag lock, a FIFO heartbeat for a rank
the job does not have (which froze the watcher), a symlinked heartbeat
pointing outside, a socket among the captures a tokenless viewer lists, and
a device node at ``job.json``. The stop goes through the real dashboard's
``POST /api/exit``; the ranks must stop together and exit 0.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile

import pytest

from tests.helpers.heartbeats import heartbeat
from tests.helpers.jobs import dump
from trainer_bridge.rundir import runfiles

pytestmark = [pytest.mark.msrun]

SECRET = "outside-secret-5f4dcc3b5aa7"


def fifo(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)


def unix_socket(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    short = tempfile.mkdtemp(prefix="rws")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.path.join(short, "s"))
    finally:
        sock.close()
    os.rename(os.path.join(short, "s"), path)
    os.rmdir(short)


def test_graceful_stop_completes_with_hostile_files_in_the_run_directory(tmp_path, start_job, start_dash):
    run = tmp_path / "run"
    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps(heartbeat(0, 2, host=SECRET)))
    # Far more epochs than the test needs: the job ends by the stop, whatever the machine's speed.
    job = start_job(run, epochs=1000, step_delay=0.05)
    job.wait_for_step(3)
    state = runfiles.state_dir(run)
    # After the bridge started, so the request files are new requests to it.
    fifo(runfiles.stack_request_path(run, None))
    fifo(runfiles.stack_request_path(run, 1))
    fifo(state / ".flag.lock")
    fifo(runfiles.heartbeat_path(run, 7))
    os.symlink(outside, runfiles.heartbeat_path(run, 9))
    unix_socket(runfiles.stack_captures_dir(run, 0) / "99999999999999-request.json")
    job_json = runfiles.job_path(run)
    job_json.unlink()
    os.mknod(job_json, stat.S_IFCHR | 0o600, os.makedev(1, 5))

    dash = start_dash(run, tmp_path / "dashboard.log")
    # The ranks keep beating past the hostile files (a frozen reporter thread would not).
    beats = {r: job.heartbeat(r)["seq"] for r in (0, 1)}
    job.wait_until(
        lambda hbs: all(h and h["seq"] > beats[r] + 2 for r, h in enumerate(hbs)), "heartbeats going on"
    )
    rows = dash.wait_rows(lambda rows: rows if sorted(rows) == [0, 1] else None, "ranks 0 and 1 only")
    assert SECRET not in json.dumps(rows)
    assert "error" not in dash.get("/api/stacks")

    status, body = dash.post("/api/exit", {"reason": "hostile files in place"})
    assert status == 202, body
    # The FIFO at the lock is no lock: the stop went on without it, and said so.
    assert "not a regular file" in body["lock_error"], body
    assert job.wait() == 0, job.logs()
    stop_step, stops = job.stopped_together()
    assert all(s["request_id"] == body["request_id"] for s in stops), dump(stops)
    for r in (0, 1):
        assert job.steps_logged(r) == list(range(1, stop_step + 1))
    answer = dash.wait(
        lambda status: status if status["state"] in ("completed", "rearmed") else None,
        "the dashboard shows the stop completed",
        path="/api/exit",
    )
    assert answer["request"]["request_id"] == body["request_id"], dump(answer)
    assert sorted(r["rank"] for r in answer["ranks"]) == [0, 1]
