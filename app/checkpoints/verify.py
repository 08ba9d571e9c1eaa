"""Deep verify: load every file of a set with MindSpore, in a subprocess, showing progress.

The index reads metadata only, which cannot catch every kind of damage (a
file cut between two entries, a flipped bit inside a tensor). A deep verify
loads each file completely with ``mindspore.load_checkpoint``, checking the
CRC when the file stores one. MindSpore is imported only in the worker
process (``verify_worker.py``), never in the dashboard: importing it costs
seconds and hundreds of MB, and a loader crash on a bad file must not take
the dashboard down. One worker loads a whole set file after file; if it dies
mid-way, the file it was loading is failed with the exit status and a new
worker continues with the rest.

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
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from trainer_bridge.ckptindex import CheckpointFile

from app.errors import ApiError

VERIFY_EVENT = "checkpoint_verify"
WORKER = Path(__file__).with_name("verify_worker.py")
EVENT_FIELDS = ("set", "state", "done", "total", "file", "ok", "error", "crc")
# Enough of the worker's stderr to explain a crash in one line.
STDERR_TAIL = 2000

log = logging.getLogger(__name__)


class Verifier:
    """Runs deep verifies, one at a time per set, and keeps each set's latest result.

    ``start_task(fn, *args)`` runs ``fn`` in the background and ``emit(event,
    payload)`` reaches every client: ``socketio.start_background_task`` and
    ``socketio.emit`` in the app.
    """

    def __init__(self, start_task: Callable, emit: Callable[[str, dict], None],
                 python: str = sys.executable):
        self._start_task = start_task
        self._emit = emit
        self.python = python
        self._jobs: dict[str, dict] = {}
        self._lock = threading.Lock()

    def running(self, set_id: str) -> bool:
        with self._lock:
            return self._jobs.get(set_id, {}).get("state") == "running"

    def status(self, set_id: str) -> dict | None:
        """The latest job for ``set_id`` with every file's result, or None if none ran."""
        with self._lock:
            job = self._jobs.get(set_id)
            return None if job is None else job | {"files": list(job["files"])}

    def forget(self, set_id: str) -> None:
        with self._lock:
            self._jobs.pop(set_id, None)

    def start(self, set_id: str, files: Sequence[CheckpointFile]) -> dict:
        """Start verifying ``files`` (the set's); 409 if a verify of this set is running."""
        items = [{"path": f.path, "abspath": f.abspath, "rank": f.rank, "format": f.meta.format or "ckpt"}
                 for f in files]
        with self._lock:
            if self._jobs.get(set_id, {}).get("state") == "running":
                raise ApiError(409, "a deep verify of this set is already running")
            job = self._jobs[set_id] = {
                "set": set_id, "state": "running", "done": 0, "total": len(items), "file": None,
                "ok": None, "error": None, "crc": None, "started_at": time.time(), "finished_at": None, "files": []}
            event = {k: job[k] for k in EVENT_FIELDS}
        self._emit(VERIFY_EVENT, event)
        self._start_task(self._run, job, items)
        return event

    def _run(self, job: dict, items: list[dict]) -> None:
        try:
            done = 0
            while done < len(items):
                for result in self._load(items[done:]):
                    self._record(job, items[done], result)
                    done += 1
            failed = [f for f in job["files"] if not f["ok"]]
            summary = (None if not failed else
                       f"{len(failed)} of {len(items)} file(s) failed to load; first: "
                       f"{failed[0]['path']}: {failed[0]['error']}")
            self._finish(job, "failed" if failed else "ok", not failed, summary)
        except Exception as e:  # the worker could not run at all; the job must still end
            log.exception("deep verify of %s failed", job["set"])
            self._finish(job, "error", False, f"the verify could not run: {type(e).__name__}: {e}")

    def _load(self, items: list[dict]) -> Iterator[dict]:
        """Results for ``items`` from one worker, in order; ends early after a crash result."""
        request = json.dumps([{"path": i["abspath"], "format": i["format"]} for i in items])
        env = {**os.environ, "GLOG_v": os.environ.get("GLOG_v", "3")}
        with tempfile.TemporaryFile() as stderr:
            with subprocess.Popen([self.python, str(WORKER)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=stderr, env=env, text=True) as proc:
                proc.stdin.write(request)
                proc.stdin.close()
                count = 0
                for line in proc.stdout:
                    yield json.loads(line)
                    count += 1
                code = proc.wait()
            if count < len(items):
                stderr.seek(0)
                tail = stderr.read()[-STDERR_TAIL:].decode(errors="replace").strip().splitlines()
                yield {"ok": False, "crc": None, "params": None, "seconds": None,
                       "error": f"the loader process died (exit status {code}) while loading this file"
                                + (f": {tail[-1]}" if tail else "")}

    def _record(self, job: dict, item: dict, result: dict) -> None:
        entry = {"path": item["path"], "rank": item["rank"], **result}
        with self._lock:
            job["files"].append(entry)
            job.update(done=len(job["files"]), file=item["path"], ok=result["ok"], error=result["error"],
                       crc=result["crc"])
            event = {k: job[k] for k in EVENT_FIELDS}
        self._emit(VERIFY_EVENT, event)

    def _finish(self, job: dict, state: str, ok: bool, error: str | None) -> None:
        with self._lock:
            job.update(state=state, file=None, ok=ok, error=error, crc=None, finished_at=time.time())
            event = {k: job[k] for k in EVENT_FIELDS}
        self._emit(VERIFY_EVENT, event)
