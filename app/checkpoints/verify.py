"""Deep verify: load every file of a set with MindSpore, in a subprocess, showing progress.

The index reads metadata only, which cannot catch every kind of damage (a
flipped bit inside a tensor). A deep verify loads each file completely with
``mindspore.load_checkpoint``, checking the CRC when the file stores one.
MindSpore is imported only in the worker process (``verify_worker.py``),
never in the dashboard: importing it costs seconds and hundreds of MB, and a
loader crash on a bad file must not take the dashboard down. One worker
loads a whole set file after file; if it dies mid-way, the file it was
loading is failed with the exit status and a new worker continues with the
rest.

A verify costs a MindSpore process and up to a few times the set's size in
memory, so it needs the operator token (``POST /api/checkpoints/verify``),
only one runs at a time in the dashboard (another answers 409), and each file:

* is opened here, under the run directory without following a symlink
  (``trainer_bridge.rundir.safeio``), and handed to the worker as an open descriptor, which
  is what the worker loads (a directory swapped for a symlink meanwhile
  changes nothing);
* is read by ``trainer_bridge.rundir.ckptmeta`` first: a header the reader cannot
  believe (a 64-byte file claiming a 40000x40000 tensor, a truncated one) is
  failed with that reason and never given to MindSpore;
* is loaded under a memory limit sized from the file (``verify_worker``).

A file cut exactly between two entries is well-formed and loads; when its
peers in the set store their step (MindSpore appends it last) and hold more
entries, and it does not, it is failed as probably truncated.

A job runs as a Socket.IO background task and emits ``checkpoint_verify``
after it starts and after each file: ``{"set", "state", "done", "total",
"file", "ok", "error", "crc"}``. While running, ``file``/``ok``/``error``/``crc``
describe the file just loaded (``crc``: whether it stores a CRC, checked); at the end ``state`` is ``ok`` or ``failed`` (or
``error`` when the worker could not run at all) and ``ok``/``error`` sum the
set up. The latest job per set, with every file's result, stays in memory
for ``GET /api/checkpoints/verify``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from app.errors import SetBusy
from app.push import VERIFY_EVENT
from trainer_bridge.rundir import safedirs, safeio
from trainer_bridge.rundir.ckptindex import CheckpointFile
from trainer_bridge.rundir.ckptmeta import read_meta

WORKER = Path(__file__).with_name("verify_worker.py")
EVENT_FIELDS = ("set", "state", "done", "total", "file", "ok", "error", "crc")
# Enough of the worker's stderr to explain a crash in one line.
STDERR_TAIL = 2000

log = logging.getLogger(__name__)


def _result(ok: bool, error: str | None, crc: bool | None = None, params=None, seconds=None) -> dict:
    return {"ok": ok, "error": error, "crc": crc, "params": params, "seconds": seconds}


class _Worker:
    """One ``verify_worker.py`` process, fed one open file at a time over a Unix socket."""

    def __init__(self, python: str):
        self._sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stderr = tempfile.TemporaryFile()
        env = {**os.environ, "GLOG_v": os.environ.get("GLOG_v", "3")}
        try:
            self.proc = subprocess.Popen(
                [python, str(WORKER), str(child.fileno())],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=env,
                text=True,
                pass_fds=(child.fileno(),),
            )
        finally:
            child.close()

    def load(self, path: str, fd: int, fmt: str) -> dict | None:
        """The worker's result for the file open at ``fd``, or None if it died first."""
        try:
            socket.send_fds(self._sock, [json.dumps({"path": path, "format": fmt}).encode()], [fd])
        except OSError:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def died(self) -> str:
        """Why the worker ended: its exit status and the last line it printed."""
        code = self.proc.wait()
        self._stderr.seek(0)
        tail = self._stderr.read()[-STDERR_TAIL:].decode(errors="replace").strip().splitlines()
        return f"the loader process died (exit status {code}) while loading this file" + (
            f": {tail[-1]}" if tail else ""
        )

    def close(self) -> None:
        try:
            self._sock.sendall(b"")  # ignored by SOCK_STREAM; closing is the end marker
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self._stderr.close()


class Verifier:
    """Runs deep verifies, one at a time, and keeps each set's latest result.

    ``start_task(fn, *args)`` runs ``fn`` in the background and ``emit(event,
    payload)`` reaches every client: ``socketio.start_background_task`` and
    ``socketio.emit`` in the app.
    """

    def __init__(self, start_task: Callable, emit: Callable[[str, dict], None], python: str = sys.executable):
        self._start_task = start_task
        self._emit = emit
        self.python = python
        self._jobs: dict[str, dict] = {}
        self._lock = threading.Lock()

    def running(self, set_id: str | None = None) -> bool:
        """Whether a verify of ``set_id`` (of any set, if None) is running."""
        with self._lock:
            return self._running(set_id) is not None

    def _running(self, set_id: str | None) -> str | None:
        for sid, job in self._jobs.items():
            if job["state"] == "running" and set_id in (None, sid):
                return sid
        return None

    def status(self, set_id: str) -> dict | None:
        """The latest job for ``set_id`` with every file's result, or None if none ran."""
        with self._lock:
            job = self._jobs.get(set_id)
            return None if job is None else job | {"files": list(job["files"])}

    def forget(self, set_id: str) -> None:
        with self._lock:
            self._jobs.pop(set_id, None)

    def start(self, set_id: str, files: Sequence[CheckpointFile], root: str) -> dict:
        """Start verifying ``files`` (the set's) under the run directory ``root``.

        409 while any verify runs: one MindSpore process at a time.
        """
        with self._lock:
            busy = self._running(None)
            if busy is not None:
                raise SetBusy(
                    "a deep verify of this set is already running"
                    if busy == set_id
                    else f"a deep verify of another set ({busy}) is running; one runs at a time",
                )
            job = self._jobs[set_id] = {
                "set": set_id,
                "state": "running",
                "done": 0,
                "total": len(files),
                "file": None,
                "ok": None,
                "error": None,
                "crc": None,
                "started_at": time.time(),
                "finished_at": None,
                "files": [],
            }
            event = {k: job[k] for k in EVENT_FIELDS}
        self._emit(VERIFY_EVENT, event)
        self._start_task(self._run, job, list(files), safedirs.anchor(root))
        return event

    def _run(self, job: dict, files: list[CheckpointFile], root: str) -> None:
        worker = None
        try:
            for f in files:
                result, worker = self._verify_one(f, root, worker)
                self._record(job, f, result)
            self._flag_early_ends(job, files)
            failed = [r for r in job["files"] if not r["ok"]]
            summary = (
                None
                if not failed
                else f"{len(failed)} of {len(files)} file(s) failed to load; first: "
                f"{failed[0]['path']}: {failed[0]['error']}"
            )
            self._finish(job, "failed" if failed else "ok", not failed, summary)
        except Exception as e:  # the worker could not run at all; the job must still end
            log.exception("deep verify of %s failed", job["set"])
            self._finish(job, "error", False, f"the verify could not run: {type(e).__name__}: {e}")
        finally:
            if worker is not None:
                worker.close()

    def _verify_one(
        self, f: CheckpointFile, root: str, worker: _Worker | None
    ) -> tuple[dict, _Worker | None]:
        """One file's result, and the worker to use for the next (a new one after a crash)."""
        try:
            fd, _ = safeio.open_file(root, f.path)
        except (OSError, safeio.UnsafePath) as e:
            why = safeio.why(e) if isinstance(e, OSError) else str(e)
            return _result(False, f"not loaded: cannot open it safely ({why})"), worker
        try:
            meta = read_meta(f.abspath, fd=fd)
            if not meta.ok:
                return _result(False, f"not loaded: {meta.reason}"), worker
            if worker is None:
                worker = _Worker(self.python)
            # The worker only checks that the path exists (it loads the descriptor): a pinned run's
            # /proc/self/fd/N means nothing in another process, the file's current name does.
            shown = os.path.realpath(f.abspath) if f.abspath.startswith(safedirs.PINNED_PREFIX) else f.abspath
            result = worker.load(shown, fd, meta.format or "ckpt")
            if result is None:
                why = worker.died()
                worker.close()
                return _result(False, why), None
            return result, worker
        finally:
            os.close(fd)

    def _flag_early_ends(self, job: dict, files: list[CheckpointFile]) -> None:
        """Fail files that loaded but look cut between two entries (see the module docstring)."""
        with self._lock:
            results = {r["path"]: r for r in job["files"]}
        informed = [f for f in files if f.meta.step_source == "contents" and f.meta.param_count]
        for f in files:
            r = results.get(f.path)
            if not (r and r["ok"]) or f.meta.step_source == "contents" or not informed:
                continue
            peer = max(informed, key=lambda p: p.meta.param_count)
            if f.meta.param_count is not None and peer.meta.param_count > f.meta.param_count:
                with self._lock:
                    r.update(
                        ok=False,
                        error=f"probably truncated: it ends after {f.meta.param_count} entries without the "
                        f"step values MindSpore saves last, which rank {peer.rank}'s file holds after "
                        f"{peer.meta.param_count}",
                    )

    def _record(self, job: dict, f: CheckpointFile, result: dict) -> None:
        entry = {"path": f.path, "rank": f.rank, **result}
        with self._lock:
            job["files"].append(entry)
            job.update(
                done=len(job["files"]),
                file=f.path,
                ok=result["ok"],
                error=result["error"],
                crc=result["crc"],
            )
            event = {k: job[k] for k in EVENT_FIELDS}
        self._emit(VERIFY_EVENT, event)

    def _finish(self, job: dict, state: str, ok: bool, error: str | None) -> None:
        with self._lock:
            job.update(state=state, file=None, ok=ok, error=error, crc=None, finished_at=time.time())
            event = {k: job[k] for k in EVENT_FIELDS}
        self._emit(VERIFY_EVENT, event)
