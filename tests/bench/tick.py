"""The watcher's tick in-process: dashboard CPU per heartbeat, over files and over Redis, with a profile.

``.venv/bin/python -m tests.bench.tick [--ranks 256 1024 4096] [--redis-ranks 4096 16384] [--ticks 10] [--profile]``

``tests.bench.ingest`` measures a real dashboard fed by the simulator, whose
writers compete with it for a 2-core machine. This takes the simulator out:
between two ticks it writes (or publishes) a fresh heartbeat for half of the
ranks, as 1 Hz heartbeats do at ``TICK_S`` = 0.5, and then times only the
dashboard's side of the tick with ``time.thread_time``: ``RunState.scan``
(read, validate, judge, build rows), ``take_delta`` (what the page is sent)
and the stop service's status, as ``app.watcher.Watcher.tick`` runs them.
``--profile`` prints cProfile's top functions of the largest size, which is
where to look when the figure grows with the job.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

from app.audit import AuditLog
from app.config import from_env
from app.run.jobend import StopInputs
from app.run.state import RunState
from app.stop.service import StopService
from tests.bench.ingest import start_redis
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import redisbus


def measure(ranks: int, ticks: int, workdir: Path, redis_url: str | None, profile: bool) -> dict:
    run = workdir / f"run-{ranks}-{'redis' if redis_url else 'files'}"
    run.mkdir()
    write_job(run, ranks)
    subscriber = publisher = None
    if redis_url:
        job = redisbus.job_key(run)
        publisher = redisbus.Publisher(redis_url, job, ranks)
        subscriber = redisbus.Subscriber(redis_url, job)

    def beat(rank: int, seq: int, now: float) -> None:
        hb = heartbeat(rank, ranks, seq=seq, now=now)
        if publisher is not None:
            publisher.publish(rank, json.dumps(hb).encode())
        else:
            write_heartbeat(run, hb)

    now = time.time()
    for r in range(ranks):
        beat(r, 1, now)
    state = RunState(run, from_env({}), redis=subscriber)
    stop = StopService(str(run), AuditLog(run / "audit.sqlite3"), deadline_s=120, auto_rearm=True)

    def tick(t: float) -> None:
        state.scan(t)
        state.take_delta(t)
        beats, world = state.heartbeats()
        stop.tick(inputs=StopInputs(beats, world))
        stop.status(t, StopInputs(beats, world, state.log_stop_facts()))

    tick(now)  # the first tick reads everything once
    profiler = cProfile.Profile() if profile else None
    cpu = 0.0
    taken = 0
    for i in range(1, ticks + 1):
        t = now + 0.5 * i
        half = range(i % 2, ranks, 2)
        for r in half:
            beat(r, i + 1, t)
        taken += len(half)
        c0 = time.thread_time()
        if profiler is not None:
            profiler.enable()
        tick(t)
        if profiler is not None:
            profiler.disable()
        cpu += time.thread_time() - c0
    assert sum(row["seq"] or 0 for row in state.snapshot(t)["ranks"]) > ranks, "no heartbeat was taken in"
    return {
        "transport": "redis" if redis_url else "files",
        "ranks": ranks,
        "ms_per_tick": cpu / ticks * 1e3,
        "us_per_hb": cpu / taken * 1e6,
        # At 1 Hz every rank's heartbeat is taken in once a second.
        "cores_at_1hz": cpu / taken * ranks,
        "profiler": profiler,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.tick", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[256, 1024, 4096], help="over files")
    parser.add_argument("--redis-ranks", type=int, nargs="*", default=[4096, 16384], help="over Redis")
    parser.add_argument("--ticks", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="print the profile of the largest size")
    args = parser.parse_args(argv)
    results = []
    header = f"{'transport':>9} {'ranks':>6} {'ms/tick':>8} {'us/hb':>7} {'cores at 1 Hz':>13}"
    print(header)
    print("-" * len(header))

    def run(n: int, url: str | None) -> None:
        r = measure(n, args.ticks, workdir, url, args.profile)
        results.append(r)
        print(
            f"{r['transport']:>9} {n:>6} {r['ms_per_tick']:>8.1f} {r['us_per_hb']:>7.1f} {r['cores_at_1hz']:>13.3f}"
        )

    with tempfile.TemporaryDirectory(prefix="rankwatch-tick-") as tmp:
        workdir = Path(tmp)
        for n in args.ranks:
            run(n, None)
        if args.redis_ranks:
            if shutil.which("redis-server") is None:
                print("redis-server is not installed (apt-get install redis-server): skipping Redis")
            else:
                proc, url = start_redis(workdir)
                try:
                    for n in args.redis_ranks:
                        run(n, url)
                finally:
                    proc.terminate()
                    proc.wait()
    print(f"\nload average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    if args.profile and results:
        largest = max(results, key=lambda r: r["ranks"])
        print(f"\nprofile, {largest['transport']} at {largest['ranks']} ranks:")
        pstats.Stats(largest["profiler"]).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
