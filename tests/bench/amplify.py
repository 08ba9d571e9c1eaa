"""Amplification benchmark: answer sizes and the dashboard's peak memory for a huge job.

``.venv/bin/python -m tests.bench.amplify [--ranks 131072] [--run-dir DIR] [--per-host 8]``

Writes (or reuses, when ``DIR`` already holds that many) a run directory of
heartbeat files in the bridge's format, ``--per-host`` ranks a host, starts a
real dashboard on it with the dead, stall and process checks pushed out of
reach (the files are written once, so every rank would otherwise turn dead and
lose its live figures), waits until every rank is read, then sends each
request, alone or several at once, and prints the answers' status, size and
time with the peak resident memory of gunicorn's worker while they ran
(sampled every 50 ms; the worker's memory before is the baseline).

Most of a request's time on a big job is the refresh that reads the run
directory when the watcher's view is older than a tick, not the answer.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shutil
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

from tests.helpers.app import TOKEN
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import start_dashboard
from trainer_bridge.rundir import runfiles

REQUESTS = (
    (1, "/api/ranks"),
    (1, "/api/ranks?per_page=1000"),
    (6, "/api/ranks"),
    (1, "/metrics"),
    (6, "/metrics"),
    (2, "/metrics?per_rank=1"),
    (2, "/api/history"),
)
SETTINGS = {
    "RANKWATCH_TOKEN": TOKEN,
    "RANKWATCH_DEAD_AFTER_S": "1e9",
    "RANKWATCH_PROCESS_CHECK_AFTER_S": "1e9",
    "RANKWATCH_STALL_MIN_S": "1e9",
    "RANKWATCH_CHECKPOINT_SCAN_S": "600",
}


def write_run(run_dir: Path, ranks: int, per_host: int) -> None:
    if runfiles.heartbeat_path(run_dir, ranks - 1).exists():
        return
    write_job(run_dir, ranks)
    now = time.time()
    for r in range(ranks):
        beat = heartbeat(r, ranks, seq=5, now=now, validate=False, host=f"node{r // per_host:05d}")
        write_heartbeat(run_dir, beat, history=False)


class PeakRss:
    """The highest RSS of ``proc`` while the block runs."""

    def __init__(self, proc: psutil.Process):
        self.proc = proc

    def __enter__(self) -> PeakRss:
        self.before = self.peak = self.proc.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def get(url: str) -> tuple[int, int, float, str | None]:
    """(status, body bytes, seconds, Retry-After)."""
    start = time.monotonic()
    try:
        with urllib.request.urlopen(url, timeout=3600) as r:
            return r.status, len(r.read()), time.monotonic() - start, None
    except urllib.error.HTTPError as e:
        return e.code, len(e.read()), time.monotonic() - start, e.headers.get("Retry-After")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=131072)
    parser.add_argument("--per-host", type=int, default=8)
    parser.add_argument("--run-dir", type=Path, default=None, help="reused if it holds the ranks already")
    args = parser.parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="rankwatch-amplify-"))
    write_run(run_dir, args.ranks, args.per_host)
    server = start_dashboard(run_dir, run_dir / "dashboard.log", env=SETTINGS, timeout=600)
    try:
        worker = psutil.Process(server.proc.pid).children()[0]
        while True:
            with urllib.request.urlopen(server.url + "/api/summary", timeout=3600) as r:
                summary = json.load(r)
            if summary["summary"]["reported"] >= summary["world_size"] > 0:
                break
            time.sleep(2)
        print(f"{args.ranks} ranks read; worker RSS {worker.memory_info().rss / 2**20:.0f} MiB", flush=True)
        for count, path in REQUESTS:
            with PeakRss(worker) as rss, cf.ThreadPoolExecutor(count) as pool:
                answers = list(pool.map(get, [server.url + path] * count))
            told = ", ".join(
                f"{status} {size / 1e6:.2f} MB {took:.1f} s" + (f" (Retry-After {wait})" if wait else "")
                for status, size, took, wait in answers
            )
            grew = (rss.peak - rss.before) / 2**20
            print(
                f"{count} x GET {path}: {told}; peak RSS {rss.peak / 2**20:.0f} MiB (+{grew:.0f})", flush=True
            )
    finally:
        server.stop()
        if args.run_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
