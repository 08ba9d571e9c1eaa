"""Log-mode benchmark: the dashboard's CPU per worker-log line, at 256 ranks x 10 lines/s.

``.venv/bin/python -m tests.bench.logs [--ranks 256] [--rate 10] [--seconds 20]``

A job without the bridge is simulated by ``tests.bench.simulate_logs`` (a
separate process: its work is not counted): N ranks append MindSpore
LossMonitor lines to ``RUN/msrun_logs/worker_N.log`` at ``--rate`` lines a
second each. Measured in one run, each over ``--seconds``:

1. a real dashboard (``python -m app --run-dir RUN``, default settings) while
   the logs are idle (files present, nothing appended), then while they
   grow: its process CPU from psutil (``cpu_times`` delta / wall time; 1.0 =
   one core); the ratio busy / idle, and (busy - idle) CPU seconds / lines
   appended in the window = the dashboard's cost per log line;
2. in this process, the same work without the web server: ``RunState.scan``
   (the whole tick: logs, rows, verdicts) every ``TICK_S``, timed with
   ``time.thread_time``, and ``LogDir.poll`` alone (read + parse + build
   heartbeats), each in microseconds per line parsed.

Lines appended in a window are counted from the files (newlines between the
window's start and end offsets), not assumed from the rate: on a busy
machine the simulator may fall behind.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from app.config import from_env
from app.run.logmode.reader import LogDir
from app.run.state import RunState
from tests.helpers.liveserver import REPO, start_dashboard


def sizes(log_dir: Path) -> dict[Path, int]:
    return {p: p.stat().st_size for p in log_dir.glob("worker_*.log")}


def lines_between(before: dict[Path, int], after: dict[Path, int]) -> int:
    """Newlines appended to each file between two ``sizes`` (read back from the files)."""
    count = 0
    for path, end in after.items():
        start = before.get(path, 0)
        with open(path, "rb") as f:
            f.seek(start)
            count += f.read(end - start).count(b"\n")
    return count


def start_writer(log_dir: Path, ranks: int, rate: float, lines_file: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.bench.simulate_logs",
            "--log-dir",
            str(log_dir),
            "--ranks",
            str(ranks),
            "--rate",
            str(rate),
            "--lines-file",
            str(lines_file),
        ],
        cwd=REPO,
    )


def stop_writer(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(30)


def wait_for_files(log_dir: Path, ranks: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(list(log_dir.glob("worker_*.log"))) < ranks or any(s == 0 for s in sizes(log_dir).values()):
        if proc.poll() is not None:
            raise RuntimeError(f"log writer exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("the log writer did not create its files")
        time.sleep(0.1)


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system + t.children_user + t.children_system


def dashboard_window(server_pid: int, log_dir: Path, seconds: float) -> tuple[float, int]:
    """(the dashboard's cores over the window, lines appended in it)."""
    proc = psutil.Process(server_pid)
    before, c0, t0 = sizes(log_dir), cpu_seconds(proc), time.monotonic()
    time.sleep(seconds)
    after, c1, t1 = sizes(log_dir), cpu_seconds(proc), time.monotonic()
    return (c1 - c0) / (t1 - t0), lines_between(before, after)


def in_process_window(run_dir: Path, log_dir: Path, seconds: float, tick_s: float) -> dict:
    """Scan as the watcher does, timing the whole scan and a bare LogDir.poll on the same files."""
    state = RunState(run_dir, from_env({}))
    bare = LogDir(log_dir, "bench")
    state.scan(time.time())
    bare.poll(time.time())
    lines0 = state._logs.dir.lines
    bare0 = bare.lines
    scan_cpu = poll_cpu = 0.0
    ticks = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        c = time.thread_time()
        state.scan(time.time())
        scan_cpu += time.thread_time() - c
        c = time.thread_time()
        bare.poll(time.time())
        poll_cpu += time.thread_time() - c
        ticks += 1
        time.sleep(tick_s)
    lines = state._logs.dir.lines - lines0
    return {
        "ticks": ticks,
        "lines": lines,
        "scan_us_per_line": 1e6 * scan_cpu / max(1, lines),
        "poll_us_per_line": 1e6 * poll_cpu / max(1, bare.lines - bare0),
        "scan_ms_per_tick": 1e3 * scan_cpu / max(1, ticks),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--rate", type=float, default=10.0, help="lines per second per rank")
    p.add_argument("--seconds", type=float, default=20.0, help="length of each measured window")
    p.add_argument("--warmup", type=float, default=5.0)
    args = p.parse_args(argv)
    tick_s = from_env({})["TICK_S"]

    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-logs-") as tmp:
        run_dir = Path(tmp) / "run"
        log_dir = run_dir / "msrun_logs"
        lines_file = Path(tmp) / "lines"
        writer = start_writer(log_dir, args.ranks, args.rate, lines_file)
        try:
            wait_for_files(log_dir, args.ranks, writer)
        finally:
            stop_writer(writer)  # the files exist, each with a few lines: now idle
        server = start_dashboard(run_dir, Path(tmp) / "dashboard.log")
        try:
            time.sleep(args.warmup)
            idle_cores, idle_lines = dashboard_window(server.proc.pid, log_dir, args.seconds)
            writer = start_writer(log_dir, args.ranks, args.rate, lines_file)
            try:
                time.sleep(args.warmup)
                busy_cores, busy_lines = dashboard_window(server.proc.pid, log_dir, args.seconds)
            finally:
                stop_writer(writer)
        finally:
            server.stop()
        writer = start_writer(log_dir, args.ranks, args.rate, lines_file)
        try:
            time.sleep(args.warmup)
            inproc = in_process_window(run_dir, log_dir, args.seconds, tick_s)
        finally:
            stop_writer(writer)

    per_line_us = 1e6 * (busy_cores - idle_cores) * args.seconds / max(1, busy_lines)
    print(
        f"log mode at {args.ranks} ranks x {args.rate:g} lines/s, windows of {args.seconds:g} s, TICK_S {tick_s:g}"
    )
    print(f"{'':34} {'lines/s':>9} {'cores':>7} {'us/line':>8}")
    print(f"{'dashboard, logs idle':34} {idle_lines / args.seconds:9.0f} {idle_cores:7.3f} {'':>8}")
    print(
        f"{'dashboard, logs growing':34} {busy_lines / args.seconds:9.0f} {busy_cores:7.3f} {per_line_us:8.1f}"
    )
    print(
        f"{'in-process RunState.scan':34} {inproc['lines'] / args.seconds:9.0f} {'':>7} "
        f"{inproc['scan_us_per_line']:8.1f}   ({inproc['scan_ms_per_tick']:.1f} ms per tick)"
    )
    print(f"{'in-process LogDir.poll alone':34} {'':>9} {'':>7} {inproc['poll_us_per_line']:8.1f}")
    ratio = busy_cores / idle_cores if idle_cores > 0 else float("inf")
    print(f"ratio busy / idle dashboard CPU: {ratio:.1f}x; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
