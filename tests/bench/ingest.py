"""Ingest benchmark: the dashboard's CPU per heartbeat, over files and over Redis.

``.venv/bin/python -m tests.bench.ingest [--ranks 256 1024 4096] [--redis-ranks 4096 16384] [--seconds 20]``

The scale benchmark (``tests.bench.scale``) measures what an operator sees:
write-to-screen latency with a real browser. On a 2-core machine the
simulator cannot write 4,096 heartbeat files a second, so the figure that
says whether the dashboard scales is its cost per heartbeat taken in, which
this measures without a browser:

* the simulator (``tests.bench.simulate``, its own processes) writes N ranks
  at 1 Hz, to files or, with Redis, to a real ``redis-server`` started here on
  a free loopback port;
* a real dashboard (``python -m app``) reads them; after a warm-up, the
  window's heartbeats ingested are the growth of the sum of ``seq`` the
  dashboard itself reports (``GET /api/ranks``, read just outside the window)
  and its CPU is psutil's ``cpu_times`` delta over the window;
* then ``strace -c`` counts the dashboard's file-system calls for a few
  seconds (files only; it slows the process, so it runs after the CPU window).

Targets (issue 12): CPU per heartbeat flat from 256 to 4,096 ranks; 4,096
ranks at 1 Hz within 0.5 core (122 µs/heartbeat); over Redis, 16,384 ranks at
1 Hz within 1 core (61 µs/heartbeat).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.helpers.liveserver import REPO, free_port, rank_rows, start_dashboard

FS_CALLS = ("newfstatat", "statx", "stat", "lstat", "openat", "getdents64", "read", "close", "fstat")


def seq_sum(url: str) -> tuple[int, int]:
    """(sum of every rank's seq, ranks reporting) as the dashboard shows them."""
    rows = rank_rows(url)
    return sum(row["seq"] or 0 for row in rows), sum(1 for row in rows if row["seq"])


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=open(workdir / "redis.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    import redis

    deadline = time.monotonic() + 20
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("redis-server did not start") from None
            time.sleep(0.05)


def strace_counts(pid: int, seconds: float) -> dict[str, int] | None:
    if shutil.which("strace") is None:
        return None
    out = subprocess.run(
        ["timeout", "-s", "INT", str(seconds), "strace", "-c", "-f", "-p", str(pid)],
        capture_output=True,
        text=True,
    ).stderr
    counts = {}
    for line in out.splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", line)
        if m:
            counts[m.group(2)] = int(m.group(1))
    return counts


def measure(ranks: int, seconds: float, warmup: float, workdir: Path, redis_url: str | None) -> dict:
    run_dir = workdir / f"run-{ranks}-{'redis' if redis_url else 'files'}"
    # The simulator is niced: on 2 cores its writer processes would otherwise
    # starve the dashboard, whose cost (not the simulator's) is measured.
    cmd = ["nice", "-n", "10", sys.executable, "-m", "tests.bench.simulate", "--run-dir", str(run_dir)]
    cmd += ["--ranks", str(ranks)]
    if redis_url:
        cmd += ["--redis", redis_url]
    server = sim = None
    # A simulator that falls behind on 2 cores makes its ranks' heartbeats
    # late, and a late rank on this host is probed with psutil: a cost of the
    # benchmark machine, not of a job whose heartbeats come on time.
    env = {"RANKWATCH_PROCESS_CHECK_AFTER_S": "10"}
    if redis_url:
        env["RANKWATCH_REDIS_URL"] = redis_url
    try:
        # The dashboard first, on an empty run directory, so that its start
        # does not race thousands of writers.
        run_dir.mkdir(parents=True)
        server = start_dashboard(run_dir, workdir / f"dashboard-{run_dir.name}.log", env=env)
        sim = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
        time.sleep(warmup)
        seq0, _ = seq_sum(server.url)
        # CPU of gunicorn's arbiter and worker together; the worker does the reading.
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = server.cpu_seconds(), time.monotonic()
        seq1, reporting = seq_sum(server.url)
        fs = None if redis_url else strace_counts(server.worker_pid(), 5.0)
    finally:
        if server is not None:
            server.stop()
        if sim is not None:
            sim.terminate()
            sim.wait()
    wall = t1 - t0
    cores = (cpu1 - cpu0) / wall
    per_s = (seq1 - seq0) / wall
    return {
        "transport": "redis" if redis_url else "files",
        "ranks": ranks,
        "reporting": reporting,
        "hb_per_s": per_s,
        "cores": cores,
        "us_per_hb": cores / per_s * 1e6 if per_s else float("nan"),
        "fs_ops_per_s": None if fs is None else sum(fs.get(c, 0) for c in FS_CALLS) / 5.0,
    }


def print_table(results: list[dict]) -> None:
    header = f"{'transport':>9} {'ranks':>6} {'hb/s':>7} {'dash cores':>10} {'us/hb':>7} {'fs ops/s':>9}"
    print(header)
    print("-" * len(header))
    for r in results:
        fs = "-" if r["fs_ops_per_s"] is None else f"{r['fs_ops_per_s']:.0f}"
        print(
            f"{r['transport']:>9} {r['ranks']:>6} {r['hb_per_s']:>7.0f} {r['cores']:>10.3f} "
            f"{r['us_per_hb']:>7.1f} {fs:>9}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.ingest", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[256, 1024, 4096], help="over files")
    parser.add_argument("--redis-ranks", type=int, nargs="*", default=[4096, 16384], help="over Redis")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=15.0)
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-ingest-") as tmp:
        workdir = Path(tmp)
        for n in args.ranks:
            results.append(measure(n, args.seconds, args.warmup, workdir, None))
            print_table(results[-1:])
        if args.redis_ranks:
            if shutil.which("redis-server") is None:
                print("redis-server is not installed (apt-get install redis-server): skipping Redis")
            else:
                redis_proc, url = start_redis(workdir)
                try:
                    for n in args.redis_ranks:
                        import redis

                        redis.Redis.from_url(url).flushall()
                        results.append(measure(n, args.seconds, args.warmup, workdir, url))
                        print_table(results[-1:])
                finally:
                    redis_proc.terminate()
                    redis_proc.wait()
    print()
    print_table(results)
    print(
        f"\nload average during the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
