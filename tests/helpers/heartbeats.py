"""Heartbeats in the bridge's exact format (``trainer_bridge.rundir.schema.Heartbeat``).

Used by the tests and by the scale simulator, so both exercise the dashboard
with the files a real rank writes.
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from trainer_bridge.rundir import runfiles, schema

HOST = socket.gethostname()


@functools.cache
def _created(pid: int) -> float:
    return psutil.Process(pid).create_time()


def process_started() -> float:
    """When the calling process was created: the earliest honest ``started_at``.

    An earlier one would make the dashboard's pid-reuse check call the rank
    a different process; a simulator's forked workers each need their own.
    """
    return _created(os.getpid())


def heartbeat(
    rank: int,
    world_size: int,
    *,
    seq: int = 1,
    now: float | None = None,
    step_ms: float = 50.0,
    steps: int | None = None,
    global_step: int | None = None,
    state: str = "training",
    batch_size: int = 32,
    steps_per_epoch: int = 1000,
    validate: bool = True,
    **overrides: Any,
) -> dict:
    """One heartbeat dict with every schema-1 field, plausible values, and ``overrides``.

    ``steps`` step times of ``step_ms`` are reported since the previous
    heartbeat (default: one second's worth, at most 64, as the bridge).
    """
    now = time.time() if now is None else now
    steps = min(64, max(1, round(1000.0 / step_ms))) if steps is None else steps
    gstep = seq * steps if global_step is None else global_step
    times = [round(step_ms, 3)] * steps
    hb = {
        "schema": runfiles.HEARTBEAT_SCHEMA,
        "rank": rank,
        "world_size": world_size,
        "host": HOST,
        "pid": os.getpid(),
        "state": state,
        "epoch": (gstep - 1) // steps_per_epoch + 1 if gstep else 1,
        "step": (gstep - 1) % steps_per_epoch + 1 if gstep else 0,
        "global_step": gstep,
        "loss": round(2.3 / (1 + gstep / 500), 6),
        "step_time_ms": times[-1] if times else None,
        "step_time_mean_ms": round(step_ms, 3) if times else None,
        "step_times_ms": times,
        # Unknown, as from a non-synchronous simulated rank: health falls back
        # to the wall step time. Tests of synchronous jobs pass them in.
        "step_in_ms": None,
        "step_out_ms": None,
        "samples_per_s": round(batch_size * 1000.0 / step_ms, 2) if times else None,
        "batch_size": batch_size,
        "cpu_percent": 98.5,
        "cpu_seconds": round(0.985 * seq, 3),
        "rss_bytes": 512 * 1024 * 1024,
        "device": None,
        "time": now,
        "last_step_at": now if gstep else None,
        "started_at": process_started(),
        "seq": seq,
        "sync_every": 16,
        "bridge_cost": {
            "agreements": seq,
            "agree_ms": 1.5 * seq,
            "first_agree_ms": 300.0,
            "reporter_cpu_ms": 2.0 * seq,
        },
        "stop": None,
        "resumed_from": None,
        "error": None,
        "warnings": [],
    }
    hb.update(overrides)
    # Through the one schema the bridge writes with: a helper that drifted from
    # it would test the dashboard against files no rank writes. Tests of bad
    # files write raw dicts instead; the scale simulator, which writes
    # thousands a second of the same shape, skips the check (validate=False).
    return schema.validate(schema.Heartbeat, hb).to_dict() if validate else hb


def write_heartbeat(run_dir: str | os.PathLike, hb: dict, history: bool = True) -> Path:
    """Write ``hb`` as rank ``hb["rank"]``'s heartbeat, as the bridge does.

    Atomic (``runfiles.atomic_write_json``) without fsync, like the bridge;
    with ``history``, also appends the chart-history line the bridge appends.
    """
    path = runfiles.heartbeat_path(run_dir, hb["rank"])
    path.parent.mkdir(parents=True, exist_ok=True)
    runfiles.atomic_write_json(path, hb, fsync=False)
    if history:
        # Fields a heartbeat may leave out (an older bridge's, the simulator's) take their defaults.
        line = schema.HistoryLine(**{k: hb[k] for k in schema.HistoryLine.model_fields if k in hb})
        with open(runfiles.history_path(run_dir, hb["rank"]), "ab") as f:
            f.write(line.to_json() + b"\n")
    return path


def write_job(run_dir: str | os.PathLike, world_size: int, **overrides: Any) -> dict:
    """Write ``rankwatch/job.json`` as rank 0 does at start."""
    job = {
        "world_size": world_size,
        "started_at": process_started(),
        "host": HOST,
        "pid": os.getpid(),
        "argv": ["train.py"],
        "checkpoint_dir": runfiles.CHECKPOINT_DIR,
        "sync_interval_s": 1.0,
        **overrides,
    }
    runfiles.state_dir(run_dir).mkdir(parents=True, exist_ok=True)
    runfiles.atomic_write_json(runfiles.job_path(run_dir), job)
    return job


def gone_pid() -> int:
    """The pid of a process that has run and been reaped: a probe finds it gone."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(child.stdout)


class Hosts:
    """Writes a heartbeat for each rank of ``hosts`` about three times a second, except for silenced hosts.

    Ranks that must stay alive on a loaded machine, whatever the test's own
    pace: a heartbeat written once is dead after ``DEAD_AFTER_S``.
    ``world``: the job's size, when other ranks are written by the test.
    """

    def __init__(
        self,
        run_dir,
        hosts: dict[int, str],
        step_ms: dict[int, float] | None = None,
        world: int | None = None,
    ):
        self.run_dir = run_dir
        self.hosts = hosts
        self.step_ms = step_ms or {}
        self.world = world or len(hosts)
        self.silent: set[str] = set()
        self.done = threading.Event()
        write_job(run_dir, self.world)
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        seq = 0
        world = self.world
        while not self.done.is_set():
            seq += 1
            for rank, host in self.hosts.items():
                if host in self.silent:
                    continue
                hb = heartbeat(
                    rank,
                    world,
                    seq=seq,
                    global_step=10 * seq,
                    step_ms=self.step_ms.get(rank, 50.0),
                    host=host,
                )
                write_heartbeat(self.run_dir, hb)
            self.done.wait(0.3)

    def __enter__(self) -> Hosts:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(timeout=30)
