"""py-spy runs only on a process proven to be a rank of this run, and only the venv's py-spy runs.

A heartbeat is written by whoever can write the run directory, so the pid it
names proves nothing (issue 19, items 6 and 15). Each test starts a real
process, writes a heartbeat naming it as a stopped rank (the case where the
dashboard would reach for py-spy) and asks for its stack through the API.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from app.incidents.proof import START_WITHIN_S, prove_rank
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.incidents.test_stacks import HANGER, wait_for
from tests.incidents.test_stacks_api import app, auth  # noqa: F401  (the app fixture, with its token)
from trainer_bridge.rundir import pyspy, stackfiles


@pytest.fixture
def spawn():
    """Start real processes (stdout: a pipe saying "ready" for Python ones); all killed after."""
    procs = []

    def start(cmd, env=None, ready=True):
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        procs.append(proc)
        if ready:
            assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


def as_stopped_rank(client, run_dir, proc, *, started_at=None, rank=1):
    """Heartbeats naming ``proc`` as rank 1, which is then SIGSTOPped: a rank only py-spy can read."""
    write_job(run_dir, 2)
    created = psutil.Process(proc.pid).create_time()
    write_heartbeat(run_dir, heartbeat(0, 2))
    write_heartbeat(
        run_dir, heartbeat(rank, 2, pid=proc.pid, started_at=created if started_at is None else started_at)
    )
    os.kill(proc.pid, signal.SIGSTOP)

    # The row must be this process's: a second call finds the rank stalled
    # already, from the process before, until the dashboard reads the new heartbeat.
    def found():
        row = client.get("/api/ranks").get_json()["ranks"][rank]
        return row["pid"] == proc.pid and row["health"] == "stalled"

    wait_for(found, f"rank {rank} to be found stopped as pid {proc.pid}")


def refused(client, run_dir, rank=1) -> str:
    r = client.post(f"/api/ranks/{rank}/stack", json={}, headers=auth())
    body = r.get_json()
    assert r.status_code == 409 and body["status"] == 409, body
    everyone = client.post("/api/stacks", json={}, headers=auth()).get_json()
    assert rank not in everyone["py_spy"] and str(rank) in everyone["cannot"], everyone
    assert not stackfiles.capture_files(run_dir, rank), "nothing was dumped"
    return body["error"]


def dumped(client, rank=1) -> dict:
    r = client.post(f"/api/ranks/{rank}/stack", json={}, headers=auth())
    assert r.status_code == 202 and r.get_json()["via"] == "py-spy", r.get_json()

    def answered():
        got = client.get(f"/api/ranks/{rank}/stack")
        return got.status_code == 200 and got.get_json()

    return wait_for(answered, "the py-spy capture")


def test_a_process_that_is_not_a_rank_is_not_dumped(client, run_dir, spawn):
    proc = spawn(["sleep", "3600"], ready=False)
    as_stopped_rank(client, run_dir, proc)
    error = refused(client, run_dir)
    assert f"process {proc.pid} is not proven to be a rank of this run" in error
    assert str(run_dir) in error


def test_a_python_process_outside_the_run_is_not_dumped(client, run_dir, spawn):
    proc = spawn([sys.executable, "-c", HANGER])
    as_stopped_rank(client, run_dir, proc)
    assert "not proven to be a rank of this run" in refused(client, run_dir)


def test_another_users_process_is_not_dumped_even_if_it_names_the_run(client, run_dir, spawn):
    if os.geteuid() != 0:
        pytest.skip("starting a process as another uid needs root")
    proc = spawn(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", HANGER]
        + ["--run-dir", str(run_dir)]
    )
    assert psutil.Process(proc.pid).uids().real == 65534
    as_stopped_rank(client, run_dir, proc)
    error = refused(client, run_dir)
    assert "runs as uid 65534, not as the run directory's owner (uid 0)" in error


def test_a_process_naming_the_run_on_its_command_line_is_dumped(client, run_dir, spawn):
    proc = spawn([sys.executable, "-c", HANGER, f"--run-dir={run_dir}"])
    as_stopped_rank(client, run_dir, proc)
    body = dumped(client)
    assert body["source"] == "py-spy" and body["pid"] == proc.pid
    assert body["threads"][0]["frames"][0]["function"] == "hang_here"


def test_the_environment_at_exec_is_evidence_and_msrun_rank_id_must_match(client, run_dir, spawn):
    env = {**os.environ, "RANKWATCH_RUN_DIR": str(run_dir), "RANK_ID": "0"}
    wrong = spawn([sys.executable, "-c", HANGER], env=env)
    as_stopped_rank(client, run_dir, wrong)
    assert f"process {wrong.pid} is msrun's rank '0', not rank 1" in refused(client, run_dir)

    right = spawn([sys.executable, "-c", HANGER], env={**env, "RANK_ID": "1"})
    as_stopped_rank(client, run_dir, right)
    assert dumped(client)["pid"] == right.pid


def test_a_start_time_that_does_not_match_the_heartbeat_is_refused(run_dir, spawn):
    proc = spawn([sys.executable, "-c", HANGER, "--run-dir", str(run_dir)])
    created = psutil.Process(proc.pid).create_time()
    assert prove_rank(proc.pid, 1, created, run_dir)[0]
    ok, why = prove_rank(proc.pid, 1, created - 30, run_dir)  # the heartbeat's process started earlier
    assert not ok and "started after rank 1's bridge" in why
    ok, why = prove_rank(proc.pid, 1, created + START_WITHIN_S + 60, run_dir)
    assert not ok and "not the process that wrote it" in why
    ok, why = prove_rank(proc.pid, 1, None, run_dir)
    assert not ok and "start time" in why


def test_a_huge_environment_is_read_bounded_and_proves_nothing(run_dir, spawn):
    # 512 KiB of variables (one string may not pass 128 KiB), then the run directory.
    env = {**os.environ, **{f"BIG{i}": "x" * 64 * 1024 for i in range(8)}, "ZZ_RUN": str(run_dir)}
    proc = spawn([sys.executable, "-c", HANGER], env=env)
    created = psutil.Process(proc.pid).create_time()
    # The run directory is named past the bytes read: no evidence, and no unbounded read.
    ok, why = prove_rank(proc.pid, 1, created, run_dir)
    assert not ok and "not proven" in why


# ------------------------------------------------------------------ which py-spy


def test_a_pyspy_earlier_on_path_is_not_run(tmp_path, monkeypatch, spawn):
    marker = tmp_path / "ran"
    fake = tmp_path / "bin" / "py-spy"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {marker}\necho '[]'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    monkeypatch.delenv(pyspy.PYSPY_ENV, raising=False)
    proc = spawn([sys.executable, "-c", HANGER])

    exe = pyspy.find_pyspy()
    assert exe == str(Path(sys.executable).parent / "py-spy")
    threads, _ = pyspy.pyspy_threads(pyspy.pyspy_dump(proc.pid, native=False), proc.pid)
    assert threads[0]["frames"][0]["function"] == "hang_here"
    assert not marker.exists(), "the py-spy found on PATH ran"

    # An absolute setting is used as given; a bare name is refused, not looked up.
    monkeypatch.setenv(pyspy.PYSPY_ENV, str(fake))
    assert pyspy.find_pyspy() == str(fake)
    monkeypatch.setenv(pyspy.PYSPY_ENV, "py-spy")
    assert pyspy.find_pyspy() is None
    with pytest.raises(pyspy.PySpyError, match=pyspy.PYSPY_ENV):
        pyspy.pyspy_dump(proc.pid, native=False)
    assert not marker.exists()


def test_the_dashboard_runs_the_pyspy_of_its_setting(run_dir, spawn, tmp_path):
    from app import create_app
    from tests.conftest import FAST_SETTINGS

    marker = tmp_path / "ran"
    fake = tmp_path / "py-spy"
    fake.write_text(f"#!/bin/sh\ntouch {marker}\necho '[]'\n")
    fake.chmod(0o755)
    app_ = create_app(
        {
            "RUN_DIR": str(run_dir),
            "TESTING": True,
            "TOKEN": "stack-token",
            "PYSPY_PATH": str(fake),
            **FAST_SETTINGS,
        }
    )
    try:
        client = app_.test_client()
        proc = spawn([sys.executable, "-c", HANGER, "--run-dir", str(run_dir)])
        as_stopped_rank(client, run_dir, proc)
        dumped(client)
        assert marker.exists()
    finally:
        app_.extensions["rankwatch"].watcher.stop()
