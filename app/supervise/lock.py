"""One supervisor per run directory (and node): an ``flock`` on ``RUN/rankwatch/launch.lock``, never waited for.

``LOCK_NB`` only: whoever can write the run directory can hold the lock
for ever, and a second ``rankwatch launch`` must say so at once, not hang.
The file is opened through ``safeio.open_lock`` (no symlink followed, a
FIFO or a directory at its name refused without blocking). The holder
writes its pid, host and start time into it, so the refusal can name it;
the lock itself, not that text, decides (the kernel drops it when the
holder dies, ``kill -9`` included).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time

from trainer_bridge.rundir import runfiles, safeio

LOCK_NAME = f"{runfiles.STATE_DIR}/launch.lock"
MAX_HOLDER_BYTES = 4096


class Held(RuntimeError):
    """Another supervisor holds the run directory (or the lock file cannot be used)."""


def lock_name(node: int | None) -> str:
    """One supervisor per run directory and node: node 0 (or the only node) takes ``launch.lock``."""
    return LOCK_NAME if not node else f"{runfiles.STATE_DIR}/launch_node{node}.lock"


def acquire(run_dir: str, node: int | None = None) -> int:
    """The locked descriptor (kept open for the supervisor's life); Held if another holds it."""
    name = lock_name(node)
    try:
        fd = safeio.open_lock(run_dir, name)
    except (OSError, safeio.UnsafePath) as e:
        why = safeio.why(e) if isinstance(e, OSError) else str(e)
        raise Held(f"cannot use the supervisor lock {name} in {run_dir}: {why}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        where = f" as node {node}" if node else ""
        raise Held(
            f"another rankwatch launch supervises {run_dir}{where}{holder}: one supervisor per run "
            "directory and node (stop that one first, or give this job its own run directory)"
        ) from None
    text = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)
    except OSError:
        pass  # the lock holds without the text
    return fd


def _holder(fd: int) -> str:
    try:
        st = os.fstat(fd)
        info = json.loads(safeio.read_fd(fd, st.st_size, MAX_HOLDER_BYTES, "launch lock"))
        pid, host = int(info["pid"]), str(info["host"])[:253]
    except (OSError, ValueError, KeyError, TypeError, safeio.FileTooLarge):
        return ""
    return f" (pid {pid} on {host})"
