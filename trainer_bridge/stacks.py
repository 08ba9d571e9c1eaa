"""Stack captures: what every thread of a rank is doing right now.

Both sides use this module, so it must not import mindspore:

* the bridge's reporter thread calls ``StackWatcher.poll`` about five times a
  second. It answers the requests the dashboard leaves as files in the run
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
(re-exported here). Layout (see ``runfiles``)::

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
import json
import linecache
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from trainer_bridge.rundir import runfiles, schema
from trainer_bridge.rundir.stackfiles import (  # noqa: F401  (re-exported: one import for both sides)
    FRAME_FILE,
    FRAME_TEXT,
    KEEP_PER_TRIGGER,
    MAX_CAPTURE_BYTES,
    MAX_FRAMES,
    MAX_NATIVE_FRAMES,
    MAX_TEXT,
    MAX_THREADS,
    NATIVE,
    SOURCES,
    TRIGGERS,
    Capture,
    Request,
    StackFrame,
    StackThread,
    _clip,
    build_capture,
    capture_files,
    capture_name,
    load_capture,
    read_request,
    render,
    write_capture,
    write_request,
)

log = logging.getLogger("trainer_bridge")

# py-spy's JSON for a process with hundreds of threads stays far below this.
MAX_PYSPY_OUTPUT = 16 * 1024 * 1024
PYSPY_TIMEOUT_S = 15.0

# The bridge's automatic capture: seconds without a finished step, or
# STALL_FACTOR x the rank's mean step time if that is longer (the dashboard's
# stall rule with its default settings, so the capture is there by the time
# the page says stalled). 0 turns it off.
STALL_ENV = "RANKWATCH_STALL_CAPTURE_S"
STALL_AFTER_S = 5.0
STALL_FACTOR = 5.0
# "off" leaves native frames out (py-spy is then never run by the bridge).
NATIVE_ENV = "RANKWATCH_STACK_NATIVE"
# An absolute path to py-spy; empty: the copy beside the interpreter (never PATH).
PYSPY_ENV = "RANKWATCH_PYSPY_PATH"


class PySpyError(RuntimeError):
    """py-spy is missing, or could not read the process; the message says why in a sentence."""


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


def find_pyspy(setting: str | None = None) -> str | None:
    """The py-spy executable to run: ``setting`` (or ``PYSPY_ENV``), else the one beside this interpreter.

    Never looked up on ``PATH``: the dashboard may run it as root on another
    user's process, and a ``py-spy`` earlier on someone's ``PATH`` would run
    instead. The venv's own copy (``pip install py-spy``) sits beside
    ``sys.executable`` (not resolved: a venv's ``python`` is a symlink out of
    it). A setting must be an absolute path to an executable file; anything
    else finds nothing, and the caller's message says so.
    """
    chosen = (os.environ.get(PYSPY_ENV, "") if setting is None else setting).strip()
    if chosen:
        path = Path(chosen)
        ok = path.is_absolute() and path.is_file() and os.access(path, os.X_OK)
        if not ok:
            log.warning("rankwatch: %s=%r is not an absolute path to an executable file", PYSPY_ENV, chosen)
        return str(path) if ok else None
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def pyspy_dump(pid: int, *, native: bool, exe: str | None = None, timeout: float = PYSPY_TIMEOUT_S) -> list:
    """``py-spy dump --json`` of ``pid``: its threads as py-spy reports them.

    Without ``native`` the dump is non-blocking: py-spy reads the process's
    memory without pausing it, so it never slows a training rank, and it
    works on a stopped process (a blocking dump fails on a SIGSTOPped one);
    threads stuck in a call, the ones that matter here, read the same either
    way. Native frames need the threads paused to unwind them (about a
    second for a MindSpore process here). Raises PySpyError.
    """
    exe = exe or find_pyspy()
    if exe is None:
        raise PySpyError(
            f"py-spy is not installed beside {sys.executable} (pip install py-spy there, "
            f"or set {PYSPY_ENV} to its absolute path)"
        )
    cmd = [exe, "dump", "--pid", str(pid), "--json"] + (["--native"] if native else ["--nonblocking"])
    try:
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise PySpyError(f"py-spy did not answer within {timeout:g} s") from None
    except OSError as e:
        raise PySpyError(f"cannot run py-spy: {e.strerror or e}") from None
    if done.returncode != 0:
        raise PySpyError(_pyspy_failure(pid, done.stderr.decode(errors="replace")))
    if len(done.stdout) > MAX_PYSPY_OUTPUT:
        raise PySpyError(f"py-spy printed {len(done.stdout)} bytes, more than the {MAX_PYSPY_OUTPUT} read")
    try:
        data = json.loads(done.stdout)
    except ValueError as e:
        raise PySpyError(f"py-spy printed something that is not JSON: {e}") from None
    if not isinstance(data, list):
        raise PySpyError("py-spy printed JSON that is not a list of threads")
    return data


def _pyspy_failure(pid: int, stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    first = next((ln for ln in lines if ln.startswith("Error")), lines[0] if lines else "no message")
    causes = " ".join(lines[:6]).lower()
    if "permission" in causes or "operation not permitted" in causes:
        return (
            f"py-spy may not read process {pid} ({first}): it needs ptrace permission; run the "
            "dashboard as the job's user with kernel.yama.ptrace_scope=0, or as root (CAP_SYS_PTRACE)"
        )
    if "no such process" in causes:
        return f"process {pid} is gone ({first})"
    return f"py-spy could not read process {pid}: {_clip(first, 300)}"


def _pyspy_frame(f: dict) -> dict:
    return {
        "function": _clip(str(f.get("name") or "?"), FRAME_TEXT),
        "file": _clip(str(f.get("filename") or f.get("short_filename") or "?"), FRAME_FILE),
        "line": f.get("line") if isinstance(f.get("line"), int) and 0 <= f["line"] <= 10**9 else 0,
        "code": None,
    }


def pyspy_threads(data: list, training_tid: int | None) -> tuple[list[dict], int]:
    """py-spy's JSON as ``Thread`` fields: Python frames, and the native ones below them."""
    out = []
    for t in data:
        if not isinstance(t, dict) or not isinstance(t.get("frames"), list):
            continue
        frames = [f for f in t["frames"] if isinstance(f, dict)]
        # py-spy marks native frames with the library they come from (module).
        lead = 0
        while lead < len(frames) and frames[lead].get("module"):
            lead += 1
        python = [f for f in frames[lead:] if not f.get("module")]
        tid = t.get("os_thread_id") if isinstance(t.get("os_thread_id"), int) else t.get("thread_id")
        name = t.get("thread_name")
        out.append(
            {
                "id": tid if isinstance(tid, int) and 0 <= tid <= 2**64 else 0,
                "name": _clip(name, 200) if isinstance(name, str) else None,
                "training": tid == training_tid,
                "frames": [_pyspy_frame(f) for f in python[:MAX_FRAMES]],
                "omitted": max(0, len(python) - MAX_FRAMES),
                "native": [_pyspy_frame(f) for f in frames[:lead][:MAX_NATIVE_FRAMES]],
            }
        )
    out.sort(key=lambda t: (not t["training"], t["name"] or "~", t["id"]))
    return out[:MAX_THREADS], max(0, len(out) - MAX_THREADS)


def add_native(threads: list[dict], data: list) -> int:
    """Attach py-spy's native frames to the matching threads (by OS thread id); returns how many."""
    native = {t["id"]: t["native"] for t in pyspy_threads(data, None)[0] if t["native"]}
    matched = 0
    for t in threads:
        if t["id"] in native:
            t["native"] = native[t["id"]]
            matched += 1
    return matched


def capture_pyspy(
    run_dir: str | os.PathLike,
    rank: int,
    pid: int,
    host: str | None,
    *,
    request_id: str | None,
    native: bool = True,
    global_step: int | None = None,
    exe: str | None = None,
) -> Capture:
    """Capture process ``pid`` with py-spy from outside and store it as rank ``rank``'s newest.

    The dashboard's way for a rank on its own host that the bridge cannot
    answer for. Raises PySpyError (with a sentence saying why) or OSError.
    """
    started = time.perf_counter()
    data = pyspy_dump(pid, native=native, exe=exe)
    threads, omitted = pyspy_threads(data, pid)
    capture = build_capture(
        rank=rank,
        host=host,
        pid=pid,
        captured_at=time.time(),
        source="py-spy",
        trigger="request",
        request_id=request_id,
        global_step=global_step,
        native="included" if native else "off",
        took_ms=round((time.perf_counter() - started) * 1e3, 3),
        threads=threads,
        threads_omitted=omitted,
    )
    write_capture(run_dir, capture)
    return capture


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
    ``poll`` is called from the reporter thread. Nothing here raises into
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
