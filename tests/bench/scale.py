"""Scale benchmark: heartbeat-to-screen latency, dashboard CPU and push volume.

``.venv/bin/python -m tests.bench.scale [--ranks 64 256 1024] [--seconds 20] [--redis]``

For each job size N it starts the simulator (a separate process, so its
work is not counted against the dashboard), a real dashboard and a headless
Chromium on the page, lets everything warm up, then measures over a window:

* latency: each heartbeat carries its write time ``time``; the page logs when
  it drew each rank's new ``seq`` (``window.rankwatchRenderLog``); both use
  this machine's clock, so drawn - written is the write-to-screen latency;
* the dashboard's CPU: psutil ``cpu_times`` delta over the window, summed
  over its processes (gunicorn's arbiter and worker), divided by the wall
  time (1.0 = one core busy);
* bytes pushed per second: the WebSocket frames the page received;
* with ``--redis``, the simulator publishes to a real ``redis-server``
  started here on a loopback port (as the bridge does with
  ``RANKWATCH_REDIS_URL``) and the dashboard reads it instead of the files.

``us/hb`` is the dashboard's CPU per heartbeat written, the figure that
stays meaningful when the simulator cannot keep up on a small machine.

Target at 1024 ranks: p95 latency <= 1.5 s, dashboard <= 0.5 core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from playwright.sync_api import sync_playwright

from tests.bench.ingest import start_redis
from tests.helpers.liveserver import REPO, launch_chromium, start_dashboard
from trainer_bridge.rundir import runfiles

TARGET_P95_S = 1.5
TARGET_CORES = 0.5
TARGET_RANKS = 1024


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def total_seq(run_dir: Path, ranks: int, redis_url: str | None = None) -> int:
    """Heartbeats written so far by all ranks (the sum of their ``seq``)."""
    if redis_url:
        import json

        import redis

        from trainer_bridge.rundir import redisbus

        _, latest, _ = redisbus.keys(redisbus.job_key(run_dir))
        beats = redis.Redis.from_url(redis_url).hgetall(latest).values()
        return sum(json.loads(b).get("seq", 0) for b in beats)
    return sum(
        (runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, r)) or {}).get("seq", 0)
        for r in range(ranks)
    )


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"simulator exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear in {timeout} s")
        time.sleep(0.1)


def measure(
    playwright, ranks: int, seconds: float, warmup: float, workdir: Path, redis_url: str | None
) -> dict:
    run_dir = workdir / f"run-{ranks}{'-redis' if redis_url else ''}"
    sim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.bench.simulate",
            "--run-dir",
            str(run_dir),
            "--ranks",
            str(ranks),
            "--history-seconds",
            "60",
            "--slow",
            f"{ranks // 2}:2",
        ]
        + (["--redis", redis_url] if redis_url else []),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    server = None
    browser = launch_chromium(playwright)
    try:
        wait_for_file(runfiles.job_path(run_dir), sim)
        env = {"RANKWATCH_REDIS_URL": redis_url} if redis_url else None
        server = start_dashboard(run_dir, workdir / f"dashboard-{run_dir.name}.log", env=env)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        frames = {"bytes": 0, "count": 0}
        errors = []
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        def on_frame(payload):
            frames["bytes"] += len(payload.encode() if isinstance(payload, str) else payload)
            frames["count"] += 1

        page.on("websocket", lambda ws: ws.on("framereceived", on_frame))
        page.goto(server.url + "/")
        page.wait_for_function(
            "n => window.rankwatch && window.rankwatch.store.rows.size >= n"
            " && [...window.rankwatch.store.rows.values()].every(r => r.time !== null)",
            arg=ranks,
            timeout=120_000,
        )
        page.wait_for_timeout(warmup * 1000)

        page.evaluate("window.rankwatchRenderLog.length = 0")
        frames.update(bytes=0, count=0)
        seq0 = total_seq(run_dir, ranks, redis_url)
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        page.wait_for_timeout(seconds * 1000)
        cpu1, t1 = server.cpu_seconds(), time.monotonic()
        seq1 = total_seq(run_dir, ranks, redis_url)
        pushed, messages = frames["bytes"], frames["count"]
        log = page.evaluate("window.rankwatchRenderLog.splice(0)")
        page.close()
    finally:
        browser.close()
        if server is not None:
            server.stop()
        sim.terminate()
        sim.wait()

    wall = t1 - t0
    latencies = [drawn / 1000.0 - written for _, _, written, drawn in log if written is not None]
    if not latencies:
        raise RuntimeError(f"{ranks} ranks: the page drew no heartbeat in {seconds} s")
    written = (seq1 - seq0) / wall
    cores = (cpu1 - cpu0) / wall
    return {
        "transport": "redis" if redis_url else "files",
        "ranks": ranks,
        "written_per_s": written,
        "us_per_hb": cores / written * 1e6 if written else float("nan"),
        "shown_per_s": len(latencies) / wall,
        "p50": statistics.median(latencies),
        "p95": percentile(latencies, 0.95),
        "max": max(latencies),
        "cores": cores,
        "kib_per_s": pushed / 1024 / wall,
        "msgs_per_s": messages / wall,
        "errors": errors,
    }


def print_table(results: list[dict]) -> None:
    header = (
        f"{'transport':>9} {'ranks':>6} {'written/s':>9} {'shown/s':>7} {'p50 s':>7} {'p95 s':>7} "
        f"{'max s':>7} {'dash cores':>10} {'us/hb':>6} {'pushed KiB/s':>12} {'frames/s':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['transport']:>9} {r['ranks']:>6} {r['written_per_s']:>9.0f} {r['shown_per_s']:>7.0f} "
            f"{r['p50']:>7.2f} {r['p95']:>7.2f} "
            f"{r['max']:>7.2f} {r['cores']:>10.2f} {r['us_per_hb']:>6.0f} {r['kib_per_s']:>12.1f} "
            f"{r['msgs_per_s']:>8.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=20.0, help="measurement window")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--redis", action="store_true", help="heartbeats over a local redis-server")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as tmp, sync_playwright() as pw:
        redis_proc, redis_url = start_redis(Path(tmp)) if args.redis else (None, None)
        try:
            for ranks in args.ranks:
                print(f"measuring {ranks} ranks for {args.seconds:g} s...", flush=True)
                results.append(measure(pw, ranks, args.seconds, args.warmup, Path(tmp), redis_url))
        finally:
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait()
    print()
    print_table(results)
    for r in results:
        for error in r["errors"]:
            print(f"console error at {r['ranks']} ranks: {error}")
    print(
        f"\nload average during the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
        f"on {os.cpu_count()} cores"
    )
    big = [r for r in results if r["ranks"] >= TARGET_RANKS]
    for r in big:
        ok = r["p95"] <= TARGET_P95_S and r["cores"] <= TARGET_CORES
        print(
            f"target at {r['ranks']} ranks (p95 <= {TARGET_P95_S} s, <= {TARGET_CORES} core): "
            f"{'met' if ok else 'MISSED'}"
        )
    return 0 if all(r["p95"] <= TARGET_P95_S and r["cores"] <= TARGET_CORES for r in big) else 1


if __name__ == "__main__":
    sys.exit(main())
