"""The dashboard's view of a run, rebuilt from the run directory alone.

``RunState.scan`` is called once per watcher tick (and by HTTP requests when
the view is older than a tick). Its cost grows with what changed, not with
the size of the job, wherever that is possible:

* one ``os.scandir`` of ``RUN/rankwatch/`` and a ``stat`` per heartbeat file;
  a file is read only when its (inode, mtime, size) changed, which every
  atomic rewrite guarantees;
* a rank's process is probed (psutil) only when its heartbeat is late;
* rows are rebuilt only for ranks whose heartbeat or verdict changed, and
  ``take_delta`` sends only the fields that changed since the last push.

The verdicts themselves are re-judged for every rank each tick, because
time alone turns a rank stalled or dead and every heartbeat moves the peer
median; that pass is a few comparisons per rank (about 5 ms of CPU per tick
at 1024 ranks on the benchmark machine), small beside reading the files.

A restarted dashboard rebuilds the same view: the rows from the heartbeat
files, the charts from the ``rank_{r}.history.jsonl`` tails.
"""
from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from app.health import (STEPPING_STATES, TERMINAL_STATES, VERDICTS, StepWindow, Thresholds,
                        Verdict, compare_costs, judge_all, median, number)
from trainer_bridge import runfiles

# The two events the view produces (documented in app/main/events.py).
SNAPSHOT_EVENT = "ranks_snapshot"
DELTA_EVENT = "ranks_delta"

HEARTBEAT_NAME = re.compile(r"rank_(\d+)\.json")
# Bytes read from the end of a history file per wanted line; the bridge's
# lines are about 150 bytes, so this comfortably covers the tail.
HISTORY_LINE_BUDGET = 400
# How many missing ranks a status message names before it summarises.
NAMED_RANKS = 8

ProcessProbe = Callable[[int, "float | None"], "str | None"]


class Stopped(str):
    """A probe's answer for a process that exists but is stopped (SIGSTOP, a debugger)."""


def probe_process(pid: int, started_at: float | None) -> str | None:
    """Why the process ``pid`` is known to be gone, or None if it runs (or cannot be told).

    A pid can be reused after the rank dies, so a process created after the
    rank's bridge started is not the rank. A stopped process is not gone: the
    answer is then a ``Stopped`` sentence.
    """
    try:
        proc = psutil.Process(pid)
        created = proc.create_time()
        status = proc.status()
    except psutil.NoSuchProcess:
        return f"process {pid} is gone"
    except psutil.AccessDenied:
        return None
    if status == psutil.STATUS_ZOMBIE:
        return f"process {pid} has exited (not yet reaped by its parent)"
    # create_time is rounded to clock ticks: allow a second of slack.
    if started_at is not None and created > started_at + 1.0:
        return f"pid {pid} now belongs to a newer process; the rank's process is gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return Stopped(f"process {pid} is stopped (SIGSTOP or a debugger; "
                       f"kill -CONT {pid} resumes it)")
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _round(value: Any, digits: int = 2) -> float | None:
    value = number(value)
    return None if value is None else round(value, digits)


def _loss(value: Any) -> float | None:
    value = number(value)
    return None if value is None else float(f"{value:.5g}")


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def read_history_tail(run_dir: str | os.PathLike, rank: int, points: int) -> list[dict]:
    """The newest ``points`` history entries of ``rank``, oldest first.

    Reads only the end of the current segment, and of the previous one
    (``.1``) if the current is short, so seeding 1024 ranks stays cheap
    however long the job has run. Bad lines (a torn append) are skipped.
    """
    current = runfiles.history_path(run_dir, rank)
    entries = _tail_entries(current, points)
    if len(entries) < points:
        entries = _tail_entries(current.with_name(current.name + ".1"),
                                points - len(entries)) + entries
    return entries


def _tail_entries(path: Path, count: int) -> list[dict]:
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - count * HISTORY_LINE_BUDGET)
            f.seek(start)
            data = f.read()
    except OSError:
        return []
    lines = data.split(b"\n")
    if start > 0:
        lines = lines[1:]  # the first one is cut
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries[-count:]


def history_point(entry: Mapping[str, Any]) -> tuple | None:
    """A chart point (t, global_step, loss, step time) from a heartbeat or a history line."""
    t = number(entry.get("t", entry.get("time")))
    if t is None:
        return None
    step_ms = number(entry.get("step_time_mean_ms"))
    if step_ms is None:
        step_ms = number(entry.get("step_time_ms"))
    return (t, _int(entry.get("global_step")), _loss(entry.get("loss")),
            None if step_ms is None else round(step_ms, 2))


class RankSlot:
    """What the dashboard knows about one rank that has written a heartbeat."""
    __slots__ = ("stat_key", "hb", "window", "history")

    def __init__(self, window: int, points: int):
        self.stat_key: tuple | None = None
        self.hb: dict | None = None
        self.window = StepWindow(window)
        self.history: deque[tuple] = deque(maxlen=points)

    def observe(self, hb: dict) -> None:
        self.hb = hb
        self.window.add(hb)
        self.add_point(hb)

    def add_point(self, entry: Mapping[str, Any]) -> None:
        """Append a chart point; the history line of the beat just seen adds nothing."""
        point = history_point(entry)
        if point and (not self.history or point[0] > self.history[-1][0]):
            self.history.append(point)


def make_row(rank: int, hb: Mapping[str, Any] | None, verdict: Verdict) -> dict:
    """A table row: the fields of ``/api/ranks`` (without the time-dependent heartbeat age)."""
    hb = hb or {}
    device = hb.get("device") if isinstance(hb.get("device"), dict) else {}
    stop = hb.get("stop") if isinstance(hb.get("stop"), dict) else {}
    kind, index = _str(device.get("kind")), _int(device.get("index"))
    warnings = hb.get("warnings") if isinstance(hb.get("warnings"), list) else []
    return {
        "rank": rank,
        "health": verdict.health,
        "reason": verdict.reason,
        "score": verdict.score,
        "state": _str(hb.get("state")),
        "epoch": _int(hb.get("epoch")),
        "step": _int(hb.get("step")),
        "global_step": _int(hb.get("global_step")),
        "loss": _loss(hb.get("loss")),
        "step_time_ms": _round(hb.get("step_time_ms")),
        "step_time_mean_ms": _round(hb.get("step_time_mean_ms")),
        "samples_per_s": _round(hb.get("samples_per_s"), 1),
        "host": _str(hb.get("host")),
        "pid": _int(hb.get("pid")),
        "cpu_percent": _round(hb.get("cpu_percent"), 1),
        "rss_bytes": _int(hb.get("rss_bytes")),
        "device": f"{kind}:{index}" if kind else None,
        "device_util_percent": _round(device.get("util_percent"), 1),
        "device_mem_used_bytes": _int(device.get("mem_used_bytes")),
        "device_mem_total_bytes": _int(device.get("mem_total_bytes")),
        "device_temp_c": _round(device.get("temp_c"), 1),
        "device_health": _str(device.get("health")),
        "stop_stage": _str(stop.get("stage")),
        "warnings": [w for w in warnings if isinstance(w, str)],
        # Millisecond precision is all a clock comparison needs, and saves bytes.
        "time": _round(hb.get("time"), 3),
        "last_step_at": _round(hb.get("last_step_at"), 3),
        "seq": _int(hb.get("seq")),
    }


def with_age(row: dict, now: float) -> dict:
    written = row["time"]
    age = None if written is None else round(max(0.0, now - written), 1)
    return {**row, "heartbeat_age_s": age}


class RunState:
    """The live view of one run directory; thread-safe (the watcher scans, requests read)."""

    def __init__(self, run_dir: str | os.PathLike | None, config: Mapping[str, Any], *,
                 probe: ProcessProbe = probe_process, hostname: str | None = None):
        self.run_dir = Path(run_dir) if run_dir else None
        self.thresholds = Thresholds.from_config(config)
        self.points = int(config["HISTORY_POINTS"])
        self.bucket_s = float(config["CHART_BUCKET_S"])
        self.check_after_s = float(config["PROCESS_CHECK_AFTER_S"])
        self._probe = probe
        self._hostname = hostname or socket.gethostname()
        self._lock = threading.Lock()
        self.scanned_at: float | None = None
        # Why RUN/rankwatch/ (or job.json) cannot be read right now, for the status line.
        self._read_error: str | None = None
        self._job_error: str | None = None
        self._clear()
        # Nobody has seen anything yet, and each client gets a snapshot when it
        # connects: the first tick's changes can go out as a plain delta.
        self._needs_snapshot = False

    def _clear(self) -> None:
        self._slots: dict[int, RankSlot] = {}
        self._job: dict | None = None
        self._job_key: tuple | None = None
        self._world = 0
        self._verdicts: dict[int, Verdict] = {}
        # rank -> ((pid, started_at), probed at, why gone or None)
        self._probes: dict[int, tuple] = {}
        self._rows: dict[int, dict] = {}
        self._sent: dict[int, dict] = {}
        self._dirty: set[int] = set()
        self._summary: dict = {}
        self._sent_summary: dict | None = None
        self._run: dict = {}
        self._sent_run: dict | None = None
        # Ranks can only be added by a delta; anything else (a run directory
        # deleted, a heartbeat removed) needs every client to take a snapshot.
        self._needs_snapshot = True

    # -- reading the run directory -------------------------------------------------

    def scan(self, now: float) -> None:
        """Bring the view up to date with the run directory at time ``now``."""
        with self._lock:
            self._scan(now)

    def refresh(self, now: float, max_age: float) -> None:
        """Scan unless the view is younger than ``max_age`` (HTTP reads call this)."""
        with self._lock:
            if self.scanned_at is None or now - self.scanned_at >= max_age:
                self._scan(now)

    def _scan(self, now: float) -> None:
        self.scanned_at = now
        changed = self._read_files()
        world = self._world_size()
        view = set(range(world)) | set(self._slots)
        if not view >= set(self._rows):
            # Ranks vanished (a smaller job reuses the directory): start over.
            self._clear()
            changed = self._read_files()
            world = self._world_size()
            view = set(range(world)) | set(self._slots)
        self._world = world
        latest = {r: (self._slots[r].hb if r in self._slots else None) for r in view}
        own = {r: (self._slots[r].window.median_ms if r in self._slots else None) for r in view}
        split = {r: (self._slots[r].window.split_ms if r in self._slots else None) for r in view}
        steps = {r: self._slots[r].window.steps for r in view if r in self._slots}
        gone, stopped, alive = self._probe_late(latest, now)
        verdicts = judge_all(latest, own, now, self.thresholds, gone, split,
                             process_stopped=stopped, process_alive=alive, steps=steps)
        for r, verdict in verdicts.items():
            if r in changed or self._verdicts.get(r) != verdict:
                self._rows[r] = make_row(r, latest[r], verdict)
                self._dirty.add(r)
        self._verdicts = verdicts
        self._summary = self._make_summary(latest, own, verdicts, split)
        self._run = self._make_run_status(latest)

    def _read_files(self) -> set[int]:
        """Read new heartbeats and job.json; returns the ranks whose heartbeat changed."""
        if self.run_dir is None:
            return set()
        sdir = runfiles.state_dir(self.run_dir)
        try:
            entries = list(os.scandir(sdir))
        except FileNotFoundError:
            # Gone (deleted, or not created yet): whatever was shown is over.
            self._read_error = None
            if self._slots or self._job:
                self._clear()
            return set()
        except OSError as e:
            # There but unreadable (not a directory, permissions, I/O error):
            # keep the last view, whose heartbeats now age, and say why.
            self._read_error = f"{e.strerror or e}"
            return set()
        self._read_error = None
        self._read_job()
        changed, present = set(), set()
        for entry in entries:
            match = HEARTBEAT_NAME.fullmatch(entry.name)
            if not match:
                continue
            rank = int(match.group(1))
            try:
                st = entry.stat()
            except OSError:
                continue
            present.add(rank)
            slot = self._slots.get(rank)
            if slot is None:
                slot = self._slots[rank] = self._new_slot(rank)
            key = (st.st_ino, st.st_mtime_ns, st.st_size)
            if key == slot.stat_key:
                continue
            slot.stat_key = key
            hb = runfiles.read_json_or_none(entry.path)
            # A bad file is "no new data": keep what the last good one said.
            if isinstance(hb, dict):
                slot.observe(hb)
                changed.add(rank)
        for rank in set(self._slots) - present:
            del self._slots[rank]
        return changed

    def _new_slot(self, rank: int) -> RankSlot:
        slot = RankSlot(self.thresholds.straggler_window, self.points)
        for entry in read_history_tail(self.run_dir, rank, self.points):
            slot.add_point(entry)
        return slot

    def _read_job(self) -> None:
        path = runfiles.job_path(self.run_dir)
        try:
            st = path.stat()
        except OSError:
            self._job, self._job_key, self._job_error = None, None, None
            return
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        if key != self._job_key:
            self._job_key = key
            job = runfiles.read_json_or_none(path)
            self._job = job if isinstance(job, dict) else None
            # Written atomically by rank 0, so a bad one is another tool's (or a disk's).
            self._job_error = None if self._job else "not a JSON object"

    def _world_size(self) -> int:
        declared = _int((self._job or {}).get("world_size"))
        if declared is not None and declared > 0:
            return declared
        sizes = [_int(s.hb.get("world_size")) or 0 for s in self._slots.values() if s.hb]
        return max([*sizes, max(self._slots, default=-1) + 1])

    def _probe_late(self, latest: Mapping[int, dict | None],
                    now: float) -> tuple[dict[int, str], dict[int, str], set[int]]:
        """Probe the processes of this host's ranks whose heartbeat is late.

        Returns (gone: rank -> why, stopped: rank -> sentence, alive: ranks
        whose process runs). Each late rank is probed at most once per
        ``PROCESS_CHECK_AFTER_S``, and a process found gone stays gone, so a
        hung 1024-rank job costs few probes.
        """
        gone, stopped, alive = {}, {}, set()
        for r, hb in latest.items():
            if not hb or hb.get("state") in TERMINAL_STATES or hb.get("host") != self._hostname:
                continue
            written, pid = number(hb.get("time")), _int(hb.get("pid"))
            if pid is None or written is None or now - written < self.check_after_s:
                continue
            started = number(hb.get("started_at"))
            who, checked_at, why = self._probes.get(r, (None, None, None))
            if who != (pid, started) or ((why is None or isinstance(why, Stopped))
                                         and now - checked_at >= self.check_after_s):
                why = self._probe(pid, started)
                self._probes[r] = ((pid, started), now, why)
            if isinstance(why, Stopped):
                stopped[r] = f"{why} (host {self._hostname})"
            elif why:
                gone[r] = f"{why} (host {self._hostname})"
            else:
                alive.add(r)
        return gone, stopped, alive

    # -- derived views --------------------------------------------------------------

    def _make_summary(self, latest, own, verdicts, split=None) -> dict:
        counts = dict.fromkeys(VERDICTS, 0)
        for v in verdicts.values():
            counts[v.health] += 1
        alive = [r for r, v in verdicts.items() if v.health in ("healthy", "straggler", "stalled")]
        # The same cost the straggler rule compares: own work per step in a
        # synchronous job (whose wall step times are all equal), else wall time.
        basis, costs, _ = compare_costs(latest, own, split)
        stepping = [(costs[r], r) for r in alive
                    if costs[r] is not None and latest[r].get("state") in STEPPING_STATES]
        slowest = None
        if stepping:
            mid = median(sorted(t for t, _ in stepping))
            worst, rank = max(stepping)
            slowest = {"rank": rank, "step_time_ms": round(worst, 2), "median_ms": round(mid, 2),
                       "gap_ms": round(worst - mid, 2),
                       "ratio": round(worst / mid, 2) if mid > 0 else None, "basis": basis}
        rates = [number(latest[r].get("samples_per_s")) for r in alive
                 if latest[r].get("state") in STEPPING_STATES]
        steps_at = [t for t in (number(hb.get("last_step_at")) for hb in latest.values() if hb)
                    if t is not None]
        gsteps = [g for g in (_int(hb.get("global_step")) for hb in latest.values() if hb)
                  if g is not None]
        return {
            "world_size": self._world,
            "reported": sum(1 for hb in latest.values() if hb),
            "counts": counts,
            "slowest": slowest,
            "throughput": round(sum(r for r in rates if r is not None), 1),
            "last_step_at": max(steps_at, default=None),
            "global_step": max(gsteps, default=None),
        }

    def _make_run_status(self, latest) -> dict:
        """Whether the job is there at all, and what to tell the operator if not."""
        def status(kind: str, message: str) -> dict:
            return {"status": kind, "message": message, "run_dir": str(self.run_dir or "")}

        if self.run_dir is None:
            return status("missing", "No run directory was given: start the dashboard with "
                                     "--run-dir RUN (or RANKWATCH_RUN_DIR).")
        if not self.run_dir.is_dir():
            return status("missing", f"The run directory {self.run_dir} does not exist (yet). "
                                     "The dashboard keeps watching and fills in when the job "
                                     "starts; check the path if this persists.")
        sdir = runfiles.state_dir(self.run_dir)
        reported = sum(1 for hb in latest.values() if hb)
        if self._read_error:
            shown = (f" The table shows what was read last ({reported} rank"
                     f"{'' if reported == 1 else 's'}); their heartbeats age until it is readable."
                     if reported else "")
            return status("unreadable", f"Cannot read {sdir}: {self._read_error}. The ranks write "
                                        "their heartbeats there, so they cannot report either; check "
                                        "that it is a directory this user can read (and that the disk "
                                        f"is healthy).{shown}")
        if not reported and not self._job and self._job_error:
            return status("waiting", f"{runfiles.job_path(self.run_dir)} is unreadable "
                                     f"({self._job_error}) and no rank has written a heartbeat "
                                     "yet: the job has not started, or another tool wrote that "
                                     "file. The dashboard picks the job up when rank 0 rewrites "
                                     "it at start.")
        if not reported and not self._job:
            return status("waiting", f"The job has not started: {sdir} holds no job.json and no "
                                     "heartbeats yet. Rank 0 writes job.json when the bridge "
                                     "starts; each rank then writes rank_N.json about once a "
                                     "second.")
        note = ("" if self._job else
                f" (job.json is unreadable: {self._job_error}; the world size comes from the "
                "heartbeats)" if self._job_error else
                " (job.json is missing, so the world size comes from the heartbeats)")
        missing = sorted(r for r, hb in latest.items() if hb is None)
        if not reported:
            return status("starting", f"The job has started (world size {self._world}) but no rank "
                                      "has written a heartbeat yet. Ranks report once the bridge "
                                      "is running, usually after graph compilation.")
        if missing:
            named = ", ".join(map(str, missing[:NAMED_RANKS]))
            more = f" and {len(missing) - NAMED_RANKS} more" if len(missing) > NAMED_RANKS else ""
            return status("starting", f"{reported} of {self._world} ranks have reported; "
                                      f"waiting for rank{'s' if len(missing) > 1 else ''} "
                                      f"{named}{more}.{note}")
        if all(hb.get("state") in TERMINAL_STATES for hb in latest.values()):
            counts = {}
            for hb in latest.values():
                counts[hb["state"]] = counts.get(hb["state"], 0) + 1
            told = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            return status("ended", f"The job has ended: {told}.")
        return status("running", f"{self._world} ranks reporting.{note}")

    # -- what clients get ---------------------------------------------------------------

    def snapshot(self, now: float, health: Iterable[str] | None = None) -> dict:
        """The whole view (``/api/ranks`` and the ``ranks_snapshot`` event)."""
        with self._lock:
            return self._snapshot(now, set(health) if health else None)

    def summary(self, now: float) -> dict:
        """The summary strip and the run status (``/api/summary``)."""
        with self._lock:
            return self._head(now)

    def _head(self, now: float) -> dict:
        return {"now": now, "world_size": self._world, "run": self._run, "summary": self._summary}

    def _snapshot(self, now: float, wanted: set[str] | None = None) -> dict:
        rows = [with_age(self._rows[r], now) for r in sorted(self._rows)
                if wanted is None or self._rows[r]["health"] in wanted]
        return {**self._head(now), "ranks": rows}

    def heartbeats(self) -> tuple[dict[int, dict | None], int]:
        """(each rank's newest heartbeat, or None if it has not reported; the world size)."""
        with self._lock:
            view = set(range(self._world)) | set(self._slots)
            return {r: (self._slots[r].hb if r in self._slots else None) for r in view}, self._world

    def rank(self, rank: int, now: float) -> dict | None:
        with self._lock:
            row = self._rows.get(rank)
            if row is None:
                return None
            slot = self._slots.get(rank)
            points = list(slot.history) if slot else []
        return {"now": now, "rank": with_age(row, now),
                "history": [dict(zip(("t", "global_step", "loss", "step_time_ms"), p))
                            for p in points]}

    def take_delta(self, now: float) -> tuple[str, dict] | None:
        """What to push since the last call: (DELTA_EVENT, changed fields), a snapshot, or None.

        Each changed row carries only the fields that differ from what was last
        pushed (plus ``rank``); the summary and run status come only when they
        changed. A removal (rank files deleted, run directory replaced) cannot
        be a delta, so it yields a snapshot.
        """
        with self._lock:
            if self._needs_snapshot:
                self._needs_snapshot = False
                self._dirty.clear()
                self._sent = dict(self._rows)
                self._sent_summary, self._sent_run = self._summary, self._run
                return SNAPSHOT_EVENT, self._snapshot(now)
            changes = []
            for r in sorted(self._dirty):
                row, old = self._rows[r], self._sent.get(r, {})
                diff = {k: v for k, v in row.items() if k not in old or old[k] != v}
                if diff:
                    diff["rank"] = r
                    changes.append(diff)
                self._sent[r] = row
            self._dirty.clear()
            delta: dict[str, Any] = {}
            if changes:
                delta["rows"] = changes
            if self._summary != self._sent_summary:
                delta["summary"] = self._sent_summary = self._summary
            if self._run != self._sent_run:
                delta["run"] = self._sent_run = self._run
            if not delta:
                return None
            return DELTA_EVENT, {"now": now, "world_size": self._world, **delta}

    def history(self, points: int | None = None) -> dict:
        """Chart history as a ranks x time-bucket matrix (``/api/history``).

        Columns are buckets of ``CHART_BUCKET_S`` seconds, the newest ``points``
        of them ending at the newest point; a cell holds the rank's last value
        in that bucket, or null. The page seeds its charts from this and then
        extends them from deltas, so both sides bucket the same way.
        """
        points = min(points or self.points, self.points)
        with self._lock:
            series = {r: list(s.history) for r, s in self._slots.items() if s.history}
            ranks = sorted(self._rows)
        b = self.bucket_s
        newest = max((h[-1][0] for h in series.values()), default=None)
        if newest is None:
            return {"bucket_s": b, "t": [], "ranks": ranks, "step_time_ms": [], "loss": []}
        end = math.floor(newest / b)
        start = max(end - points + 1,
                    min(math.floor(h[0][0] / b) for h in series.values()))
        width = end - start + 1
        step_rows, loss_rows = [], []
        for r in ranks:
            steps, losses = [None] * width, [None] * width
            for t, _, loss, step_ms in series.get(r, ()):
                col = math.floor(t / b) - start
                if col >= 0:
                    steps[col], losses[col] = step_ms, loss
            step_rows.append(steps)
            loss_rows.append(losses)
        return {"bucket_s": b, "t": [(start + i) * b for i in range(width)], "ranks": ranks,
                "step_time_ms": step_rows, "loss": loss_rows}
