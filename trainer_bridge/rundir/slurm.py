"""What the run directory holds of Slurm: the scheduler record and the signal note.

* ``scheduler(env)``: the ``scheduler`` of a supervised attempt line
  (``schema.Scheduler``), from Slurm's variables; None outside Slurm.
* The signal note, ``RUN/rankwatch/slurm_signal.json``: written when Slurm
  signals the job (``rankwatch slurm signalled``, called by the batch
  script's trap, or ``rankwatch launch`` itself on SIGTERM under Slurm), read
  by ``rankwatch launch`` when the graceful stop it served ends the attempt:
  a stop that follows a note is ``preempted``, not ``stop``. The file is
  untrusted input like every other: read bounded and validated.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from trainer_bridge.rundir import runfiles, schema

NOTE = "slurm_signal.json"
MAX_NOTE_BYTES = 4096
# Variables that steer the record: the job, its array task, its requeues, where it runs.
FIELDS = {
    "job_id": "SLURM_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "partition": "SLURM_JOB_PARTITION",
    "nodelist": "SLURM_JOB_NODELIST",
    "job_name": "SLURM_JOB_NAME",
}


def scheduler(env: Mapping[str, str] | None = None) -> dict | None:
    """The Slurm record of this process's job, or None when not in a Slurm job (or its variables are bad)."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    record: dict = {"kind": "slurm"}
    for key, var in FIELDS.items():
        value = env.get(var)
        if value:
            record[key] = value
    count = record.get("restart_count", "0")
    record["restart_count"] = int(count) if count.isdigit() else 0
    try:
        return schema.build(schema.Scheduler, **record).model_dump()
    except schema.SchemaError:
        return None


def note_path(run_dir) -> Path:
    return runfiles.state_dir(run_dir) / NOTE


def write_note(
    run_dir, signal: str, at: float, time_left_s: float | None, job_id: str | None, restart_count: int = 0
) -> dict:
    """Say that Slurm signalled the job (in its run ``restart_count``); returns the note. Raises OSError."""
    note = {
        "signal": signal[:16],
        "at": at,
        "time_left_s": time_left_s,
        "job_id": job_id,
        "restart_count": restart_count,
    }
    runfiles.state_dir(run_dir).mkdir(parents=True, exist_ok=True)
    runfiles.atomic_write_json(note_path(run_dir), note, root=run_dir)
    return note


def read_note(run_dir, since: float | None = None) -> dict | None:
    """The signal note written at or after ``since``, validated; None if absent, older, or malformed."""
    path = note_path(run_dir)
    try:
        if path.is_symlink() or path.stat().st_size > MAX_NOTE_BYTES:
            return None
        note = runfiles.read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(note, dict):
        return None
    at, left, sig = note.get("at"), note.get("time_left_s"), note.get("signal")
    if not finite(at) or not isinstance(sig, str) or not sig or len(sig) > 16:
        return None
    if left is not None and not (finite(left) and 0 <= left <= 10**9):
        return None
    if since is not None and at < since:
        return None
    job, count = note.get("job_id"), note.get("restart_count", 0)
    return {
        "signal": sig,
        "at": float(at),
        "time_left_s": None if left is None else float(left),
        "job_id": job if isinstance(job, str) and 0 < len(job) <= 64 else None,
        "restart_count": count
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0
        else 0,
    }


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0
