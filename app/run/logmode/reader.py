"""msrun's log directory as heartbeats: one per rank, built through ``trainer_bridge.rundir.schema``.

``LogDir.poll(now)`` is called once per watcher tick. It lists the directory
once, reads only what each log appended since the last tick (``Tailer``),
folds the new lines (``WorkerLog``, ``SchedulerLog``, ``LauncherLog``) and,
for each rank whose log changed, builds a ``schema.Heartbeat`` from what
the log says: the same type, validation and bounds as the bridge's, so
``app.run.state`` turns it into a row with the same code (``source: "log"``).

The heartbeat's ``time`` is when the log last grew (its mtime), so the row's
``heartbeat_age_s`` is the seconds since the rank last printed anything;
``last_step_at`` is when a line last moved training on. Its step time is
the printed one (MindFormers' ``per_step_time``), else the time between
two step lines divided by the steps between them. ``seq`` counts the
observations that moved training on, so the verdict rules' step window
counts each step once.

Which file is what, by name: ``scheduler.log`` is msrun's scheduler;
``<name>_<N>.log`` is rank N's worker log (msrun names them
``worker_N.log``, or ``--worker_log_name`` + ``_N.log``); any other
``*.log`` is taken for msrun's own output (``msrun ... > DIR/msrun.log``).
Symlinks and non-regular files are ignored.

Bounds: at most ``MAX_FILES`` worker logs and ``MAX_LAUNCHER_LOGS`` other
logs (the rest are named in ``problems``), ``TICK_BUDGET`` bytes read per
tick across all files (files left over are read next tick, in turn), and
each ``Tailer``'s own bounds per file.
"""

from __future__ import annotations

import os
import re
import stat
from collections import deque
from pathlib import Path

from app.run.logmode.attempts import LogAttempts
from app.run.logmode.parser import LauncherLog, SchedulerLog, WorkerLog, cut
from app.run.logmode.tailer import Tailer
from app.run.logmode.writers import find_writers, parent_of
from trainer_bridge.rundir import schema

WORKER_NAME = re.compile(r".*_(\d{1,7})\.log")
SCHEDULER_NAME = "scheduler.log"
MAX_FILES = 8192
MAX_LAUNCHER_LOGS = 4
# Directory entries looked at per tick: a directory with millions of files is not msrun's.
MAX_ENTRIES = 4 * MAX_FILES
TICK_BUDGET = 16 * 1024 * 1024
# How often to look for the process writing a log whose writer is not known yet.
PID_SCAN_S = 5.0
PACE_WINDOW = 16
# Lines read without one that looks like a training step before the row says so.
UNRECOGNISED_AFTER = 200


class LogRank:
    """One worker log: its reader, its fold, and the heartbeat last built from them."""

    __slots__ = (
        "rank",
        "name",
        "tailer",
        "log",
        "stat_key",
        "file_key",
        "heartbeat",
        "seq",
        "advanced_at",
        "position",
        "step_ms",
        "new_steps",
        "writer",
        "error",
        "intervals",
        "triggered_at",
    )

    def __init__(self, rank: int, path: Path):
        self.rank = rank
        self.name = path.name
        self.tailer = Tailer(path)
        self.restart()
        self.heartbeat: dict | None = None
        self.seq = 0
        self.stat_key: tuple | None = None
        self.file_key: tuple | None = None  # (st_dev, st_ino): what find_writers matches
        self.error: str | None = None  # why the file cannot be read now

    def restart(self) -> None:
        """A new file under the name (rotated, truncated: a relaunch): forget the old one."""
        self.log = WorkerLog()
        self.advanced_at: float | None = None
        self.position: tuple | None = None
        self.step_ms: float | None = None
        self.new_steps = 0
        self.writer: tuple[int, float] | None = None  # (pid, create time) on this host
        # Seconds between log lines that moved training on: how often this log speaks.
        self.intervals: deque[float] = deque(maxlen=PACE_WINDOW)
        # When the log first showed OnRequestExit obeying the flag ("Graceful exit is
        # triggered"): the file's mtime then, which is no earlier than the line.
        self.triggered_at: float | None = None

    def fold(self, lines: list[str], mtime: float) -> None:
        """Feed the new lines; note the steps they moved on and the time those took."""
        for line in lines:
            self.log.feed(line)
        if self.triggered_at is None and self.log.state == "stopping":
            self.triggered_at = mtime
        self.new_steps = 0
        position = self.log.position
        if not self.log.steps or position == self.position:
            return
        steps = _steps_between(self.position, position)
        if self.log.step_ms is not None:
            self.step_ms = self.log.step_ms
        elif steps and self.advanced_at is not None and mtime > self.advanced_at:
            self.step_ms = (mtime - self.advanced_at) * 1000.0 / steps
        self.new_steps = steps or 1
        if self.advanced_at is not None and mtime > self.advanced_at:
            self.intervals.append(mtime - self.advanced_at)
        self.position, self.advanced_at = position, mtime

    @property
    def pace_ms(self) -> float | None:
        """The median time between step lines: a log printed every 100 steps is quiet for 100 steps."""
        if not self.intervals:
            return None
        ordered = sorted(self.intervals)
        return ordered[len(ordered) // 2] * 1000.0


def _steps_between(old: tuple | None, new: tuple) -> int | None:
    """Steps from one (epoch, step, global step) to the next, if the logs tell."""
    if old is None:
        return None
    if old[2] is not None and new[2] is not None:
        return new[2] - old[2] if new[2] > old[2] else None
    if old[0] == new[0] and old[1] is not None and new[1] > old[1]:
        return new[1] - old[1]
    return None


class LogDir:
    """The worker logs of one job, read incrementally. Not thread-safe: ``RunState`` holds its lock."""

    def __init__(self, path: str | os.PathLike, hostname: str, *, tick_budget: int = TICK_BUDGET):
        self.path = Path(path)
        self.hostname = hostname
        self.tick_budget = tick_budget
        self.ranks: dict[int, LogRank] = {}
        self._scheduler: tuple[Tailer, SchedulerLog] | None = None
        self._launchers: dict[str, tuple[Tailer, LauncherLog]] = {}
        self._cursor = 0  # where the next tick starts reading, so no file starves
        self._scanned_pids_at = -PID_SCAN_S
        self._world = 0
        # (pid, create time) of the process that started the newest writer found: msrun.
        self.launcher: tuple[int, float] | None = None
        self.error: str | None = None  # why the directory cannot be read
        self.problems: list[str] = []  # what was left out, and why
        self.lines = 0  # lines folded so far (the benchmark's count)
        self.attempts = LogAttempts()  # relaunches, seen as logs that started over

    # -- the directory -----------------------------------------------------------------

    def poll(self, now: float) -> set[int]:
        """Read what the logs appended; returns the ranks whose heartbeat changed (or vanished)."""
        try:
            entries = self._list()
        except FileNotFoundError:
            self.error = None
            self._world = 0
            return self._forget(set(self.ranks))
        except OSError as e:
            self.error = f"cannot read {self.path}: {e.strerror or e}"
            return set()
        self.error = None
        workers, scheduler, launchers = entries
        changed = self._forget(set(self.ranks) - set(workers))
        facts_changed = self._read_others(scheduler, launchers)
        self._world = self._count_world(workers)
        budget = self.tick_budget
        order = sorted(workers)
        if order:
            self._cursor %= len(order)
            order = order[self._cursor :] + order[: self._cursor]
        for i, rank in enumerate(order):
            path, st = workers[rank]
            lr = self.ranks.get(rank)
            if lr is None or lr.tailer.path != path:
                lr = self.ranks[rank] = LogRank(rank, Path(path))
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == lr.stat_key and not facts_changed:
                continue
            pending = st.st_size - lr.tailer.offset
            if pending > 0 and budget <= 0:
                self._cursor = (self._cursor + i) % len(workers)
                break  # the rest next tick; their offsets are kept
            if self._read_worker(lr, st):
                budget -= max(0, pending)
            self._build(lr, st.st_mtime)
            changed.add(rank)
        self._find_writers(now, changed)
        return changed

    def _list(self):
        workers: dict[int, tuple[Path, os.stat_result]] = {}
        scheduler = None
        launchers = []
        self.problems = []
        skipped_workers = skipped_others = 0
        with os.scandir(self.path) as it:
            for n, entry in enumerate(it):
                if n >= MAX_ENTRIES:
                    self.problems.append(
                        f"more than {MAX_ENTRIES} entries in {self.path}: the rest are not read"
                    )
                    break
                name = entry.name
                if not name.endswith(".log"):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue  # a symlink, FIFO or device is not msrun's log
                if name == SCHEDULER_NAME:
                    scheduler = (Path(entry.path), st)
                    continue
                m = WORKER_NAME.fullmatch(name)
                if m is None:
                    if len(launchers) < MAX_LAUNCHER_LOGS:
                        launchers.append((Path(entry.path), st))
                    else:
                        skipped_others += 1
                    continue
                rank = int(m.group(1))
                if rank >= schema.MAX_RANKS or (rank not in workers and len(workers) >= MAX_FILES):
                    skipped_workers += 1
                    continue
                if rank in workers:
                    self.problems.append(
                        f"two logs for rank {rank}: {Path(workers[rank][0]).name} and {name}"
                    )
                    continue
                workers[rank] = (entry.path, st)
        if skipped_workers:
            self.problems.append(f"{skipped_workers} worker logs not read (at most {MAX_FILES} ranks)")
        if skipped_others:
            self.problems.append(f"{skipped_others} other .log files not read")
        return workers, scheduler, launchers

    def _forget(self, ranks: set[int]) -> set[int]:
        for rank in ranks:
            del self.ranks[rank]
        return set(ranks)

    def _read_worker(self, lr: LogRank, st: os.stat_result) -> bool:
        try:
            lines = lr.tailer.read(st)
        except OSError as e:
            lr.error = f"{lr.name}: {e.strerror or e}"
            return False
        lr.error = None
        if lr.tailer.reset:
            self.attempts.started_over(lr.rank)
            lr.restart()
        lr.stat_key = (st.st_ino, st.st_mtime_ns, st.st_size)
        lr.file_key = (st.st_dev, st.st_ino)
        self.lines += len(lines)
        lr.fold(lines, st.st_mtime)
        return True

    def _read_others(self, scheduler, launchers) -> bool:
        """Fold the scheduler's and the launchers' new lines; True if any changed."""
        changed = False
        if scheduler is None:
            changed = self._scheduler is not None
            self._scheduler = None
        else:
            path, st = scheduler
            if self._scheduler is None:
                self._scheduler = (Tailer(path), SchedulerLog())
            changed |= self._fold(self._scheduler, st, SchedulerLog, "_scheduler")
        present = {str(p) for p, _ in launchers}
        for gone in set(self._launchers) - present:
            del self._launchers[gone]
            changed = True
        for path, st in launchers:
            entry = self._launchers.get(str(path))
            if entry is None:
                entry = self._launchers[str(path)] = (Tailer(path), LauncherLog())
            changed |= self._fold(entry, st, LauncherLog, str(path))
        return changed

    def _fold(self, entry, st, fresh, slot: str) -> bool:
        tailer, fold = entry
        try:
            lines = tailer.read(st)
        except OSError:
            return False
        if tailer.reset:
            fold = fresh()
            if slot == "_scheduler":
                self._scheduler = (tailer, fold)
            else:
                self._launchers[slot] = (tailer, fold)
        before = fold.version
        for line in lines:
            fold.feed(line)
        self.lines += len(lines)
        # msrun's scheduler logs "Cluster currently has 2 alive nodes" every 5 s: only facts count.
        return fold.version != before or tailer.reset is not None

    def _find_writers(self, now: float, changed: set[int]) -> None:
        """Look for the local processes of growing logs whose writer is unknown (at most every PID_SCAN_S)."""
        wanted = {
            lr.file_key: r
            for r, lr in self.ranks.items()
            if lr.writer is None and lr.file_key is not None and lr.log.state not in ("failed", "finished")
        }
        if not wanted or now - self._scanned_pids_at < PID_SCAN_S:
            return
        self._scanned_pids_at = now
        for rank, writer in find_writers(wanted).items():
            lr = self.ranks[rank]
            lr.writer = writer
            self.launcher = parent_of(writer[0]) or self.launcher
            if lr.heartbeat is not None:
                self._build(lr, lr.heartbeat["time"])
                changed.add(rank)

    # -- what the logs say -----------------------------------------------------------

    def _count_world(self, workers) -> int:
        """msrun's scheduler's "expected node number" if it said, else the highest worker log + 1."""
        sched = self._scheduler[1] if self._scheduler else None
        if sched is not None and sched.world:
            return sched.world
        return max(workers, default=-1) + 1

    @property
    def world_size(self) -> int:
        return self._world

    def _launcher_folds(self):
        return [fold for _, fold in self._launchers.values()]

    def _build(self, lr: LogRank, mtime: float) -> None:
        log = lr.log
        sched = self._scheduler[1] if self._scheduler else None
        state, error = log.state, log.error
        pid = lr.writer[0] if lr.writer else log.pid
        exit_ = next((f.exits[pid] for f in self._launcher_folds() if pid in f.exits), None)
        if sched is not None and lr.rank in sched.left and state != "failed":
            state = "exited" if state == "stopping" else "finished"
        elif exit_ is not None and exit_[0] > 0 and state != "failed":
            state, error = "failed", f"msrun: {exit_[1]}"
        host = self.hostname if lr.writer else (sched.hosts.get(lr.rank) if sched else None)
        fields = {
            "rank": lr.rank,
            "world_size": max(1, self.world_size, lr.rank + 1),
            "host": host,
            "pid": pid,
            "state": state,
            "epoch": log.epoch or 0,
            "step": log.step or 0,
            "global_step": log.global_step,
            "loss": log.loss,
            "step_time_ms": lr.step_ms,
            "step_time_mean_ms": log.step_mean_ms,
            "step_times_ms": [lr.step_ms] * min(lr.new_steps, schema.MAX_STEP_TIMES)
            if lr.new_steps and lr.step_ms is not None
            else [],
            "time": mtime,
            "last_step_at": lr.advanced_at,
            "started_at": lr.writer[1] if lr.writer else None,
            "seq": lr.seq + (1 if lr.new_steps else 0),
            "error": error if state == "failed" else None,
            "warnings": list(log.warnings),
        }
        if not log.steps and log.lines >= UNRECOGNISED_AFTER and state == "starting":
            fields["warnings"].append(
                f"no line of {lr.name} looks like a training step yet ({log.lines} lines read): "
                "see the formats understood in docs/training-scripts.md, Log mode"
            )
        try:
            beat = schema.build(schema.Heartbeat, **fields)
        except schema.SchemaError as e:
            # A figure out of the schema's bounds (a 10^12 ms step time): show the rest.
            keep = {
                k: fields[k] for k in ("rank", "world_size", "host", "pid", "state", "time", "seq", "error")
            }
            keep["warnings"] = [
                cut(f"{lr.name}: a figure out of bounds was left out ({e})", schema.MAX_WARNING)
            ]
            beat = schema.build(schema.Heartbeat, **keep)
        lr.seq = beat.seq
        lr.new_steps = 0
        lr.heartbeat = beat.to_dict()
        self.attempts.observe(lr.heartbeat, log.first_global_step)

    def gone(self, rank: int) -> str | None:
        """What msrun's logs say about the end of ``rank``'s process, if anything."""
        lr = self.ranks.get(rank)
        pid = (lr.writer[0] if lr.writer else lr.log.pid) if lr else None
        said = []
        for fold in self._launcher_folds():
            if pid is not None and pid in fold.exits and fold.exits[pid][0] < 0:
                said.append(f"msrun: {fold.exits[pid][1]}")
            elif fold.killed_all and rank in fold.ranks:
                said.append(fold.killed_all)
        sched = self._scheduler[1] if self._scheduler else None
        if sched is not None and rank in sched.timed_out:
            said.append(f"msrun's scheduler: {sched.timed_out[rank]}")
        return "; ".join(said) or None

    def job_exited(self, probe=None) -> str | None:
        """msrun's words that the job is over: it killed every worker before saying them.

        Not taken while msrun's process is found running (``probe``): the words come
        from a file in the log directory, which any rank can write.
        """
        said = next((f.job_exited for f in self._launcher_folds() if f.job_exited), None)
        if said and probe is not None and self.launcher is not None and not probe(*self.launcher):
            return None
        return f"msrun: {said}" if said else None

    def launcher_gone(self, probe) -> str | None:
        """Why msrun is known to be over, or None (it runs, or nothing tells).

        msrun's own words ("Distributed job exited with exception", when its
        output is kept in the log directory) or a probe of the process that
        started the workers (``probe`` is ``app.run.heartbeats.probe_process``).
        """
        said = self.job_exited(probe)
        if said:
            return said
        if self.launcher is not None:
            why = probe(*self.launcher)
            if why:
                return f"msrun's {why}"
        return None

    def launcher_known(self) -> bool:
        """Whether anything can tell msrun's end: its process was found, or its output is read."""
        return self.launcher is not None or bool(self._launchers)

    def triggered_at(self, rank: int) -> float | None:
        """When ``rank``'s log showed OnRequestExit obeying the flag, if it did."""
        lr = self.ranks.get(rank)
        return lr.triggered_at if lr is not None else None

    def on_request_exit(self) -> str | None:
        """A line from a worker log that shows the script uses OnRequestExit, with its file."""
        for rank in sorted(self.ranks):
            lr = self.ranks[rank]
            if lr.log.on_request_exit:
                return f"{lr.name}: {lr.log.on_request_exit}"
        return None

    def read_errors(self) -> list[str]:
        return [lr.error for lr in self.ranks.values() if lr.error]
