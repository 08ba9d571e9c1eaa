"""Many runs, one dashboard: its CPU with live runs, its RSS at 1,000 runs, and a soak with churn.

``.venv/bin/python -m tests.bench.runs_load [--runs 1000] [--live 20] [--ranks 64] [--minutes 10]``

A root of ``--runs`` runs under one dashboard (``--runs ROOT``), as issue 17
asks: ``--live`` of them train (``tests.bench.simulate`` writes ``--ranks``
heartbeats a second for each, in the bridge's format, niced so that the
dashboard's cost is what is measured), the rest finished, each with a
day of chart history per rank (the bridge keeps the newest two segments of
``rank_{r}.history.jsonl``, so a day of history is those two full
segments; written once and hard-linked into every run, which costs the
dashboard the same reads).

Measured, in order:

* **warm-up**: the time until ``GET /api/runs`` lists every run;
* **CPU** of the dashboard process over ``--seconds``, while one client
  asks for the landing page's first page every 2 s and one live run's
  page (``/api/ranks`` of that run) every 2 s, as two open tabs would;
* **RSS** after the warm-up, at 1,000 runs;
* **soak** for ``--minutes``: every ``--churn-s`` one live run finishes
  (its simulator stops and its ranks write ``finished``) and a new run
  appears and trains; RSS is sampled every 10 s. Printed: RSS at the start
  and the end of the soak, its maximum, and the slope over the soak's
  second half (MB per hour): flat means memory is bounded by the runs
  shown, not by the runs seen.

A benchmark, not a test: it prints figures and asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from app.runs import ids
from tests.helpers.app import AUTH, TOKEN
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import REPO, start_dashboard
from trainer_bridge.rundir import runfiles


def history_template(workdir: Path) -> tuple[Path, Path]:
    """Two full history segments, the newest of a day at 1 Hz (what the bridge keeps of it)."""
    seg, older = workdir / "history.jsonl", workdir / "history.jsonl.1"
    end = time.time() - 3600
    start = end - 24 * 3600
    lines = []
    for i in range(24 * 3600):
        t = start + i
        lines.append(
            json.dumps(
                {
                    "time": round(t, 3),
                    "global_step": 20 * i,
                    "loss": round(2.3 / (1 + i / 500), 6),
                    "step_time_ms": 50.0,
                    "step_time_mean_ms": 50.0,
                    "cpu_percent": 98.5,
                    "rss_bytes": 512 * 2**20,
                }
            )
        )
    # The newest lines that fit two segments: the rest was rotated away by the bridge.
    kept, size = [], 0
    for line in reversed(lines):
        size += len(line) + 1
        if size > 2 * runfiles.HISTORY_SEGMENT_BYTES:
            break
        kept.append(line)
    kept.reverse()
    half = len(kept) // 2
    older.write_text("\n".join(kept[:half]) + "\n")
    seg.write_text("\n".join(kept[half:]) + "\n")
    return seg, older


def finished_run(run: Path, template: tuple[Path, Path], ranks: int = 2) -> None:
    old = time.time() - 3600
    write_job(run, ranks)
    for r in range(ranks):
        path = write_heartbeat(run, heartbeat(r, ranks, seq=86400, now=old, state="finished"), history=False)
        os.utime(path, (old, old))
        history = runfiles.history_path(run, r)
        os.link(template[0], history)
        os.link(template[1], Path(f"{history}.1"))


class Live:
    """A training run: a simulator writing ``ranks`` heartbeats a second, niced."""

    def __init__(self, run: Path, ranks: int):
        self.run, self.ranks = run, ranks
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.simulate", "--run-dir", str(run), "--ranks", str(ranks)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Its own process group: the simulator may fork workers, and all of them end with it.
            start_new_session=True,
            preexec_fn=lambda: os.nice(10),
        )

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait()

    def finish(self) -> None:
        """Stop the simulator; its ranks say ``finished``, as ranks that ended their training do."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
        for r in range(self.ranks):
            write_heartbeat(self.run, heartbeat(r, self.ranks, seq=10**6, state="finished"), history=False)


def get(url: str) -> dict:
    req = urllib.request.Request(url, headers=AUTH)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


failures: list[str] = []


def tabs(server_url: str, live_id: str, stop: threading.Event) -> None:
    """Two open tabs: the landing page's first page and one live run's console, every 2 s."""
    quoted = urllib.parse.quote(ids.encode(live_id), safe="~")
    while not stop.is_set():
        for path in ("/api/runs?per_page=50", f"/api/runs/{quoted}/ranks?per_page=100"):
            try:
                get(server_url + path)
            except (
                Exception
            ) as e:  # a slow or refused answer is the dashboard's figure, not the tab's failure
                failures.append(f"{path}: {e}")
        stop.wait(2.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.runs_load", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--live", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=64, help="ranks of each live run")
    parser.add_argument("--seconds", type=float, default=60.0, help="the CPU window")
    parser.add_argument("--minutes", type=float, default=10.0, help="the soak (0: none)")
    parser.add_argument(
        "--churn-s", type=float, default=30.0, help="a live run finishes and one starts this often"
    )
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="rankwatch-runs-load-"))
    root = workdir / "root"
    lives: list[Live] = []
    server = None
    stop_tabs = threading.Event()
    try:
        template = history_template(workdir)
        # The dashboard starts on a root of one run (so that it answers at once), then the rest
        # appear under it, as runs of a team's root do: discovery and the first rows are the warm-up.
        finished_run(root / "team0" / "done00000", template)
        server = start_dashboard(
            root, workdir / "dashboard.log", env={"RANKWATCH_TOKEN": TOKEN}, runs_root=True
        )
        t0 = time.monotonic()
        for i in range(1, args.runs - args.live):
            finished_run(root / f"team{i % 50}" / f"done{i:05d}", template)
        made = time.monotonic() - t0
        for i in range(args.live):
            lives.append(Live(root / "live" / f"train{i:03d}", args.ranks))
        t0 = time.monotonic()
        while get(server.url + "/api/runs?per_page=1")["total"] < args.runs:
            time.sleep(1)
        listed = time.monotonic() - t0
        while get(server.url + "/api/runs?per_page=1")["unread"]:
            time.sleep(1)
        warm = time.monotonic() - t0
        print(f"root: {args.runs} runs ({args.live} live x {args.ranks} ranks) made in {made:.0f} s")
        print(f"warm-up: every run listed after {listed:.1f} s, every row read after {warm:.1f} s")
        tab = threading.Thread(target=tabs, args=(server.url, "live/train000", stop_tabs), daemon=True)
        tab.start()
        time.sleep(10)
        c0, w0 = server.cpu_seconds(), time.monotonic()
        time.sleep(args.seconds)
        cores = (server.cpu_seconds() - c0) / (time.monotonic() - w0)
        rss = server.rss_bytes() / 2**20
        print(f"cpu: {cores:.3f} cores over {args.seconds:.0f} s with two open tabs; RSS {rss:.0f} MB")
        if failures:
            print(f"the tabs' requests failed {len(failures)} times, the first: {failures[0]}")
        samples: list[tuple[float, float]] = []
        start = time.monotonic()
        next_churn, n = start + args.churn_s, args.live
        while time.monotonic() - start < args.minutes * 60:
            samples.append((time.monotonic() - start, server.rss_bytes() / 2**20))
            if time.monotonic() >= next_churn:
                lives.pop(1 if len(lives) > 1 else 0).finish()  # train000 stays: the open tab's run
                lives.append(Live(root / "live" / f"train{n:03d}", args.ranks))
                n += 1
                next_churn += args.churn_s
            time.sleep(10)
        if len(samples) >= 4:
            tail = samples[len(samples) // 2 :]
            mean_t = sum(t for t, _ in tail) / len(tail)
            mean_m = sum(m for _, m in tail) / len(tail)
            slope = sum((t - mean_t) * (m - mean_m) for t, m in tail) / sum(
                (t - mean_t) ** 2 for t, _ in tail
            )
            print(
                f"soak: {args.minutes:g} min, {n - args.live} runs finished and as many appeared; RSS "
                f"{samples[0][1]:.0f} MB at the start, {samples[-1][1]:.0f} MB at the end, max "
                f"{max(m for _, m in samples):.0f} MB; slope over the second half {slope * 3600:+.0f} MB/h"
            )
    finally:
        stop_tabs.set()
        for live in lives:
            live.kill()
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
