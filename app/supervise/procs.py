"""The processes of an attempt: found, told apart, reaped and ended by the supervisor.

The supervisor is the child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``):
msrun returns at once (``--join=False``), and the scheduler and the workers
it started become the supervisor's own children. So their exits come to
the supervisor's ``waitpid``, with the status, whatever their session (msrun
starts each worker with ``setsid``).

Every process of an attempt also carries ``MARK_ENV`` in its environment
(msrun passes its environment on), naming the run directory. That is how
the keeper (``keeper.py``) finds them when the supervisor itself was killed,
and how the next supervisor on the run directory finds what was left.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import time
from dataclasses import dataclass

import psutil

PR_SET_CHILD_SUBREAPER = 36
MARK_ENV = "RANKWATCH_LAUNCH_RUN"
ATTEMPT_ENV = "RANKWATCH_LAUNCH_ATTEMPT"


def run_mark(run_dir: str, node: int | None = None) -> str:
    """The marker of a run directory's processes: the same for every supervisor of it (and of its node).

    With several nodes each node's supervisor marks its own: where two nodes
    share one process table (containers, the tests' network namespaces), one
    must never end the other's processes.
    """
    key = os.path.realpath(run_dir) + ("" if node is None else f"\0node{node}")
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


@dataclass
class Proc:
    """A process of the attempt, as classified while it ran."""

    pid: int
    role: str  # worker, scheduler, msrun, other
    rank: int | None
    created: float
    status: int | None = None  # the wait status once reaped
    gone_at: float | None = None
    vanished: bool = False  # gone, reaped by another (msrun with --join True): its status is unknown

    @property
    def code(self) -> int | None:
        if self.status is None:
            return None
        return os.waitstatus_to_exitcode(self.status)

    @property
    def failed(self) -> bool:
        return self.code not in (None, 0)


def classify(proc: psutil.Process, msrun_pid: int, script: str) -> Proc | None:
    """What ``proc`` is, by the environment msrun gave it (``MS_ROLE``, ``MS_NODE_ID``/``RANK_ID``).

    Only a process running ``script`` is a worker or the scheduler: with
    ``--join True`` msrun also starts a ``tail -f`` per worker log, whose
    environment says the same.
    """
    try:
        with proc.oneshot():
            created = proc.create_time()
            env = proc.environ() if proc.pid != msrun_pid else {}
            cmdline = proc.cmdline() if proc.pid != msrun_pid else []
    except psutil.Error:
        return None
    if proc.pid == msrun_pid:
        return Proc(proc.pid, "msrun", None, created)
    name = os.path.basename(script)
    if not any(os.path.basename(arg) == name for arg in cmdline[:8]):
        return Proc(proc.pid, "other", None, created)
    role = env.get("MS_ROLE")
    if role == "MS_SCHED":
        return Proc(proc.pid, "scheduler", None, created)
    if role == "MS_WORKER":
        rank = env.get("MS_NODE_ID") or env.get("RANK_ID")
        return Proc(proc.pid, "worker", int(rank) if rank and rank.isdigit() else None, created)
    return Proc(proc.pid, "other", None, created)


def reap() -> list[tuple[int, int]]:
    """Every exited child's (pid, wait status), without blocking."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


def marked(mark: str, exclude: set[int] = frozenset()) -> list[psutil.Process]:
    """This user's processes whose environment carries ``mark`` (others' environments are unreadable)."""
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me or proc.pid in exclude:
            continue
        try:
            if proc.environ().get(MARK_ENV) == mark and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except psutil.Error:
            continue
    return found


def descendants(exclude: set[int] = frozenset()) -> list[psutil.Process]:
    try:
        kids = psutil.Process().children(recursive=True)
    except psutil.Error:
        return []
    out = []
    for p in kids:
        if p.pid in exclude:
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    """``sig`` to each process and to each process group they lead (a worker's dataset helpers)."""
    own_group = os.getpgrp()
    groups = set()
    for p in procs:
        try:
            p.send_signal(sig)
            pgid = os.getpgid(p.pid)
            if pgid == p.pid and pgid != own_group:
                groups.add(pgid)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def end_all(find, grace_s: float, on_reap=None, guard_s: float = 60.0) -> bool:
    """SIGTERM to everything ``find()`` names, SIGKILL after ``grace_s``; True once none is left.

    ``find`` is called again each round (a process may start children while
    it dies). Our own exited children are reaped here (``on_reap`` gets each
    (pid, status)) so they do not linger as zombies.
    """
    sent_kill = False
    signal_all(find(), signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    give_up = deadline + guard_s
    while True:
        for pid, status in reap():
            if on_reap is not None:
                on_reap(pid, status)
        left = find()
        if not left:
            return True
        now = time.monotonic()
        if now >= deadline and not sent_kill:
            signal_all(left, signal.SIGKILL)
            sent_kill = True
        elif sent_kill and now >= give_up:
            return False
        elif sent_kill:
            signal_all(left, signal.SIGKILL)  # newcomers since
        time.sleep(0.05)


def signal_name(status: int) -> str | None:
    if os.WIFSIGNALED(status):
        try:
            return signal.Signals(os.WTERMSIG(status)).name
        except ValueError:
            return f"signal {os.WTERMSIG(status)}"
    return None
