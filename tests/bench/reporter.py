"""The reporter thread's own load: ``python -m tests.bench.reporter [--seconds 20] [--strace]``.

Runs the bridge's real ``Reporter`` (1 s heartbeats, the default poll) in a
temporary run directory for ``--seconds`` while this process's main thread
plays a training thread that only counts steps (100 a second), and prints
the reporter's CPU time per second, from its own accounting
(``reporter_cpu_ms``, ``time.thread_time`` around each wake-up). With
``--strace`` it runs itself again under ``strace -f`` and also prints the
reporter thread's syscalls per second and the most frequent ones: every one
of them leaves the interpreter, and on a shared file system each ``stat``,
``open`` and ``rename`` is a metadata operation on the server.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TID = "REPORTER-TID "
CPU = "REPORTER-CPU-MS-PER-S "


def run(seconds: float) -> None:
    from trainer_bridge.counters import Counters
    from trainer_bridge.reporter import Reporter
    from trainer_bridge.saving import NOTHING_SERVED
    from trainer_bridge.settings import Settings

    s = Settings()
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-reporter-") as tmp:
        counters = Counters(1, 100, 0)
        reporter = Reporter(
            Path(tmp),
            0,
            2,
            counters,
            served=NOTHING_SERVED,
            heartbeat_interval_s=s.heartbeat_interval_s,
            poll_interval_s=s.poll_interval_s,
            sync_interval_s=s.sync_interval_s,
            batch_size=32,
            resumed=None,
        )
        reporter.state = "training"
        reporter.start()
        print(TID + str(reporter.handover.thread.native_id), flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            counters.global_step += 1
            counters.steps_total += 1
            counters.step_times.append(0.01)
            counters.last_step_end = time.perf_counter()
            time.sleep(0.01)
        reporter.close()
        print(CPU + f"{reporter.reporter_cpu_ms / seconds:.3f}", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--strace", action="store_true", help="also count the reporter's syscalls (needs strace)")
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_worker:
        run(args.seconds)
        return
    me = [sys.executable, "-m", "tests.bench.reporter", "--as-worker", "--seconds", str(args.seconds)]
    out = subprocess.run(me, capture_output=True, text=True, check=True).stdout
    cpu = next(ln for ln in out.splitlines() if ln.startswith(CPU))[len(CPU) :]
    print(f"reporter thread CPU: {cpu} ms a second ({args.seconds:g} s, poll and heartbeat at the defaults)")
    if not args.strace:
        return
    if not shutil.which("strace"):
        raise SystemExit("--strace needs strace on PATH (apt-get install strace)")
    with tempfile.NamedTemporaryFile("r", suffix=".strace") as trace:
        out = subprocess.run(
            ["strace", "-f", "-qq", "-o", trace.name, *me], capture_output=True, text=True, check=True
        ).stdout
        tid = next(ln for ln in out.splitlines() if ln.startswith(TID))[len(TID) :]
        calls = [
            ln.split(None, 1)[1].split("(", 1)[0]
            for ln in trace.read().splitlines()
            if ln.startswith(tid + " ") and "resumed>" not in ln
        ]
    print(f"reporter thread syscalls: {len(calls) / args.seconds:.1f} a second; the most frequent:")
    for name, n in collections.Counter(calls).most_common(8):
        print(f"  {name:<16}{n / args.seconds:>6.1f}/s")


if __name__ == "__main__":
    main()
