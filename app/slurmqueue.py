"""Slurm's view of the runs: one ``squeue --json`` for all of them, at most once per ``SLURM_POLL_S``.

With ``RANKWATCH_SLURM`` on, the runs table (``app/runs/rows.py``) asks
``SlurmQueue.by_run_dir()`` for every run at once: pending (with Slurm's
reason, ``Priority``, ``Resources``, ``JobHeldUser``...), running and on
which nodes, the time left. A job names its run directory as the batch
script of ``rankwatch slurm template`` does: ``--comment=rankwatch:PATH``
when the script fixes it, else ``SUBMIT_DIR/runs/JOB_NAME`` (the script's
default). Slurm 22.05's ``squeue --json`` (openapi v0.0.38, built in) is
the source; its output is bounded and each field checked, since any user
of the cluster names jobs and comments. The dashboard never cancels a job:
its Stop button writes the flag and the job ends by itself.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable

COMMENT_PREFIX = "rankwatch:"
MAX_OUTPUT_BYTES = 64 * 1024 * 1024
MAX_JOBS = 100_000
SQUEUE_TIMEOUT_S = 10.0
# squeue --json's states that a run directory's row shows; a finished job is the run's own business.
SHOWN = (
    "PENDING",
    "RUNNING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SUSPENDED",
    "COMPLETING",
    "PREEMPTED",
)


def _run_squeue() -> bytes:
    r = subprocess.run(["squeue", "--json"], capture_output=True, timeout=SQUEUE_TIMEOUT_S)
    if r.returncode != 0:
        raise OSError(r.stderr.decode(errors="replace").strip()[:300] or f"squeue exit {r.returncode}")
    return r.stdout


def _text(v, limit: int = 4096) -> str | None:
    return v[:limit] if isinstance(v, str) and v else None


def _number(v) -> float | None:
    if isinstance(v, dict):  # later openapi versions: {"set": true, "number": N}
        v = v.get("number") if v.get("set", True) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def parse(data: bytes, now: float) -> dict[str, dict]:
    """``squeue --json``'s jobs by run directory (absolute, normalised); ValueError on output that is not it."""
    if len(data) > MAX_OUTPUT_BYTES:
        raise ValueError("squeue --json answered more than 64 MiB")
    body = json.loads(data)
    jobs = body.get("jobs") if isinstance(body, dict) else None
    if not isinstance(jobs, list):
        raise ValueError("squeue --json: no jobs list")
    out: dict[str, dict] = {}
    for job in jobs[:MAX_JOBS]:
        if not isinstance(job, dict):
            continue
        state = job.get("job_state")
        state = state[0] if isinstance(state, list) and state else state
        if not isinstance(state, str) or state not in SHOWN:
            continue
        run_dir = run_dir_of(job)
        if run_dir is None:
            continue
        limit_min, started = _number(job.get("time_limit")), _number(job.get("start_time"))
        left = None
        if state == "RUNNING" and limit_min is not None and started:
            left = max(0.0, started + limit_min * 60 - now)
        restarts = _number(job.get("restart_cnt"))
        entry = {
            "kind": "slurm",
            "job_id": str(job.get("job_id"))[:64],
            "state": state,
            "reason": _text(job.get("state_reason"), 200) if state != "RUNNING" else None,
            "nodes": _text(job.get("nodes")) if state != "PENDING" else None,
            "partition": _text(job.get("partition"), 256),
            "time_left_s": left,
            "restart_count": int(restarts) if restarts is not None else 0,
        }
        if entry["reason"] == "None":
            entry["reason"] = None
        # Several jobs on one run directory (a requeue chain, an array): the running one, else the newest.
        have = out.get(run_dir)
        if have is None or (
            have["state"] != "RUNNING" and (state == "RUNNING" or entry["job_id"] > have["job_id"])
        ):
            out[run_dir] = entry
    return out


def run_dir_of(job: dict) -> str | None:
    """Where the job's batch script puts its run: its comment's path, else SUBMIT_DIR/runs/JOB_NAME."""
    comment = job.get("comment")
    if isinstance(comment, str) and comment.startswith(COMMENT_PREFIX):
        path = comment[len(COMMENT_PREFIX) :]
    else:
        cwd, name = job.get("current_working_directory"), job.get("name")
        if not (isinstance(cwd, str) and isinstance(name, str) and cwd and name) or "/" in name:
            return None
        path = os.path.join(cwd, "runs", name)
    if not path.startswith("/") or len(path) > 4096 or "\0" in path:
        return None
    return os.path.normpath(path)


class SlurmQueue:
    """The last answer of ``squeue --json``, asked again when older than ``poll_s`` (one call for all runs)."""

    def __init__(self, poll_s: float, run: Callable[[], bytes] = _run_squeue):
        self.poll_s = poll_s
        self._run = run
        self._lock = threading.Lock()
        self._at: float | None = None
        self._jobs: dict[str, dict] = {}
        self.error: str | None = None
        self.calls = 0

    def by_run_dir(self) -> dict[str, dict]:
        with self._lock:
            now = time.monotonic()
            if self._at is None or now - self._at >= self.poll_s:
                self._at = now
                self.calls += 1
                try:
                    self._jobs, self.error = parse(self._run(), time.time()), None
                except (OSError, ValueError, subprocess.SubprocessError) as e:
                    # Keep the last answer: a slow slurmctld must not blank the table.
                    self.error = f"squeue --json: {e}"[:300]
            return self._jobs
