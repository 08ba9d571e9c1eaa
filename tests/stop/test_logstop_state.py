"""A log-mode job's end, with real processes: the run's state, the stop it could not obey, the CLI.

A stand-in for msrun (a real process) starts two workers whose stdout is
``worker_N.log``, as msrun does; its own output is ``msrun.log`` in the log
directory. It reaps its workers only once the test lets it (so a killed
worker stays a zombie until then), then prints msrun's last words
("Distributed job exited with exception") and exits. The whole msrun is in
``tests/stop/test_logstop_msrun.py``; here each moment can be held still.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from app.config import from_env
from app.run.jobend import StopInputs
from app.run.state import RunState
from tests.helpers.app import FAST_SETTINGS
from trainer_bridge.rundir import runfiles

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60

WORKER = (
    "import time\n"
    "for s in range(1, 4):\n"
    "    print(f'epoch: 1 step: {s}, loss is 2.{s}', flush=True)\n"
    "time.sleep(600)\n"
)
LAUNCHER = """\
import os, subprocess, sys, time
logs, n, worker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
procs = []
for r in range(n):
    with open(os.path.join(logs, f"worker_{r}.log"), "ab") as out:
        procs.append(subprocess.Popen([sys.executable, "-c", worker], stdout=out, stderr=subprocess.STDOUT))
print("pids", *[p.pid for p in procs], flush=True)
while not os.path.exists(os.path.join(logs, "reap")):
    time.sleep(0.05)
codes = [p.wait() for p in procs]
print("RuntimeError: Distributed job exited with exception. Please check logs in directory: " + logs, flush=True)
sys.exit(1)
"""


class FakeMsrun:
    def __init__(self, run: Path, ranks: int = 2):
        self.logs = run / "msrun_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        out = open(self.logs / "msrun.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCHER, str(self.logs), str(ranks), WORKER],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
        out.close()
        self.workers = self._pids(ranks)

    def _pids(self, ranks: int) -> list[int]:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for line in (self.logs / "msrun.log").read_text().splitlines():
                if line.startswith("pids "):
                    return [int(p) for p in line.split()[1:]]
            assert self.proc.poll() is None
            time.sleep(0.05)
        raise AssertionError("the fake msrun never started its workers")

    def kill_workers(self) -> None:
        for pid in self.workers:
            os.kill(pid, signal.SIGKILL)

    def let_it_end(self) -> None:
        (self.logs / "reap").touch()
        self.proc.wait(timeout=WAIT_S)

    def close(self) -> None:
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.let_it_end()


@pytest.fixture
def msrun(run_dir):
    job = FakeMsrun(run_dir)
    yield job
    job.close()


def make_state(run_dir) -> RunState:
    return RunState(run_dir, {**from_env({}), **FAST_SETTINGS})


def poll(st: RunState, predicate, what: str):
    deadline = time.monotonic() + WAIT_S
    snap = None
    while time.monotonic() < deadline:
        now = time.time()
        st.scan(now)
        snap = st.snapshot(now)
        if predicate(snap):
            return snap
        time.sleep(0.05)
    raise AssertionError(f"never {what}: {json.dumps(snap, indent=1)[:3000]}")


def training(snap) -> bool:
    return len(snap["ranks"]) == 2 and all(r["step"] == 3 and r["pid"] for r in snap["ranks"])


def test_the_run_ends_when_every_rank_died_and_msrun_said_so(run_dir, msrun):
    st = make_state(run_dir)
    poll(st, training, "showed both ranks training")
    msrun.kill_workers()
    # Killed, not yet reaped by msrun: the reason says so, and the run is not over while msrun runs.
    snap = poll(
        st,
        lambda s: all("not yet reaped by its parent" in (r["reason"] or "") for r in s["ranks"]),
        "showed the zombies",
    )
    assert snap["run"]["status"] == "running", snap["run"]
    assert st.job_ended() is None
    msrun.let_it_end()
    # The probe asks again, so the words follow the reaping; the run follows its ranks and msrun.
    snap = poll(
        st,
        lambda s: s["run"]["status"] == "ended" and all("is gone" in (r["reason"] or "") for r in s["ranks"]),
        "ended",
    )
    assert "2 gone" in snap["run"]["message"], snap["run"]
    assert [r["state"] for r in snap["ranks"]] == ["failed", "failed"]  # not "training" any more
    assert "msrun: Distributed job exited with exception" in snap["run"]["message"], snap["run"]
    # Log ranks report no rate: the job's throughput is unknown, not 0.
    assert snap["summary"]["throughput"] is None


def test_a_stop_the_job_ended_without_obeying_is_not_obeyed_and_re_armed(run_dir, msrun):
    from app.audit import AuditLog
    from app.stop.service import StopService

    st = make_state(run_dir)
    poll(st, training, "showed both ranks training")
    stop = StopService(
        str(run_dir),
        AuditLog(str(runfiles.state_dir(run_dir) / "audit.sqlite3")),
        deadline_s=30,
        auto_rearm=True,
    )
    rid, created, *_ = stop.request("ignored", "tester", None)
    assert created

    def tick():
        ranks, world = st.heartbeats()
        facts = st.job_facts()
        stop.tick(inputs=StopInputs(ranks, world, facts=facts))
        return stop.status(time.time(), StopInputs(ranks, world, st.log_stop_facts(), facts=facts))

    status = tick()
    # Every rank is behind, so none is named as holding the others up.
    assert status["state"] == "requested" and status["holding_up"] == []
    assert "may ignore the flag" in status["logs"]["note"]
    msrun.kill_workers()
    msrun.let_it_end()
    poll(st, lambda s: s["run"]["status"] == "ended", "ended")
    status = tick()
    assert status["state"] == "not_obeyed", status
    assert status["summary"].startswith("not obeyed: the job ended without stopping for it; ranks 0, 1"), (
        status
    )
    # Why each rank ended: the probe's words, or msrun's (it killed them all before saying so).
    assert all(r["not_obeyed"].startswith(("process ", "msrun: ")) for r in status["ranks"]), status["ranks"]
    flag = json.loads(runfiles.flag_path(run_dir).read_text())
    assert flag["GracefulExit"] == 0 and flag["outcome"] == "not obeyed"
    rows = [(r["action"], r["outcome"]) for r in reversed(stop.audit.rows(limit=10))]
    assert [a for a, _ in rows] == ["request", "complete", "rearm"], rows
    assert rows[1][1].startswith("not obeyed: ")
    # Once re-armed the panel still tells what happened to that stop.
    assert tick()["state"] == "not_obeyed"


def cli_stop(run_dir, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "stop", "--run-dir", str(run_dir), "--reason", "cli test", *extra],
        capture_output=True,
        text=True,
        timeout=WAIT_S * 2,
        cwd=REPO,
        env={**os.environ, "RANKWATCH_PROCESS_CHECK_AFTER_S": "1"},
    )


def test_cli_stop_warns_in_log_mode_and_reports_a_stop_the_job_did_not_obey(run_dir, msrun, start_process):
    poll(make_state(run_dir), training, "showed both ranks training")
    proc = start_process(
        [sys.executable, "-m", "app.cli", "stop", "--run-dir", str(run_dir), "--reason", "cli test"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    deadline = time.monotonic() + WAIT_S
    while not runfiles.flag_path(run_dir).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
        time.sleep(0.05)
    msrun.kill_workers()
    msrun.let_it_end()
    out, _ = proc.communicate(timeout=WAIT_S * 2)
    # The page's warning, then the truth: the job ended without obeying it (exit 1, not 0).
    assert "nothing in them shows that the script uses OnRequestExit: it may ignore the flag" in out, out
    assert "The stop was not obeyed: the job ended without stopping for it" in out, out
    assert "stops at its next step" not in out
    assert proc.returncode == 1, out
    assert json.loads(runfiles.flag_path(run_dir).read_text())["GracefulExit"] == 0


def test_cli_stop_warns_but_stops_a_job_that_only_its_files_call_ended(run_dir, msrun):
    """Ranks and msrun gone before this CLI first looked: their pids cannot be found any more, so
    only the logs say the job ended, and anything that writes them could say so (issue 32, P1)."""
    poll(make_state(run_dir), training, "showed both ranks training")
    msrun.kill_workers()
    msrun.let_it_end()
    result = CliRunner().invoke(main, ["stop", "--run-dir", str(run_dir), "--reason", "late", "--no-wait"])
    assert result.exit_code == 0, result.output
    assert "warning: The job has ended" in result.output and "Stop stays usable" in result.output
    assert runfiles.read_flag(run_dir).exit
