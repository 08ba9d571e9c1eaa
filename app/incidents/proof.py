"""Proof that a pid is a rank of this run, before the dashboard runs py-spy on it.

A heartbeat (or a worker log) is written by anyone who can write the run
directory, so the pid it names proves nothing: a forged one with this host's
name, any pid and ``started_at: now`` would have the dashboard, perhaps
running as root, dump another user's process and show its stack to viewers
without a token. ``prove_rank`` accepts the pid only when the process
itself says it belongs here, in what was fixed when it was started, which
the heartbeat's writer cannot change:

* **its owner**: the real and effective uid are the run directory's owner;
* **its start time**: not after the heartbeat's ``started_at`` (else the pid
  was reused), and at most ``START_WITHIN_S`` before it (a bridge starts
  while its script sets up, not hours later);
* **its link to this run**, one of: an argument of its command line
  (``--run-dir RUN``, ``--run-dir=RUN``, a script inside it), a variable of
  its environment *as it was at exec* (``/proc/PID/environ``; a later
  ``os.environ`` change is not there), or its stdout or stderr being a file
  there (msrun's ``worker_N.log``) names the run directory or the log
  directory, or a path inside one. ``PWD``/``OLDPWD`` do not count: a
  shell sets them for wherever it happens to be;
* **its rank**, when msrun's ``RANK_ID`` is in that environment: it must be
  the rank asked for.

Linux only (``/proc``). What cannot be read (another user's environment when
the dashboard is not root) is no evidence, never a pass.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

PROC = "/proc"
# /proc/PID/environ and cmdline can be as large as the kernel's ARG_MAX
# (a quarter of the stack limit): read a bounded head, which holds what msrun sets.
MAX_PROC_BYTES = 256 * 1024
START_SLACK_S = 1.0  # create_time is rounded to clock ticks
START_WITHIN_S = 3600.0
SHELL_VARS = frozenset({"PWD", "OLDPWD"})


def _read(path: str) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, MAX_PROC_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)


def _inside(value: str, cwd: str | None, roots: tuple[str, ...]) -> bool:
    if not value or "\0" in value:
        return False
    if not os.path.isabs(value):
        if cwd is None:
            return False
        value = os.path.join(cwd, value)
    value = os.path.normpath(value)
    return any(value == root or value.startswith(root.rstrip("/") + "/") for root in roots)


def _roots(dirs: list[str | os.PathLike]) -> tuple[str, ...]:
    out: set[str] = set()
    for d in dirs:
        if not d:
            continue
        plain = os.path.normpath(os.path.abspath(d))
        out.add(plain)
        out.add(os.path.realpath(plain))  # the same directory as a process may name it
    return tuple(sorted(out))


def evidence(pid: int, dirs: list[str | os.PathLike]) -> tuple[str | None, dict[str, str]]:
    """What links process ``pid`` to ``dirs`` (a phrase, or None), and its exec-time environment."""
    roots = _roots(dirs)
    try:
        cwd = os.readlink(f"{PROC}/{pid}/cwd")
    except OSError:
        cwd = None
    env: dict[str, str] = {}
    raw = _read(f"{PROC}/{pid}/environ") or b""
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep and key not in env:
            env[key] = value
    found = None
    for arg in (_read(f"{PROC}/{pid}/cmdline") or b"").split(b"\0"):
        text = arg.decode(errors="replace")
        if _inside(text, cwd, roots) or ("=" in text and _inside(text.partition("=")[2], cwd, roots)):
            found = f"its command line names {text[:200]!r}"
            break
    if found is None:
        key = next((k for k, v in env.items() if k not in SHELL_VARS and _inside(v, cwd, roots)), None)
        if key is not None:
            found = f"its environment sets {key[:100]} to a path in the run directory"
    if found is None:
        for fd in (1, 2):
            try:
                target = os.readlink(f"{PROC}/{pid}/fd/{fd}")
            except OSError:
                continue
            if _inside(target, None, roots):
                found = f"its {'stdout' if fd == 1 else 'stderr'} is {target[:200]}"
                break
    return found, env


def prove_rank(
    pid: int,
    rank: int,
    started_at: float | None,
    run_dir: str | os.PathLike,
    log_dir: str | os.PathLike | None = None,
) -> tuple[bool, str]:
    """(True, how it was proven) if ``pid`` is rank ``rank`` of the job in ``run_dir``; else (False, why not)."""
    try:
        owner = os.stat(run_dir).st_uid
    except OSError as e:
        return False, f"the run directory cannot be read ({e.strerror})"
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            uids = proc.uids()
            created = proc.create_time()
    except psutil.NoSuchProcess:
        return False, f"process {pid} is gone"
    except psutil.Error as e:
        return False, f"process {pid} cannot be examined ({type(e).__name__})"
    if uids.real != owner or uids.effective != owner:
        return False, (
            f"process {pid} runs as uid {uids.effective}, not as the run directory's owner (uid {owner}), "
            "so it is not shown as a rank of this run"
        )
    if started_at is None:
        return False, f"nothing gives the start time of rank {rank}'s process to check pid {pid} against"
    if created > started_at + START_SLACK_S:
        return False, f"pid {pid} now belongs to a process started after rank {rank}'s bridge"
    if created < started_at - START_WITHIN_S:
        return False, (
            f"process {pid} started {started_at - created:.0f} s before rank {rank}'s heartbeat says "
            f"it did (more than {START_WITHIN_S:.0f} s): not the process that wrote it"
        )
    dirs = [run_dir] + ([log_dir] if log_dir else [])
    found, env = evidence(pid, dirs)
    if found is None:
        return False, (
            f"process {pid} is not proven to be a rank of this run: neither its command line, its "
            f"environment at start, nor its stdout names {Path(run_dir)}"
            + (f" or {Path(log_dir)}" if log_dir else "")
        )
    rank_id = env.get("RANK_ID")
    if rank_id is not None and rank_id.strip() != str(rank):
        return False, f"process {pid} is msrun's rank {rank_id.strip()[:20]!r}, not rank {rank}"
    return True, found
