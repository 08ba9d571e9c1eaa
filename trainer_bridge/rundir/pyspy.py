"""py-spy, run from outside a process: find the executable, dump, and turn its JSON into a capture.

Both sides run it: the dashboard for a rank on its host that the bridge
cannot answer for (``capture_pyspy``), and the bridge for the native frames
of its own stall captures (``trainer_bridge.stacks``). The capture's format
is ``stackfiles``'.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from trainer_bridge.rundir.stackfiles import (
    FRAME_FILE,
    FRAME_TEXT,
    MAX_FRAMES,
    MAX_NATIVE_FRAMES,
    MAX_THREADS,
    Capture,
    _clip,
    build_capture,
    write_capture,
)

log = logging.getLogger("trainer_bridge")

# py-spy's JSON for a process with hundreds of threads stays far below this.
MAX_PYSPY_OUTPUT = 16 * 1024 * 1024
PYSPY_TIMEOUT_S = 15.0

# An absolute path to py-spy; empty: the copy beside the interpreter (never PATH).
PYSPY_ENV = "RANKWATCH_PYSPY_PATH"


class PySpyError(RuntimeError):
    """py-spy is missing, or could not read the process; the message says why in a sentence."""


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
