"""The dashboard's side of stack captures: read them, ask for them, group them across ranks.

Who captures a rank (``route``):

* **its bridge**, through a request file in the run directory (any host);
* **py-spy, run by the dashboard**, for a rank on the dashboard's own host
  whose bridge cannot answer: no bridge (log mode), a stopped process
  (SIGSTOP: its reporter is stopped too), or one that sends no heartbeats;
* **nobody**, and the answer says why: a rank that has ended, or one on
  another host that its bridge cannot answer for.

Captures, whoever took them, are ``trainer_bridge.rundir.stackfiles.Capture`` files in
``RUN/rankwatch/stacks/rank_{r}/``. Grouping compares the training thread's
Python frames, so "every rank waiting in the same AllReduce" is one group
whatever the ranks' step numbers, and the odd one out stands alone.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from app.errors import CannotWrite, CaptureRefused, NoRunDir, NotFound, RankNotFound
from app.incidents.alerts import ranks_text
from app.incidents.captures import MAX_TRIED, Budget, CaptureReader
from app.incidents.proof import prove_rank
from app.run.heartbeats import Stopped, probe_process
from app.run.state import RunState
from app.run.verdicts import TERMINAL_STATES
from trainer_bridge.rundir import pyspy, runfiles, safeio, schema, stackfiles

ENDED = ("exited", "finished", "failed")
# Native frames naming the collective a thread waits in, most specific first.
COLLECTIVES = ("AllReduce", "AllGather", "ReduceScatter", "AllToAll", "Broadcast", "Barrier", "Send", "Recv")
_LIBRARY = re.compile(r"[/\\](?:site|dist)-packages[/\\]|[/\\]lib[/\\]python3[^/\\]*[/\\]|^<")


def route(
    rank: int, row: dict | None, probe: str | None, *, hostname: str, pyspy: bool
) -> tuple[str | None, str]:
    """How rank ``rank`` can be captured: ``("bridge" | "py-spy", why)``, or ``(None, why not)``.

    ``row`` is its ``/api/ranks`` row; ``probe`` what ``probe_process`` says
    of its pid when it runs on this host (None: running, or not probed).
    """
    if row is None or row.get("health") == "pending":
        return None, f"rank {rank} has not reported yet, so no process is known to capture"
    health, host, pid = row["health"], row.get("host"), row.get("pid")
    if health in ENDED:
        return None, f"rank {rank} has {health}: its process has ended (its newest capture stays readable)"
    local = host == hostname
    if local and probe and not isinstance(probe, Stopped):
        return None, f"rank {rank}'s {probe}"
    stopped = local and isinstance(probe, Stopped)
    with_bridge = (row.get("source") or "bridge") == "bridge"
    if with_bridge and not stopped and health not in ("dead", "node_lost"):
        return "bridge", "its bridge answers through the run directory"
    if stopped:
        why = f"process {pid} is stopped, so its bridge cannot answer"
    elif with_bridge:
        why = f"it is {health}, so its bridge may not answer"
    else:
        why = "it runs without the bridge"
    if pid is None:
        return None, f"rank {rank} {why.removeprefix('it ')}, and its heartbeat names no process id"
    if local:
        if not pyspy:
            return None, (
                f"{why}, and py-spy is not installed beside the dashboard's Python "
                "(pip install py-spy, or set PYSPY_PATH)"
            )
        return "py-spy", f"{why}: the dashboard runs py-spy on pid {pid}"
    return None, (
        f"rank {rank} {why.removeprefix('it ')}, and it runs on {host}, not on the dashboard's host "
        f"{hostname} where py-spy could read it: run `py-spy dump --pid {pid}` on {host}"
    )


def _short(path: str) -> str:
    """A frame's file as a reader wants it: the package path for libraries, the name for scripts."""
    m = re.search(r"[/\\](?:site|dist)-packages[/\\](.*)$", path)
    if m:
        return m.group(1)
    return os.path.basename(path) or path


def _at(frame: dict) -> str:
    line = f":{frame['line']}" if frame.get("line") else ""
    return f"`{frame['function']}` ({_short(frame['file'])}{line})"


def collective(native: list[dict]) -> str | None:
    """The collective a thread waits in, from its native frames (innermost first), if any."""
    for frame in native:
        for name in COLLECTIVES:
            if name in frame["function"]:
                return name
    return None


def describe(thread: dict | None) -> str:
    """Where a training thread is, in a phrase: "in `hang_here` (train.py:42)"."""
    if thread is None:
        return "with no training thread in the capture"
    frames = thread["frames"]
    waiting = collective(thread.get("native") or [])
    if not frames:
        return f"waiting in `{waiting}`" if waiting else "in native code only"
    inner = frames[0]
    user = next((f for f in frames if not _LIBRARY.search(f["file"])), None)
    phrase = f"waiting in `{waiting}` under {_at(inner)}" if waiting else f"in {_at(inner)}"
    if user is not None and user is not inner:
        phrase += f", called from {_at(user)}"
    return phrase


def training_thread(capture: dict) -> dict | None:
    return next((t for t in capture["threads"] if t["training"]), None)


def _write_request(run_dir: Path, rank: int | None, request: stackfiles.Request) -> None:
    """Leave the request file for the bridges; 507 if it cannot be (a full disk, a symlinked ``stacks/``)."""
    try:
        stackfiles.write_request(run_dir, rank, request)
    except (OSError, safeio.UnsafePath) as e:
        why = safeio.why(e) if isinstance(e, OSError) else str(e)
        raise CannotWrite(f"cannot write the stack request file: {why}") from None


class StackService:
    """Reads, requests and groups stack captures for one run directory."""

    def __init__(
        self,
        run_dir: str | os.PathLike | None,
        state: RunState,
        *,
        start_task: Callable,
        hostname: str | None = None,
        probe: Callable = probe_process,
        pyspy: Callable[[], str | None] = pyspy.find_pyspy,
        log_dir: str | os.PathLike | None = None,
    ):
        self.run_dir = Path(run_dir) if run_dir else None
        # A run under --runs is its descriptor (app/runs/pinned.py): held open while this reads by it.
        self._pinned = run_dir
        self.log_dir = log_dir
        self.state = state
        self.hostname = hostname or socket.gethostname()
        self._start_task = start_task
        self._probe = probe
        self._pyspy = pyspy
        self._lock = threading.Lock()
        self._pending: dict[int, dict] = {}  # rank -> the newest request made through this dashboard
        self._reader = CaptureReader(self.run_dir) if self.run_dir else None

    def _need_run_dir(self) -> Path:
        if self.run_dir is None:
            raise NoRunDir()
        return self.run_dir

    # ------------------------------------------------------------------ reading
    def newest(self, rank: int, trigger: str | None = None) -> dict | None:
        """Rank ``rank``'s newest valid capture (of ``trigger``, if given), among its newest ``MAX_TRIED`` files.

        One rank's files always fit a request's read budget, so None means none is valid.
        """
        self._need_run_dir()
        found, _ = self._reader.newest([rank], Budget(), trigger)
        return found.get(rank)

    def get(self, rank: int, now: float, trigger: str | None = None) -> dict:
        """``GET /api/ranks/<rank>/stack``: the newest capture (of ``trigger``, one of ``stackfiles.TRIGGERS``), with its age and any pending request."""
        capture = self.newest(rank, trigger)
        if capture is None:
            pending = self._pending_for(rank, None)
            asked = f"; a capture was requested {now - pending['requested_at']:.0f} s ago" if pending else ""
            raise NotFound(
                f"no stack capture of rank {rank} yet{asked}: POST /api/ranks/{rank}/stack asks for one "
                "(a bridge also captures by itself when its rank stops stepping)",
            )
        hbs, _ = self.state.heartbeats()
        started = (hbs.get(rank) or {}).get("started_at")
        others = [
            {
                "name": p.name,
                "trigger": p.stem.rpartition("-")[2],
                "captured_at": int(p.stem.partition("-")[0]) / 1e3,
            }
            for p in self._reader.files(rank)[:MAX_TRIED]
            if p.stem.partition("-")[0].isdigit()
        ]
        return {
            **capture,
            "age_s": round(max(0.0, now - capture["captured_at"]), 1),
            # Taken before the rank's current process started: an earlier run's.
            "stale": started is not None and capture["captured_at"] < started - 1.0,
            "pending": self._pending_for(rank, capture),
            "captures": others,
        }

    def _pending_for(self, rank: int, capture: dict | None) -> dict | None:
        with self._lock:
            pending = self._pending.get(rank)
        if pending is None:
            request = stackfiles.read_request(self.run_dir, rank) if self.run_dir else None
            if request is None:
                return None
            pending = {**request.to_dict(), "via": "bridge"}
        if capture is not None and capture.get("request_id") == pending["request_id"]:
            return None
        return pending

    # ------------------------------------------------------------------ asking
    def _probe_local(self, row: dict, started_at: float | None) -> str | None:
        if row.get("host") != self.hostname or row.get("pid") is None or row.get("health") in ENDED:
            return None
        return self._probe(row["pid"], started_at)

    def request(self, rank: int, who: str, native: bool, now: float) -> dict:
        """``POST /api/ranks/<rank>/stack``: ask rank ``rank`` for a fresh capture (202 body)."""
        run_dir = self._need_run_dir()
        found = self.state.rank(rank, now)
        if found is None:
            raise RankNotFound(rank)
        row = found["rank"]
        started = self.state.started_at(rank)
        probe = self._probe_local(row, started)
        via, why = route(rank, row, probe, hostname=self.hostname, pyspy=self._pyspy() is not None)
        if via == "py-spy":
            proven, how = self._prove(rank, row, started)
            if not proven:
                via, why = None, how
            else:
                why = f"{why} ({how})"
        if via is None:
            raise CaptureRefused(f"cannot capture rank {rank}: {why}")
        request = stackfiles.Request(
            request_id=runfiles.new_request_id(), requested_at=now, requested_by=who, native=native
        )
        if via == "bridge":
            _write_request(run_dir, rank, request)
        else:
            self._start_task(self._pyspy_capture, rank, row, request, isinstance(probe, Stopped), started)
        pending = {**request.to_dict(), "via": via}
        with self._lock:
            self._pending[rank] = pending
        return {"rank": rank, **pending, "why": why}

    def request_all(self, who: str, native: bool, now: float) -> dict:
        """``POST /api/stacks``: ask every rank (one request file for all bridges, py-spy for the rest)."""
        run_dir = self._need_run_dir()
        rows = self.state.snapshot(now)["ranks"]
        request = stackfiles.Request(
            request_id=runfiles.new_request_id(), requested_at=now, requested_by=who, native=native
        )
        pyspy = self._pyspy() is not None
        by_bridge, by_pyspy, cannot = [], [], {}
        for row in rows:
            r = row["rank"]
            started = self.state.started_at(r)
            probe = self._probe_local(row, started)
            via, why = route(r, row, probe, hostname=self.hostname, pyspy=pyspy)
            if via == "py-spy":
                proven, how = self._prove(r, row, started)
                via, why = ("py-spy", why) if proven else (None, how)
            if via == "bridge":
                by_bridge.append(r)
            elif via == "py-spy":
                by_pyspy.append(r)
                self._start_task(self._pyspy_capture, r, row, request, isinstance(probe, Stopped), started)
            else:
                cannot[r] = why
        if by_bridge:
            _write_request(run_dir, None, request)
        pending = {**request.to_dict()}
        with self._lock:
            for r in by_bridge:
                self._pending[r] = {**pending, "via": "bridge"}
            for r in by_pyspy:
                self._pending[r] = {**pending, "via": "py-spy"}
        return {**pending, "bridge": by_bridge, "py_spy": by_pyspy, "cannot": cannot}

    def _prove(self, rank: int, row: dict, started_at: float | None) -> tuple[bool, str]:
        """py-spy runs only on a process proven to be this rank (``app.incidents.proof``)."""
        return prove_rank(row["pid"], rank, started_at, self._need_run_dir(), self.log_dir)

    def _pyspy_capture(
        self, rank: int, row: dict, request: stackfiles.Request, stopped: bool, started_at: float | None
    ) -> None:
        try:
            # Again just before the dump: the pid may have changed hands since the request.
            proven, how = self._prove(rank, row, started_at)
            if not proven:
                raise pyspy.PySpyError(how)
            pyspy.capture_pyspy(
                self.run_dir,
                rank,
                row["pid"],
                row.get("host"),
                request_id=request.request_id,
                # Native frames need the threads paused, which a stopped process cannot be.
                native=request.native and not stopped,
                global_step=row.get("global_step"),
                exe=self._pyspy(),
            )
        except (pyspy.PySpyError, OSError, schema.SchemaError) as e:
            with self._lock:
                pending = self._pending.get(rank)
                if pending is not None and pending["request_id"] == request.request_id:
                    pending["error"] = str(e)

    # ------------------------------------------------------------------ grouping
    def grouped(self, now: float, request_id: str | None = None) -> dict:
        """``GET /api/stacks``: ranks grouped by identical training-thread stacks, odd ones first.

        With ``request_id``, ``answered`` counts the ranks whose newest
        capture answers that request (the page polls it after asking all).
        """
        self._need_run_dir()
        hbs, world = self.state.heartbeats()
        ranks = sorted(set(range(world)) | set(hbs))
        groups: dict[tuple, dict] = {}
        missing = []
        answered = 0
        budget = Budget()
        captures, unread = self._reader.newest(ranks, budget)
        for r in ranks:
            if r not in captures:
                continue
            capture = captures[r]
            started = (hbs.get(r) or {}).get("started_at")
            if capture is None or (started is not None and capture["captured_at"] < started - 1.0):
                missing.append(r)
                continue
            answered += request_id is not None and capture.get("request_id") == request_id
            thread = training_thread(capture)
            frames = thread["frames"] if thread else []
            key = (
                tuple((f["function"], f["file"], f["line"]) for f in frames),
                collective(thread.get("native") or []) if thread else None,
            )
            group = groups.get(key)
            if group is None:
                group = groups[key] = {
                    "ranks": [],
                    "where": describe(thread),
                    "thread": thread,
                    "example_rank": r,
                    "captured_from": capture["captured_at"],
                    "captured_to": capture["captured_at"],
                    "triggers": {},
                }
            group["ranks"].append(r)
            group["captured_from"] = min(group["captured_from"], capture["captured_at"])
            group["captured_to"] = max(group["captured_to"], capture["captured_at"])
            group["triggers"][capture["trigger"]] = group["triggers"].get(capture["trigger"], 0) + 1
        ordered = sorted(groups.values(), key=lambda g: (len(g["ranks"]), g["ranks"][0]))
        parts = []
        for g in ordered:
            g["ranks_text"] = ranks_text(g["ranks"])
            # Every rank of the group has ended since: the stack is history, not what runs now.
            g["stale"] = all((hbs.get(r) or {}).get("state") in TERMINAL_STATES for r in g["ranks"])
            word = "rank" if len(g["ranks"]) == 1 else "ranks"
            g["summary"] = f"{word} {g['ranks_text']} {g['where']}"
            parts.append(g["summary"])
        if missing:
            parts.append(f"rank{'s' if len(missing) > 1 else ''} {ranks_text(missing, 16)}: no capture yet")
        if unread:
            parts.append(
                f"rank{'s' if len(unread) > 1 else ''} {ranks_text(unread, 16)}: captures not read yet "
                f"(this request read its {budget.bytes // 1024 // 1024} MiB of capture files; ask again)"
            )
        return {
            "now": now,
            "world_size": world,
            "captured": len(ranks) - len(missing) - len(unread),
            "answered": answered if request_id is not None else None,
            "missing": missing,
            "unread": unread,
            "read": {"files": budget.files, "bytes": budget.bytes},
            "text": "; ".join(parts) if parts else "no stack captures yet",
            "groups": ordered,
        }
