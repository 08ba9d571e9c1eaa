"""``python -m tests.bench.runs [--runs 10000]``: GET /api/runs over a root of idle runs.

Each run has job.json and two finished ranks' heartbeats an hour old. It
measures the first (cold) answer, the registry loop's read-ahead of the
rows (``Rows.warm``), and then p50/p95 of ``GET /api/runs`` (four queries in
turn) over 20 s, the root's rescans every 5 s included. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job


def make_root(n: int) -> str:
    root = tempfile.mkdtemp(prefix="runs-bench-")
    old = time.time() - 3600
    for i in range(n):
        run = os.path.join(root, f"team{i % 100}", f"run{i:05d}")
        write_job(run, 2)
        for r in range(2):
            path = write_heartbeat(run, heartbeat(r, 2, seq=3, now=old, state="finished"), history=False)
            os.utime(path, (old, old))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.runs")
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    from app import create_app

    root = make_root(args.runs)
    try:
        app = create_app({"RUNS_ROOT": root, "TESTING": True})
        client = app.test_client()
        registry, rows = app.extensions["rankwatch_runs"], app.extensions["rankwatch_rows"]
        t = time.perf_counter()
        registry.discovery.scan()
        read = 0
        while True:
            n = rows.warm(budget_s=3600)
            read += n
            if not n:
                break
        print(
            f"{args.runs} runs: scan and read-ahead of every row {time.perf_counter() - t:.1f} s ({read} rows)"
        )
        queries = [
            "/api/runs",
            "/api/runs?sort=-global_step&page=3",
            "/api/runs?q=run0001",
            "/api/runs?state=finished",
        ]
        lat = []
        end = time.monotonic() + args.seconds
        while time.monotonic() < end or len(lat) < 100:
            t = time.perf_counter()
            assert client.get(queries[len(lat) % 4]).status_code == 200
            lat.append(time.perf_counter() - t)
        lat.sort()
        print(
            f"GET /api/runs: {len(lat)} requests: p50 {lat[len(lat) // 2] * 1000:.0f} ms, "
            f"p95 {lat[int(len(lat) * 0.95)] * 1000:.0f} ms, max {lat[-1] * 1000:.0f} ms"
        )
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
