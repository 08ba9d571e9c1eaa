"""One attempt under the supervisor: msrun started, its processes joined, the attempt ended.

``Attempt.run`` returns when the attempt is over and no process of it is
left: its workers all exited 0 (finished, or a graceful stop), or one
process failed (a worker, the scheduler or msrun exited non-zero or on a
signal) and the supervisor ended the rest (SIGTERM, then SIGKILL after the
grace period, the scheduler included: its own 30 s heartbeat timeout is
not waited for), or a second Ctrl-C ended everything at once.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from app.supervise import procs
from app.supervise.command import Msrun, free_port
from trainer_bridge.rundir import safeio

# The last line of a worker's log that names an exception: what the cause quotes.
ERROR_LINE = re.compile(rb"^(?:Traceback|[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit))\b.*$", re.M)
LOG_TAIL_BYTES = 64 * 1024
MAX_ERROR_CHARS = 1000


# Once msrun has returned, this long with no worker running ends the attempt as a crash: long
# enough for a worker between msrun's fork and its exec to show its role, short beside any backoff.
NO_WORKER_SETTLE_S = 2.0


@dataclass
class Outcome:
    """How an attempt ended, before the supervisor judged progress."""

    kind: str  # crash, done, interrupted, hang, peer
    spawned_at: float
    first: procs.Proc | None = None  # the first failed process
    fault_at: float | None = None
    detected_at: float | None = None
    ended_at: float | None = None
    workers: list[procs.Proc] = field(default_factory=list)
    clean: bool = True  # no process of it was left
    error: str | None = None
    gasp: str | None = None  # what the dying gasp gave, in words
    hang: object | None = None  # the hang rule's finding (app.supervise.hang.Hang), kind "hang"
    peer: dict | None = None  # another node's end that ended this one (app.supervise.nodes), kind "peer"


class Attempt:
    def __init__(
        self,
        cmd: Msrun,
        env: dict,
        mark: str,
        keeper_pid: int | None,
        grace_s: float,
        poll_s: float,
        signals,
        record_only: bool = False,
        master_port: int | None = None,
    ):
        self.cmd = cmd
        self.signals = signals  # supervisor.Signals: Ctrl-C/SIGTERM count, and the wake-up event
        self.record_only = record_only
        self.master_port = master_port  # several nodes: node 0's choice for every node (nodes.py)
        self.env = env
        self.mark = mark
        self.keeper_pid = keeper_pid
        self.grace_s = grace_s
        self.poll_s = poll_s
        self.procs: dict[int, procs.Proc] = {}
        self.msrun_pid: int | None = None

    def _exclude(self) -> set[int]:
        return {self.keeper_pid} if self.keeper_pid else set()

    def _find(self) -> list:
        found = {p.pid: p for p in procs.descendants(self._exclude())}
        for p in procs.marked(self.mark, self._exclude()):
            found.setdefault(p.pid, p)
        return list(found.values())

    def _reaped(self, pid: int, status: int) -> None:
        p = self.procs.get(pid)
        if p is None:
            p = self.procs[pid] = procs.Proc(pid, "other", None, 0.0)
        if p.status is None:
            p.status, p.gone_at = status, time.time()

    def _vanished(self, now: float) -> None:
        """Workers gone without their exit reaching us (msrun, still their parent, reaped them)."""
        for p in self.procs.values():
            if p.role == "worker" and p.status is None and not p.vanished and not _alive(p.pid, p.created):
                p.vanished, p.gone_at = True, now

    def _discover(self) -> None:
        for p in procs.descendants(self._exclude()):
            known = self.procs.get(p.pid)
            # Asked again while "other": between msrun's fork and its exec, a worker still shows msrun's
            # own environment (no MS_ROLE yet).
            if known is None or (known.role == "other" and known.status is None):
                c = procs.classify(p, self.msrun_pid, self.cmd.script[0])
                if c is None:
                    continue
                parent = self.procs.get(c.pid and _ppid(p))
                if c.role != "other" and parent is not None and parent.role in ("worker", "scheduler"):
                    c.role, c.rank = "other", None  # a worker's forked helper: same command, same environment
                self.procs[p.pid] = c

    def run(self, on_first_interrupt, say, on_fault=None, on_poll=None, on_peer=None) -> Outcome:
        port = self.master_port or (free_port() if self.cmd.single_node else None)
        argv = self.cmd.argv(port) if not self.record_only else self.cmd.original
        say(" ".join(argv))
        spawned_at = time.time()
        # A session of its own: Ctrl-C at the terminal reaches the supervisor, never msrun's scheduler.
        popen = subprocess.Popen(argv, env=self.env, start_new_session=True)
        self.msrun_pid = popen.pid
        self.procs[popen.pid] = procs.Proc(popen.pid, "msrun", None, spawned_at)
        told_interrupt = False
        no_worker_since: float | None = None
        out = Outcome("done", spawned_at)
        try:
            while True:
                self.signals.wake.wait(self.poll_s)
                self.signals.wake.clear()
                for pid, status in procs.reap():
                    self._reaped(pid, status)
                self._discover()
                if self.signals.count >= 2:
                    out.kind, out.detected_at = "interrupted", time.time()
                    break
                if self.signals.count == 1 and not told_interrupt:
                    told_interrupt = True
                    on_first_interrupt()
                failed = sorted(
                    (p for p in self.procs.values() if p.failed and p.role != "other"),
                    key=lambda p: (p.gone_at, p.role != "worker"),
                )
                if self.record_only:
                    # TTP or MindCluster own recovery: note the first failure, end nothing, wait for the end.
                    self._vanished(time.time())
                    if failed and out.first is None:
                        out.kind, out.first = "crash", failed[0]
                        out.fault_at, out.detected_at = failed[0].gone_at, time.time()
                        gone = sorted(
                            (p for p in self.procs.values() if p.vanished and p.gone_at <= failed[0].gone_at),
                            key=lambda p: p.gone_at,
                        )
                        if gone and failed[0].role == "msrun":
                            # msrun failed because a worker did, whose status only msrun saw.
                            out.first, out.fault_at = gone[0], gone[0].gone_at
                            out.error = (
                                f"rank {gone[0].rank}'s process was gone (msrun reaped it; status unknown)"
                            )
                    if self.procs[popen.pid].status is not None and not self._find():
                        break
                    continue
                if failed:
                    out.kind, out.first = "crash", failed[0]
                    out.fault_at, out.detected_at = failed[0].gone_at, time.time()
                    if on_fault is not None:
                        out.gasp = on_fault(self, failed[0])  # the survivors' dying gasp, before the end
                    break
                hang = on_poll(self) if on_poll is not None else None
                if hang is not None:
                    # The hang rule (app/supervise/hang.py): a rank stalled too long ends the attempt.
                    out.kind, out.hang = "hang", hang
                    out.first = next((p for p in self.procs.values() if p.pid == hang.pid), None)
                    out.fault_at, out.detected_at = hang.since, time.time()
                    if on_fault is not None and out.first is not None:
                        # The others are blocked in a collective with the hung rank, at their last
                        # finished step, as after a death: they save, the hung rank is not asked.
                        out.gasp = on_fault(self, out.first)
                    break
                peer = on_peer() if on_peer is not None else None
                if peer is not None:
                    # Another node's attempt failed (app/supervise/nodes.py): this node's ends with it.
                    out.kind, out.peer = "peer", peer
                    out.fault_at, out.detected_at = peer.get("fault_at") or time.time(), time.time()
                    break
                workers = [p for p in self.procs.values() if p.role == "worker"]
                msrun_done = self.procs[popen.pid].status is not None
                if workers and all(w.code == 0 for w in workers):
                    # The scheduler ends on its own once its workers have; the grace bounds it.
                    self._wait_quiet(self.grace_s)
                    break
                live_workers = [
                    p for q in self._find() if (p := self.procs.get(q.pid)) is not None and p.role == "worker"
                ]
                if not (msrun_done and not live_workers):
                    no_worker_since = None
                elif no_worker_since is None:
                    no_worker_since = time.monotonic()
                if no_worker_since is not None and time.monotonic() - no_worker_since >= NO_WORKER_SETTLE_S:
                    # msrun has returned and no worker runs, yet none was seen to fail: they died
                    # before they could be told apart (a script that fails at import takes a tenth
                    # of a second), and the scheduler may wait for them for ever. The logs say why.
                    out.kind = "crash"
                    quick = sorted((p for p in self.procs.values() if p.failed), key=lambda p: p.gone_at)
                    out.first = quick[0] if quick else self.procs[popen.pid]
                    out.fault_at = out.first.gone_at or time.time()
                    out.detected_at = time.time()
                    out.error = self.logs_error() or "msrun exited and no worker of it was seen running"
                    break
        finally:
            if not self.record_only or out.kind == "interrupted":
                out.clean = procs.end_all(
                    self._find, self.grace_s if out.kind != "interrupted" else 0.0, self._reaped
                )
            out.ended_at = time.time()
            popen.returncode = self.procs[popen.pid].code if self.procs[popen.pid].status is not None else -1
        out.workers = [p for p in self.procs.values() if p.role == "worker"]
        if out.kind == "crash" and out.error is None and out.first is not None:
            out.error = self.crash_error(out.first)
        return out

    def _wait_quiet(self, limit_s: float) -> None:
        """Until no process of the attempt is left, or ``limit_s``."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            for pid, status in procs.reap():
                self._reaped(pid, status)
            if not self._find():
                return
            self.signals.wake.wait(self.poll_s)
            self.signals.wake.clear()

    def log_path(self, p: procs.Proc) -> Path | None:
        base = Path(self.cmd.log_dir or ".")
        if p.role == "scheduler":
            return base / "scheduler.log"
        if p.role == "worker" and p.rank is not None:
            return base / f"worker_{p.rank}.log"
        return None

    def logs_error(self) -> str | None:
        """The first exception line in the workers' logs, rank by rank, then the scheduler's."""
        ranks = [procs.Proc(0, "worker", r, 0.0) for r in range(self.cmd.local_worker_num)]
        for p in [*ranks, procs.Proc(0, "scheduler", None, 0.0)]:
            found = self.error_line(p)
            if found:
                return found
        return None

    def crash_error(self, p: procs.Proc) -> str | None:
        """The error line of the first process to fail: its own log's, or the workers' when it has none.

        msrun (or a process never told apart) has no log of its own: the workers'
        logs say why, and the startup rule compares failures by that line
        (``policy.signature``), whichever process was seen to fail first.
        """
        if self.log_path(p) is None:
            return self.logs_error()
        return self.error_line(p)

    def error_line(self, p: procs.Proc) -> str | None:
        """The last exception line of the failed process's log (bounded read; None if none)."""
        path = self.log_path(p)
        if path is None:
            return None
        try:
            data, _ = safeio.read_tail(path, LOG_TAIL_BYTES)
        except (OSError, ValueError):
            return None
        found = [m.group(0) for m in ERROR_LINE.finditer(data) if not m.group(0).startswith(b"Traceback")]
        if not found:
            return None
        return found[-1].decode("utf-8", "replace").strip()[:MAX_ERROR_CHARS]


def _ppid(p) -> int | None:
    try:
        return p.ppid()
    except Exception:  # noqa: BLE001 - gone meanwhile
        return None


def _alive(pid: int, created: float) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - created) < 1.0
    except psutil.Error:
        return False
