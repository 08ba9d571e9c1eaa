"""Drive real demo jobs (``python -m trainer_bridge.demo``) from tests and benchmarks.

Waiting is always "poll the run directory until a condition holds or the
process died", never a fixed sleep; the timeouts are generous upper bounds for
a shared 2-core machine, not assertions about speed.
"""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.helpers.signals import on_terminal
from trainer_bridge.rundir import runfiles

# Upper bounds only: a job that takes longer is broken, not slow.
JOB_TIMEOUT_S = 300

# Epochs for a job a test stops (a flag, SIGTERM, the page): more than it can
# train before JOB_TIMEOUT_S, so it never ends on its own before the stop. A
# short job races the stop: on a loaded machine its agreements, and with them
# its heartbeats and flag polls, stretch past a second, and a 93-step job once
# finished before the test had even seen step 4.
UNTIL_STOPPED = 1000

# The tests' jobs train batches of 8 (the demo's default is 32): the same steps, files and
# protocol at a third of the compute per step (measured: 0.143 s -> 0.052 s a step, 2 ranks
# on the 2 shared cores, no step delay; a 30-step job's CPU 17.9 s -> 12.4 s, of which MindSpore's
# start and end are about 10 s). That leaves the cores room for make test's extra workers.
# The loss is noisier at 8, so the tests that judge the loss itself (spikes, rollbacks) and the
# benchmarks train at DEMO_BATCH.
BATCH = 8
DEMO_BATCH = 32  # the demo's --batch-size
SAMPLES = 500  # 31 steps an epoch on 2 ranks at BATCH, as 2,000 samples were at DEMO_BATCH
# For the jobs that judge the loss: the demo's batch and data, 31 steps an epoch on 2 ranks.
DEMO_DATA = {"batch": DEMO_BATCH, "samples": 2000}
# MindSpore's scheduler calls a worker lost when no heartbeat came from it for MS_NODE_TIMEOUT
# seconds (30 by default; MindSpore's dynamic-cluster docs), and msrun exits only then after a rank
# is killed. The tests' jobs run with NODE_TIMEOUT_S (tests/conftest.py): measured here, msrun exits
# 10 s after a kill -9 with 10, 33 s with the default, so each fault test saves about 15 s.
NODE_TIMEOUT_S = "15"
# A SIGSTOPped rank sends no heartbeat either: a test that keeps a rank stopped for a while (a hang,
# a webhook outage) runs its job with this, or MindSpore ends the job under it after NODE_TIMEOUT_S.
STOPPED_RANK_ENV = {"MS_NODE_TIMEOUT": "120"}


class JobFailed(AssertionError):
    pass


def wait_for_job(what: str, probe, job=None, timeout: float = JOB_TIMEOUT_S, every_s: float = 0.1):
    """Poll ``probe()`` until truthy and return it; past ``timeout`` (a failure guard), fail with the job's logs."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every_s)
    raise JobFailed(f"timed out waiting for {what}: {last}\n{job.logs() if job else ''}")


class DemoJob:
    """One ``msrun`` demo job writing into ``run_dir``."""

    def __init__(
        self,
        run_dir: Path,
        ranks: int = 2,
        epochs: int = 2,
        samples: int = SAMPLES,
        step_delay: float = 0.0,
        extra: list[str] | None = None,
        env: dict | None = None,
        terminal: bool = False,
        batch: int = BATCH,
    ):
        """``terminal``: started on a pty as its controlling terminal (``ctrl_c()`` types Ctrl-C there)."""
        self.run_dir = Path(run_dir)
        self.ranks = ranks
        self.terminal = terminal
        self._master: int | None = None
        self.steps_per_epoch = max(1, -(-samples // ranks) // batch)  # as the demo computes it
        self.cmd = [
            sys.executable,
            "-m",
            "trainer_bridge.demo",
            "--run-dir",
            str(self.run_dir),
            "--ranks",
            str(ranks),
            "--epochs",
            str(epochs),
            "--samples",
            str(samples),
            "--batch-size",
            str(batch),
            "--step-delay",
            str(step_delay),
            "--step-log",
            # No periodic checkpoints unless a test asks (extra's --ckpt-every wins).
            "--ckpt-every",
            "0",
            *(extra or []),
        ]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.output_path = self.run_dir.parent / f"{self.run_dir.name}.launcher.log"

    def start(self) -> DemoJob:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._out = open(self.output_path, "ab")
        if self.terminal:
            self._master, slave = pty.openpty()
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=slave,
                stdout=self._out,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=on_terminal,
            )
            os.close(slave)
            return self
        # A new session, so a test can signal the whole job without hitting pytest.
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        return self

    def ctrl_c(self) -> None:
        """Type Ctrl-C on the job's terminal: the line discipline sends SIGINT to its foreground group."""
        os.write(self._master, b"\x03")

    def __enter__(self) -> DemoJob:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # msrun starts each worker in a process group of its own (it kills
            # them with killpg), so the launcher's group does not hold them:
            # without this they trained on, orphaned, after a test ended.
            try:
                workers = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                workers = []
            os.killpg(self.proc.pid, signal.SIGKILL)
            for worker in workers:
                try:
                    worker.kill()
                except psutil.Error:
                    pass
            self.proc.wait()
        if getattr(self, "_out", None):
            self._out.close()
        if self._master is not None:
            os.close(self._master)
            self._master = None

    def wait(self, timeout: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise JobFailed(f"job did not finish within {timeout} s\n{self.logs()}") from None

    # ---------------------------------------------------------------- state
    def heartbeat(self, rank: int) -> dict | None:
        return runfiles.read_json_or_none(runfiles.heartbeat_path(self.run_dir, rank))

    def heartbeats(self) -> list[dict | None]:
        return [self.heartbeat(r) for r in range(self.ranks)]

    def wait_until(self, predicate, what: str, timeout: float = JOB_TIMEOUT_S, poll: float = 0.1):
        """Poll ``predicate(heartbeats)`` until truthy; fail early if the job died."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate(self.heartbeats())
            if value:
                return value
            if self.proc.poll() is not None:
                value = predicate(self.heartbeats())
                if value:
                    return value
                raise JobFailed(f"job exited ({self.proc.returncode}) before {what}\n{self.logs()}")
            time.sleep(poll)
        raise JobFailed(f"timed out waiting for {what}\n{self.logs()}")

    def wait_for_step(self, step: int) -> list[dict]:
        return self.wait_until(
            lambda hbs: hbs if all(h and h["global_step"] >= step for h in hbs) else None,
            f"every rank past step {step}",
        )

    def stopped_together(self) -> tuple[int, list[dict]]:
        """Assert the graceful stop's promise; return ``(stop step, each rank's stop record)``.

        Every rank exited for the same stop, at the same stop step, and none
        ran a step past it (``--step-log``).
        """
        hbs = self.heartbeats()
        assert all(h and h["state"] == "exited" for h in hbs), dump(hbs)
        stops = [h["stop"] for h in hbs]
        stop_step = stops[0]["stop_step"]
        assert all(s["stop_step"] == stop_step and s["stage"] == "exited" for s in stops), dump(stops)
        assert [self.steps_logged(r)[-1] for r in range(self.ranks)] == [stop_step] * self.ranks
        return stop_step, stops

    def epochs_past(self, step: int) -> int:
        """Epochs for a relaunch that resumes after global ``step`` and trains one more epoch or more."""
        return step // self.steps_per_epoch + 2

    def steps_logged(self, rank: int) -> list[int]:
        return steps_logged(self.run_dir, rank)

    def worker_log(self, rank: int) -> str:
        return worker_log(self.run_dir, rank)

    def logs(self, tail: int = 40) -> str:
        parts = []
        logs = self.run_dir / "msrun_logs"
        for path in [self.output_path, logs / "launcher.log", *sorted(logs.glob("worker_*.log"))]:
            if path.exists():
                lines = [
                    ln
                    for ln in path.read_text(errors="replace").splitlines()
                    if not ln.startswith(("[WARNING]", "[INFO]"))
                ]
                parts.append(f"--- {path.name}\n" + "\n".join(lines[-tail:]))
        return "\n".join(parts)


def worker_log(run_dir: Path, rank: int) -> str:
    path = run_dir / "msrun_logs" / f"worker_{rank}.log"
    return path.read_text(errors="replace") if path.exists() else ""


def steps_logged(run_dir: Path, rank: int) -> list[int]:
    """Global steps rank ``rank`` printed (the demo's ``--step-log``), in order."""
    return [int(m) for m in re.findall(r"^step (\d+) epoch", worker_log(run_dir, rank), re.M)]


def write_flag(run_dir: Path, request_id: str = "req-test", **extra) -> dict:
    return runfiles.write_flag(run_dir, True, request_id=request_id, requested_at=time.time(), **extra)


def dump(obj) -> str:
    return json.dumps(obj, indent=1, default=str)
