"""Is a rank's process still there? One answer for the dashboard and the bridge.

The dashboard asks when a heartbeat is late (``app.run.heartbeats``); the bridge asks
at start whether the ranks a heartbeat names belong to a launch that still
runs (``trainer_bridge.rundir.attempts``). Both can only look at this host's
processes, and both must not mistake a reused pid for the rank.
"""

from __future__ import annotations

import psutil


class Stopped(str):
    """A probe's answer for a process that exists but is stopped (SIGSTOP, a debugger)."""


class Unreaped(str):
    """A probe's answer for a process that has exited but is a zombie: asked again later,
    so the row's words follow once its parent reaps it (or is gone itself)."""


def probe_process(pid: int, started_at: float | None) -> str | None:
    """Why the process ``pid`` is known to be gone, or None if it runs (or cannot be told).

    A pid can be reused after the rank dies, so a process created after the
    rank's bridge started is not the rank. A stopped process is not gone: the
    answer is then a ``Stopped`` sentence.
    """
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():  # one read of /proc/PID/stat for both answers
            created = proc.create_time()
            status = proc.status()
    except psutil.NoSuchProcess:
        return f"process {pid} is gone"
    except psutil.AccessDenied:
        return None
    if status == psutil.STATUS_ZOMBIE:
        return Unreaped(f"process {pid} has exited (not yet reaped by its parent)")
    # create_time is rounded to clock ticks: allow a second of slack.
    if started_at is not None and created > started_at + 1.0:
        return f"pid {pid} now belongs to a newer process; the rank's process is gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return Stopped(f"process {pid} is stopped (SIGSTOP or a debugger; kill -CONT {pid} resumes it)")
    return None
