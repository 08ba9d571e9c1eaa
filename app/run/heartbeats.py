"""Reading the run directory: heartbeat files, job.json, history tails, process probes.

``RunReader.read`` is called once per watcher tick. Its cost follows what
changed: one ``os.scandir`` of ``RUN/rankwatch/`` and a ``stat`` per
heartbeat file, and a file is read only when its (inode, mtime, size)
changed, which every atomic rewrite guarantees. Everything read is validated
against ``trainer_bridge.rundir.schema`` first (the run directory is shared and
untrusted); a heartbeat that fails leaves the rank's last valid one in
place and says why in ``RankSlot.error``.
"""

from __future__ import annotations

import os
import re
import stat
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.run.rows import _loss
from app.run.stepcost import StepWindow
from trainer_bridge.rundir import copies, runfiles, safeio, schema
from trainer_bridge.rundir.liveness import Stopped, Unreaped, probe_process  # noqa: F401  (shared with the bridge)
from trainer_bridge.rundir.redisbus import RedisUnavailable, Subscriber

HEARTBEAT_NAME = re.compile(r"rank_(\d+)\.json")
# Bytes read from the end of a history file per wanted line; the bridge's
# lines are about 250 bytes, so this comfortably covers the tail.
HISTORY_LINE_BUDGET = 400
# A heartbeat dated more than this after the dashboard read it comes from a
# clock that is ahead: its times are clamped to when it was read (else its age
# stays negative, so a dead rank looks healthy, and one future point pushes
# every other rank off the charts) and the row says so.
CLOCK_AHEAD_TOLERANCE_S = 2.0
# While heartbeats come over Redis, the heartbeat files are still read this
# often: a rank that cannot reach Redis (its own network path, or no redis
# package) writes files at the full rate, and must not look stalled.
REDIS_FILE_SCAN_S = 5.0

ProcessProbe = Callable[[int, "float | None"], "str | None"]


def read_history_tail(run_dir: str | os.PathLike, rank: int, points: int) -> list[tuple]:
    """The newest ``points`` chart points of ``rank`` from its history files, oldest first.

    Reads only the end of the current segment, and of the previous one
    (``.1``) if the current is short, so seeding 4096 ranks stays cheap
    however long the job has run. Each line is validated
    (``schema.HistoryLine``); bad ones (a torn append) are skipped.
    """
    current = runfiles.history_path(run_dir, rank)
    entries = _tail_points(current, points)
    if len(entries) < points:
        entries = _tail_points(current.with_name(current.name + ".1"), points - len(entries)) + entries
    return entries


# All of a tail's lines are validated in one call, as one JSON array: a
# fraction of the cost of one call per line, which matters when a restarted
# dashboard seeds thousands of ranks' charts.
_HISTORY_LINES = TypeAdapter(list[schema.HistoryLine])


def _tail_points(path: Path, count: int) -> list[tuple]:
    try:
        data, start = safeio.read_tail(path, count * HISTORY_LINE_BUDGET)
    except OSError:
        return []
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first one is cut
    lines = [line for line in lines[-count - 1 :] if line.strip()]
    try:
        parsed = _HISTORY_LINES.validate_json(b"[" + b",".join(lines) + b"]")
    except ValidationError:
        parsed = []
        for line in lines:
            try:
                parsed.append(schema.parse(schema.HistoryLine, line))
            except schema.SchemaError:
                continue  # a torn append, or a line another tool wrote: not a point
    return [
        _point(e.time, e.global_step, e.loss, e.step_time_mean_ms, e.step_time_ms) for e in parsed[-count:]
    ]


def history_point(hb: Mapping[str, Any]) -> tuple:
    """A chart point (t, global_step, loss, step time) from a validated heartbeat."""
    return _point(hb["time"], hb["global_step"], hb["loss"], hb["step_time_mean_ms"], hb["step_time_ms"])


def _point(
    t: float, gstep: int | None, loss: float | None, mean_ms: float | None, last_ms: float | None
) -> tuple:
    step_ms = mean_ms if mean_ms is not None else last_ms
    return (t, gstep, _loss(loss), None if step_ms is None else round(step_ms, 2))


def _public(e: OSError | schema.SchemaError) -> str:
    """Why a file was refused, in words fit for viewers without the token: never its content."""
    return e.public if isinstance(e, schema.SchemaError) else safeio.why(e)


class RankSlot:
    """What the dashboard knows about one rank that has written a heartbeat.

    ``hb`` is the newest *valid* heartbeat, as a dict of every schema field
    (``schema.Heartbeat.to_dict``), so the rules can trust its types;
    ``error`` says why the file on disk now is not one (the rank is then
    shown ``corrupt``, with its last valid figures). ``skew_s`` is how far
    ahead of the dashboard's clock the rank's newest heartbeat was dated,
    when more than ``CLOCK_AHEAD_TOLERANCE_S``. ``second_writer`` says why
    two writers are believed to write this rank, once seen.
    """

    __slots__ = ("stat_key", "hb", "window", "history", "error", "skew_s", "second_writer")

    def __init__(self, window: int, points: int):
        self.stat_key: tuple | None = None
        self.hb: dict | None = None
        self.window = StepWindow(window)
        self.history: deque[tuple] = deque(maxlen=points)
        self.error: str | None = None
        self.skew_s: float | None = None
        # Evidence that two processes write this rank (see RunReader._accept), kept for the slot's life.
        self.second_writer: str | None = None

    def observe(self, hb: dict, now: float) -> None:
        self.error = None
        ahead = hb["time"] - now
        self.skew_s = round(ahead, 1) if ahead > CLOCK_AHEAD_TOLERANCE_S else None
        if self.skew_s is not None:
            hb = clamp_times(hb, now)
        self.hb = hb
        self.window.add(hb, trusted=True)
        self.add_point(history_point(hb), now)

    def add_point(self, point: tuple, now: float | None = None) -> None:
        """Append a chart point; the history line of the beat just seen adds nothing.

        A point dated after ``now`` (a writer whose clock is ahead) is left out.
        """
        if now is not None and point[0] > now + CLOCK_AHEAD_TOLERANCE_S:
            return
        if not self.history or point[0] > self.history[-1][0]:
            self.history.append(point)


def clamp_times(hb: dict, now: float) -> dict:
    """``hb`` with its wall-clock times no later than ``now`` (a clock ahead of ours)."""
    out = dict(hb, time=now)
    for key in ("last_step_at", "started_at"):
        if out.get(key) is not None and out[key] > now:
            out[key] = now
    return out


class RunReader:
    """The heartbeat files and job.json of one run directory, as last read.

    ``slots`` maps each rank that has a heartbeat file to its ``RankSlot``;
    ``job`` is the validated job.json (or None, with ``job_error`` saying
    why when it exists but is bad); ``read_error`` says why ``RUN/rankwatch``
    cannot be read at all.
    """

    def __init__(self, run_dir: Path | None, window: int, points: int, redis: Subscriber | None = None):
        self.run_dir = run_dir
        self.window = window
        self.points = points
        # Heartbeats over Redis instead of files (trainer_bridge.rundir.redisbus), when configured.
        self.redis = redis
        self.redis_error: str | None = None
        self._next_file_scan = 0.0
        self.read_error: str | None = None
        self.job_error: str | None = None
        self.clear()

    def clear(self) -> None:
        self.slots: dict[int, RankSlot] = {}
        self.job: dict | None = None
        self._job_key: tuple | None = None
        # Why this run directory is a copy of the one its job wrote (trainer_bridge.rundir.copies), else None.
        self.copied: str | None = None
        # A rank's process wrote a newer heartbeat (its seq went up) while this reader watched: something
        # live writes here, so the directory is no copy whatever job.json's inode says (RUN/rankwatch
        # restored or swapped under a running job).
        self._advanced = False
        # rank -> the world size its heartbeat declares, to answer world_size() without a pass.
        self._declared: dict[int, int] = {}

    def newest_beat(self, default: float) -> float:
        """The newest heartbeat's time (a copied run is judged as of it), else ``default``."""
        return max((s.hb["time"] for s in self.slots.values() if s.hb), default=default)

    def read(self, now: float) -> set[int]:
        """Bring the slots up to date; returns the ranks whose heartbeat file changed or went away.

        A run directory that vanished clears everything (whatever was shown
        is over); one that cannot be read keeps the last view, whose
        heartbeats then age, and says why in ``read_error``.
        """
        if self.run_dir is None:
            return set()
        if self.redis is not None:
            changed = self._read_redis(now)
            if changed is not None:
                if now < self._next_file_scan:
                    return changed
                self._next_file_scan = now + REDIS_FILE_SCAN_S
                # Ranks without a file yet are Redis's, not gone: no pruning.
                return changed | self._read_files(now, prune=False)
        return self._read_files(now, prune=True)

    def _read_files(self, now: float, prune: bool) -> set[int]:
        try:
            entries = list(os.scandir(runfiles.state_dir(self.run_dir)))
        except FileNotFoundError:
            self.read_error = None
            gone = set(self.slots)
            if self.slots or self.job:
                self.clear()
            return gone
        except OSError as e:
            self.read_error = f"{e.strerror or e}"
            return set()
        self.read_error = None
        self._read_job()
        changed, present = set(), set()
        for entry in entries:
            match = HEARTBEAT_NAME.fullmatch(entry.name)
            if not match:
                continue
            rank = int(match.group(1))
            if rank >= schema.MAX_RANKS:
                continue  # not a rank of any job we believe in (see schema.MAX_RANKS)
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            slot = self.slots.get(rank)
            if not stat.S_ISREG(st.st_mode):
                # A FIFO, a device or a symlink (never followed: it could name a
                # file outside) is no heartbeat. It makes no rank; a rank already
                # shown keeps its last valid beat and says why.
                if slot is not None:
                    present.add(rank)
                    if slot.stat_key != "not regular":
                        slot.stat_key = "not regular"
                        slot.error = f"{entry.name}: not a regular file"
                        changed.add(rank)
                continue
            present.add(rank)
            if slot is None:
                slot = self.slots[rank] = self._new_slot(rank, now)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == slot.stat_key:
                continue
            slot.stat_key = key
            changed.add(rank)
            self._load(entry, rank, slot, now)
        for rank in set(self.slots) - present if prune else ():
            del self.slots[rank]
            self._declared.pop(rank, None)
            changed.add(rank)
        return changed

    def _read_redis(self, now: float) -> set[int] | None:
        """The heartbeats published to Redis since the last tick; None if Redis is unreachable.

        Then this tick falls back to the files (the bridge writes them at the
        full rate again while it cannot reach Redis either), and
        ``redis_error`` says why for the status line.
        """
        try:
            beats = self.redis.poll()
        except RedisUnavailable as e:
            self.redis_error = str(e)
            return None
        self.redis_error = None
        self.read_error = None
        self._read_job()
        changed = set()
        for rank, data in beats:
            if rank >= schema.MAX_RANKS:
                continue
            slot = self.slots.get(rank)
            if slot is None:
                slot = self.slots[rank] = self._new_slot(rank, now)
            name = f"rank {rank} in redis"
            try:
                beat = schema.parse(schema.Heartbeat, data)
            except schema.SchemaError as e:
                slot.error = f"{name}: {_public(e)}"
            else:
                self._accept(slot, rank, beat, name, now)
            changed.add(rank)
        return changed

    def _load(self, entry: os.DirEntry, rank: int, slot: RankSlot, now: float) -> None:
        try:
            beat = schema.load(schema.Heartbeat, entry.path)
        except FileNotFoundError:
            return  # replaced between the scan and the read: the next tick has it
        except (OSError, schema.SchemaError) as e:
            # The rank is shown corrupt, with what its last valid heartbeat said.
            # Viewers without the token read this: no content of the file.
            slot.error = f"{entry.name}: {_public(e)}"
            return
        self._accept(slot, rank, beat, entry.name, now)

    def _accept(self, slot: RankSlot, rank: int, beat: schema.Heartbeat, name: str, now: float) -> None:
        if beat.rank != rank:
            slot.error = f"{name} holds the heartbeat of rank {beat.rank}"
            return
        old = slot.hb
        same_process = old is not None and beat.started_at == old["started_at"]
        # Older only when neither its time nor its seq is newer: a seq that jumps (anyone who
        # writes the run directory can write seq + 10^6) must not lock out the process's later
        # beats, which come at newer times. ``old["time"]`` is clamped to when it was read,
        # so a future date cannot lock them out either.
        if same_process and beat.time <= old["time"] and beat.seq <= old["seq"]:
            # The same heartbeat again (a Redis resync repeats the newest), or
            # an older one of the same process (its less frequent file, read
            # while Redis carries the newer ones).
            slot.error = None
            return
        if same_process and (beat.seq < old["seq"]) != (beat.time < old["time"]):
            # One of seq and time went back: one process never does that (bar a clock stepped back).
            slot.second_writer = (
                f"{name}: a second writer: seq went from {old['seq']} to {beat.seq} while its time "
                f"went {'forward' if beat.time > old['time'] else 'back'} (another process or a forged "
                "file writes this rank's heartbeat, or its clock stepped back)"
            )
        if same_process and beat.seq > old["seq"]:
            self._advanced = True
        hb = beat.to_dict()
        if slot.second_writer:
            hb["warnings"] = [*hb["warnings"][: schema.MAX_WARNINGS - 1], slot.second_writer]
        slot.observe(hb, now)
        self._declared[rank] = beat.world_size

    def _new_slot(self, rank: int, now: float) -> RankSlot:
        slot = RankSlot(self.window, self.points)
        for point in read_history_tail(self.run_dir, rank, self.points):
            slot.add_point(point, now)
        return slot

    def _read_job(self) -> None:
        path = runfiles.job_path(self.run_dir)
        try:
            st = path.stat()
        except OSError:
            self.job, self._job_key, self.job_error, self.copied = None, None, None, None
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._job_key:
            self._job_key = key
            # Written atomically by rank 0, so a bad one is another tool's (or a disk's).
            try:
                self.job, self.job_error = schema.load(schema.Job, path).to_dict(), None
            except (OSError, schema.SchemaError) as e:
                self.job = None
                self.job_error = _public(e)
        # Each read, not only when job.json changes: a copy made with hard links (cp -al) shares its inode.
        self.copied = None if self._advanced else copies.copied(self.run_dir, self.job)

    def world_size(self) -> int:
        """The job's world size: job.json's, else the largest any heartbeat declares or implies."""
        if self.job is not None:
            return self.job["world_size"]
        return max(max(self._declared.values(), default=0), max(self.slots, default=-1) + 1)
