"""Stack captures: what every thread of a rank is doing right now.

Both sides use this module, so it must not import mindspore:

* the bridge's reporter calls ``StackWatcher.poll`` with each flag poll
  (``poll_interval_s``, 1 s): on the training thread at an agreement step
  while steps flow, on the reporter's own thread while they do not
  (``reporter.py``). It answers the requests the dashboard leaves as files in the run
  directory (files reach ranks on other nodes with no network path to them),
  and captures once on its own when the rank stops stepping (a stall), so a
  hang that later clears, or kills the job, still leaves evidence;
* the dashboard reads the captures, and writes its own, in the same format,
  from ``py-spy dump`` for ranks on its host that the bridge cannot answer
  for (no bridge, or a stopped process).

A capture holds every Python thread's stack (``sys._current_frames()``,
names from ``threading.enumerate()``), innermost frame first as py-spy
prints them. Where ``py-spy`` is installed, a stall capture (and a request
that asks for it) adds the native frames below the innermost Python frame
of each thread (``py-spy dump --native``), which name the collective a
rank waits in (``CollectiveOpsImpl::AllReduce<float>``). Unwinding them
pauses the process for about a second, harmless for a rank that is stuck
anyway, so a plain request leaves them out. The capture runs on a
short-lived thread of its own, so neither a slow py-spy nor a deep stack
delays a heartbeat, and it works while the training thread is blocked in a
collective or a C call.

The files' format, their text and their bounds are ``trainer_bridge.rundir.stackfiles``
. Layout (see ``runfiles``)::

    RUN/rankwatch/stacks/rank_{r}.request.json   asks rank r for a capture
    RUN/rankwatch/stacks/all.request.json        asks every rank
    RUN/rankwatch/stacks/rank_{r}/{ms}-{trigger}.json   rank r's captures

A request is any new version of a request file (its inode, mtime and size):
a file already there when the bridge starts is an old job's and is not
answered. Each rank keeps its newest ``KEEP_PER_TRIGGER`` captures per
trigger, so a burst of requests never pushes out a stall's evidence, and
every capture is bounded (threads, frames, text), so a rank's captures take
at most a few MB.
"""

from __future__ import annotations

import collections
import linecache
import logging
import os
import sys
import threading
import time
from pathlib import Path

from trainer_bridge.rundir import runfiles, schema
from trainer_bridge.rundir.pyspy import PySpyError, add_native, find_pyspy, pyspy_dump
from trainer_bridge.rundir.stackfiles import (
    FRAME_FILE,
    FRAME_TEXT,
    MAX_FRAMES,
    MAX_THREADS,
    Capture,
    Request,
    _clip,
    build_capture,
    write_capture,
)

log = logging.getLogger("trainer_bridge")


# The bridge's automatic capture: seconds without a finished step, or
# STALL_FACTOR x the rank's mean step time if that is longer (the dashboard's
# stall rule with its default settings, so the capture is there by the time
# the page says stalled). 0 turns it off.
STALL_ENV = "RANKWATCH_STALL_CAPTURE_S"
STALL_AFTER_S = 5.0
STALL_FACTOR = 5.0
# "off" leaves native frames out (py-spy is then never run by the bridge).
NATIVE_ENV = "RANKWATCH_STACK_NATIVE"


# ---------------------------------------------------------------- capturing


def python_threads(training: int | None, skip: frozenset[int] = frozenset()) -> tuple[list[dict], int]:
    """Every Python thread of this process (``Thread`` fields), the training thread first.

    ``training`` is the ``threading.get_ident()`` of the training thread;
    ``skip`` holds idents left out (the capturing thread itself). Returns
    (threads, how many were left out for ``MAX_THREADS``).
    """
    by_ident = {t.ident: t for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident in skip:
            continue
        thread = by_ident.get(ident)
        frames, depth = [], 0
        # The calling thread starts where it called: this function is no news.
        f = frame.f_back if ident == threading.get_ident() else frame
        while f is not None:
            if len(frames) < MAX_FRAMES:
                code = f.f_code
                lineno = f.f_lineno or 0
                source = linecache.getline(code.co_filename, lineno).strip() if lineno else ""
                frames.append(
                    {
                        "function": _clip(getattr(code, "co_qualname", code.co_name), FRAME_TEXT),
                        "file": _clip(code.co_filename, FRAME_FILE),
                        "line": lineno,
                        "code": _clip(source, FRAME_TEXT) or None,
                    }
                )
            depth += 1
            f = f.f_back
        native_id = getattr(thread, "native_id", None) if thread is not None else None
        out.append(
            {
                "id": native_id if native_id is not None else ident,
                "name": _clip(thread.name, 200) if thread is not None else None,
                "training": ident == training,
                "frames": frames,
                "omitted": depth - len(frames),
                "native": [],
            }
        )
    out.sort(key=lambda t: (not t["training"], t["name"] or "~", t["id"]))
    return out[:MAX_THREADS], max(0, len(out) - MAX_THREADS)


# ---------------------------------------------------------------- the bridge side


def _stall_after_s() -> float:
    """``STALL_ENV`` in seconds; a bad value is logged and the default kept (training goes on)."""
    raw = os.environ.get(STALL_ENV, "").strip()
    if not raw:
        return STALL_AFTER_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        log.warning(
            "rankwatch: %s must be seconds >= 0 (0: off), not %r; using %g", STALL_ENV, raw, STALL_AFTER_S
        )
        return STALL_AFTER_S
    return value


class StackWatcher:
    """The bridge's side: answers stack requests and captures once per stall.

    Built on the training thread (which it marks as such in captures);
    ``poll`` is called by the reporter, on either thread. Nothing here raises into
    its caller or blocks it: captures run on a thread of their own, and
    problems are logged once per kind.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int, host: str | None = None):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.host = host
        self.training = threading.get_ident()
        self.stall_after_s = _stall_after_s()
        self.native = os.environ.get(NATIVE_ENV, "auto").strip().lower() != "off"
        self._pyspy = find_pyspy() if self.native else None
        self._paths = (
            runfiles.stack_request_path(self.run_dir, rank),
            runfiles.stack_request_path(self.run_dir, None),
        )
        # Requests already there were made for an earlier job: not answered.
        self._seen = {p: self._signature(p) for p in self._paths}
        self._stalled_at: int | None = None  # steps_total when the last stall capture was taken
        self._jobs: collections.deque = collections.deque(maxlen=4)
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        self.captures = 0

    @staticmethod
    def _signature(path: Path) -> tuple | None:
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def poll(
        self,
        *,
        steps: int,
        since_step_s: float | None,
        step_s: float | None,
        global_step: int | None,
        stepping: bool,
    ) -> None:
        """Answer new requests; capture once if the rank has not finished a step for too long.

        ``steps``: steps finished so far (a stall ends when it moves);
        ``since_step_s``: seconds since the last one; ``step_s``: the recent
        mean step time; ``stepping``: the rank is training or stopping (not
        starting, when compiling may take minutes, nor saving).
        """
        try:
            facts = {"global_step": global_step, "since_step_s": since_step_s}
            for path in self._paths:
                request = self._new_request(path)
                if request is not None:
                    self._start("request", request.request_id, request.native, facts)
            if stepping and steps > 0 and since_step_s is not None and self.stall_after_s > 0:
                limit = max(self.stall_after_s, STALL_FACTOR * (step_s or 0.0))
                if since_step_s > limit and self._stalled_at != steps:
                    self._stalled_at = steps
                    self._start("stall", None, True, facts)
        except Exception as e:  # never into the reporter: log once per kind
            self._log_once(f"poll:{type(e).__name__}", "rankwatch: stack watcher error: %s", e)

    def _new_request(self, path: Path) -> Request | None:
        sig = self._signature(path)
        if sig is None or sig == self._seen.get(path):
            self._seen[path] = sig
            return None
        self._seen[path] = sig
        try:
            return schema.load(Request, path)
        except FileNotFoundError:
            return None
        except (OSError, schema.SchemaError) as e:
            self._log_once(f"request:{sig}", "rankwatch: ignoring unreadable stack request %s: %s", path, e)
            return None

    def _start(self, trigger: str, request_id: str | None, native: bool, facts: dict) -> None:
        with self._lock:
            self._jobs.append((trigger, request_id, native, facts))
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="rankwatch-stacks", daemon=True)
                self._worker.start()

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    self._worker = None
                    return
                job = self._jobs.popleft()
            try:
                self.capture(*job)
            except Exception as e:
                self._log_once(f"capture:{type(e).__name__}", "rankwatch: stack capture failed: %s", e)

    def capture(self, trigger: str, request_id: str | None, native: bool, facts: dict) -> Capture:
        """Capture this process now and write it; returns the capture."""
        started = time.perf_counter()
        threads, omitted = python_threads(self.training, frozenset({threading.get_ident()}))
        mode, note = "off", None
        if not (native and self.native):
            note = f"turned off ({NATIVE_ENV}=off)" if not self.native else "not asked for"
        elif self._pyspy is None:
            mode, note = "unavailable", "py-spy is not installed in the job's environment"
        else:
            try:
                add_native(threads, pyspy_dump(os.getpid(), native=True, exe=self._pyspy))
                mode = "included"
            except PySpyError as e:
                mode, note = "failed", str(e)
                self._log_once("native", "rankwatch: no native frames in stack captures: %s", e)
        capture = build_capture(
            rank=self.rank,
            host=self.host,
            pid=os.getpid(),
            captured_at=time.time(),
            source="bridge",
            trigger=trigger,
            request_id=request_id,
            global_step=facts.get("global_step"),
            since_step_s=None if facts.get("since_step_s") is None else round(facts["since_step_s"], 3),
            native=mode,
            native_note=_clip(note, 500),
            took_ms=round((time.perf_counter() - started) * 1e3, 3),
            threads=threads,
            threads_omitted=omitted,
        )
        try:
            write_capture(self.run_dir, capture)
            self.captures += 1
        except OSError as e:
            self._log_once(f"write:{e.errno}", "rankwatch: cannot write a stack capture: %s", e)
        return capture

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning(msg, *args)
