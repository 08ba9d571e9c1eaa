"""``python -m tests.bench.runhistory [--runs 1000] [--hours 24]``: memory of the whole-run chart series.

One run's series (app/run/history.py) is built from ``--hours`` of 1 Hz
steps reported by two ranks, timed, then copied into ``--runs`` series (a
copy of each column, so each run owns its memory as a real one would), and
the process's RSS is printed before and after. It measures what the series
cost once built, not the dashboard's other per-run state (the runs registry,
heartbeat slots); building every run from its own feed would take minutes
of CPU for the same figure. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import copy
import time

import psutil

from app.run.history import RunHistory

T0 = 1.7e9


def build(hours: float, cap: int) -> RunHistory:
    hist = RunHistory(cap)
    for i in range(int(hours * 3600)):
        for r in range(2):
            hist.feed(r, (T0 + i + 0.1 * r, i + 1, 2.3 / (1 + i / 500) + 0.01 * r, 100.0 + 5 * r), "launch-1")
    return hist


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.runhistory")
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--cap", type=int, default=10_000)
    args = parser.parse_args()
    proc = psutil.Process()
    mib = 1024 * 1024
    t = time.perf_counter()
    one = build(args.hours, args.cap)
    took = time.perf_counter() - t
    points = len(one)
    column_bytes = sum(s.t.itemsize * len(s) * 5 for s in one._series.values())
    print(
        f"one run, {args.hours:g} h at 1 Hz from 2 ranks ({int(args.hours * 3600 * 2)} reports): "
        f"built in {took:.1f} s, {points} points kept (cap {args.cap}), {column_bytes / 1024:.0f} KiB of columns, "
        f"thinned {[(r[2], round((r[1] - r[0]) / 3600, 1)) for r in one.thinned]} (every s, hours)"
    )
    before = proc.memory_info().rss
    runs = [copy.deepcopy(one) for _ in range(args.runs)]
    after = proc.memory_info().rss
    answer = runs[-1].answer([])
    print(
        f"{args.runs} such runs: RSS {before / mib:.0f} MiB -> {after / mib:.0f} MiB "
        f"(+{(after - before) / mib:.0f} MiB, {(after - before) / max(1, args.runs) / 1024:.0f} KiB a run); "
        f"one run's /api/history/run answer holds {sum(len(a['points']) for a in answer['attempts'])} points"
    )


if __name__ == "__main__":
    main()
