"""Which local process writes a log: the one whose standard output is that file.

msrun starts each worker with its stdout (and stderr) redirected to
``worker_N.log``, so on the dashboard's host the rank's process is the one
whose ``/proc/PID/fd/1`` is that very file (same device and inode; a
``tail -f`` on the log only reads it). That proves the pid belongs to the
rank, which a number read from the log's text cannot: the dashboard then
probes it like a bridge rank's (``app.run.state.probe_process``), and a rank
killed with ``kill -9`` is shown dead within seconds.

Linux only (``/proc``); elsewhere, or for processes of other users, nothing
is found and the reader falls back to what the logs say.
"""

from __future__ import annotations

import os

import psutil

PROC = "/proc"


def find_writers(files: dict[tuple[int, int], int]) -> dict[int, tuple[int, float]]:
    """For ``{(st_dev, st_ino): rank}``, ``{rank: (pid, create_time)}`` of the processes writing them.

    When several processes share the file as stdout (the worker's own
    children, e.g. dataset workers forked from it), the one whose parent is
    not among them is the worker.
    """
    if not files:
        return {}
    found: dict[int, list[int]] = {}
    try:
        entries = list(os.scandir(PROC))
    except OSError:
        return {}
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"{PROC}/{entry.name}/fd/1")
        except OSError:
            continue  # gone, another user's, or no stdout
        rank = files.get((st.st_dev, st.st_ino))
        if rank is not None:
            found.setdefault(rank, []).append(int(entry.name))
    out = {}
    for rank, pids in found.items():
        chosen = None
        for pid in sorted(pids):
            try:
                proc_ = psutil.Process(pid)
                parent = proc_.ppid()
                created = proc_.create_time()
            except psutil.Error:
                continue
            if parent not in pids:
                chosen = (pid, created)
                break
        if chosen is not None:
            out[rank] = chosen
    return out


def parent_of(pid: int) -> tuple[int, float] | None:
    """(pid, create time) of ``pid``'s parent (msrun, for a worker), or None if it cannot be told."""
    try:
        parent = psutil.Process(pid).parent()
        if parent is None or parent.pid <= 1:
            return None
        return parent.pid, parent.create_time()
    except psutil.Error:
        return None
