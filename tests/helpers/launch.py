"""Drive ``rankwatch launch`` around real msrun demo jobs (2 ranks, CPU) from tests.

Waiting polls the run directory or the supervisor's process, never a fixed
sleep; the timeouts are generous failure guards for a loaded machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from app.supervise import procs
from tests.helpers.jobs import BATCH, JOB_TIMEOUT_S, SAMPLES, JobFailed, steps_logged
from trainer_bridge.demo.__main__ import TRAIN_SCRIPT, free_port, job_env, msrun_command
from trainer_bridge.demo.mnist import write_mnist
from trainer_bridge.rundir import attempts, runfiles


class LaunchJob:
    """``python -m app.cli launch --run-dir RUN ... -- msrun ... train.py ...`` in a session of its own."""

    def __init__(
        self,
        run_dir: Path,
        train_args: list[str] | None = None,
        launch_args: list[str] | None = None,
        ranks: int = 2,
        samples: int = SAMPLES,
        script: Path = TRAIN_SCRIPT,
        join: bool = True,
        env: dict | None = None,
        batch: int = BATCH,
    ):
        self.run_dir = Path(run_dir)
        self.ranks = ranks
        self.steps_per_epoch = max(1, -(-samples // ranks) // batch)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        data = write_mnist(self.run_dir / "mnist", samples=samples)
        args = ["--run-dir", str(self.run_dir), "--data-dir", str(data), "--step-log"]
        args += ["--batch-size", str(batch), *(train_args or [])]
        cmd = msrun_command(self.run_dir, ranks, args, free_port(), script)
        if not join:  # the supervisor must behave the same whatever --join says
            cmd = [a.replace("--join=True", "--join=False") for a in cmd]
        self.cmd = [
            sys.executable,
            "-m",
            "app.cli",
            "launch",
            "--run-dir",
            str(self.run_dir),
            *(launch_args or []),
            "--",
            *cmd,
        ]
        self.env = {**job_env(), **(env or {})}
        self.env.pop(runfiles.RESUME_STEP_ENV, None)
        self.output_path = self.run_dir.parent / f"{self.run_dir.name}.launch.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> LaunchJob:
        self._out = open(self.output_path, "ab")
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        return self

    def __enter__(self) -> LaunchJob:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """The supervisor, then whatever of the run is left (a failed test must leave nothing training)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for p in procs.marked(procs.run_mark(str(self.run_dir))):
            try:
                p.kill()
            except psutil.Error:
                pass
        if getattr(self, "_out", None):
            self._out.close()

    def wait(self, timeout: float = 3 * JOB_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise JobFailed(f"rankwatch launch did not end within {timeout} s\n{self.output()}") from None

    def output(self) -> str:
        return self.output_path.read_text(errors="replace") if self.output_path.exists() else ""

    # ---------------------------------------------------------------- state

    def marked(self) -> list[psutil.Process]:
        """Every live process of the run (the supervisor's marker in its environment)."""
        return procs.marked(procs.run_mark(str(self.run_dir)))

    def workers(self) -> dict[int, psutil.Process]:
        """rank -> the live worker process of the current attempt."""
        out = {}
        for p in self.marked():
            try:
                env, cmdline = p.environ(), p.cmdline()
            except psutil.Error:
                continue
            # msrun's --join True also starts a `tail -f` per worker log, with the worker's environment.
            if env.get("MS_ROLE") != "MS_WORKER" or not any(a.endswith(".py") for a in cmdline):
                continue
            if (env.get("MS_NODE_ID") or "").isdigit():
                out[int(env["MS_NODE_ID"])] = p
        return out

    def heartbeat(self, rank: int) -> dict | None:
        return runfiles.read_json_or_none(runfiles.heartbeat_path(self.run_dir, rank))

    def rows(self) -> list[dict]:
        return self.rows_of(self.run_dir)

    @staticmethod
    def rows_of(run_dir: Path) -> list[dict]:
        """The run's attempts, folded as the dashboard folds them."""
        return attempts.fold(attempts.read_lines(run_dir)[0])

    def wait_until(self, predicate, what: str, timeout: float = JOB_TIMEOUT_S, poll: float = 0.1):
        """Poll ``predicate()`` until truthy; fail early if the supervisor ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                value = predicate()
                if value:
                    return value
                raise JobFailed(
                    f"rankwatch launch exited ({self.proc.returncode}) before {what}\n{self.output()}"
                )
            time.sleep(poll)
        raise JobFailed(f"timed out waiting for {what}\n{self.output()}")

    def steps_logged(self, rank: int) -> list[int]:
        return steps_logged(self.run_dir, rank)


def wait_gone(pids: list[int], timeout: float = 120.0) -> list[int]:
    """The pids still alive after waiting for all of them to go (a guard, not a measurement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def runs_row(root: Path, run_dir: Path) -> dict:
    """``rankwatch runs ROOT --json``'s row of ``run_dir``."""
    import json

    from click.testing import CliRunner

    from app.cli import main as cli_main

    body = json.loads(CliRunner().invoke(cli_main, ["runs", str(root), "--json"]).output)
    (row,) = [r for r in body["runs"] if r["id"].endswith(run_dir.name)]
    return row


def enforcing_dashboard(tmp_path: Path, skip: int):
    """``tmp_path/run`` and a real dashboard on it in ``SPIKE_MODE=enforce`` (a rollback skips ``skip``
    batches), with the tests' thresholds; the caller stops it."""
    from tests.helpers.app import FAST_SETTINGS, TOKEN
    from tests.helpers.liveserver import start_dashboard

    run = tmp_path / "run"
    run.mkdir()
    settings = {**FAST_SETTINGS, "TOKEN": TOKEN, "SPIKE_MODE": "enforce", "SKIP_BATCHES": skip}
    env = {f"RANKWATCH_{k}": str(v) for k, v in settings.items()}
    return run, start_dashboard(run, tmp_path / "dashboard.log", env=env)
