"""The loss-spike detector's cost per heartbeat at 4,096 ranks, as a ratio of the tick without it.

``.venv/bin/python -m tests.bench.spikes [--ranks 4096] [--pairs 30] [--seed 1]``

Run by hand, not in CI. One run directory and one ``RunState``, as the
watcher holds them. Between two ticks half of the ranks write a fresh
heartbeat (1 Hz heartbeats at ``TICK_S`` = 0.5), with a new global step and a
noisy falling loss. Each pair of ticks runs one with the detector and one
without (``RunState.spikes_on``), in an order drawn at random per pair, so
the machine's load drifts over both alike; only the dashboard's side of the
tick is timed (``time.thread_time``: ``scan``, ``take_delta``,
``take_spikes``). The figure is the ratio on/off over all pairs (total
time with / total time without), with a 95% bootstrap interval over the
pairs, and the detector's own cost per heartbeat (the difference of the
means). It also times ``Detector.observe`` alone over the same heartbeats.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from app.config import from_env
from app.run.spikes import Detector
from app.run.state import RunState
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job


def loss_at(rank: int, step: int) -> float:
    return 2.3 / (1 + step / 500) * (1 + 0.05 * math.sin(step * 1.3 + rank))


def bootstrap(pairs: list[tuple[float, float]], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """95% interval of sum(on) / sum(off), resampling the pairs."""
    ratios = []
    for _ in range(n):
        sample = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        ratios.append(sum(a for a, _ in sample) / sum(b for _, b in sample))
    ratios.sort()
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.spikes", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    n = args.ranks
    with tempfile.TemporaryDirectory(prefix="rankwatch-spikes-") as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        write_job(run, n)
        now = time.time()
        beats: list[tuple[int, dict]] = []

        def write(i: int, t: float, half) -> None:
            for r in half:
                step = 10 * i
                hb = heartbeat(r, n, seq=i, now=t, global_step=step, loss=loss_at(r, step), validate=False)
                write_heartbeat(run, hb, history=False)
                beats.append((r, hb))

        write(1, now, range(n))
        state = RunState(run, from_env({}))
        state.scan(now)  # the first tick reads everything once
        state.take_delta(now)
        state.take_spikes()
        times = {True: [], False: []}
        taken = {True: 0, False: 0}
        pairs: list[tuple[float, float]] = []
        i = 1
        for _ in range(args.pairs):
            order = [True, False]
            rng.shuffle(order)
            got = {}
            for on in order:
                i += 1
                t = now + 0.5 * i
                half = range(i % 2, n, 2)
                write(i, t, half)
                state.spikes_on = on
                c0 = time.thread_time()
                state.scan(t)
                state.take_delta(t)
                state.take_spikes()
                got[on] = time.thread_time() - c0
                times[on].append(got[on])
                taken[on] += len(half)
            pairs.append((got[True], got[False]))
        assert not state.spike_view()["detections"], "a false alarm on a smooth curve"
        ratio = sum(a for a, _ in pairs) / sum(b for _, b in pairs)
        low, high = bootstrap(pairs, rng)
        per_hb_on = sum(times[True]) / taken[True] * 1e6
        per_hb_off = sum(times[False]) / taken[False] * 1e6
        # The detector alone, over every heartbeat written (each rank's steps in order).
        det = Detector(world=n)
        c0 = time.thread_time()
        for r, hb in beats:
            det.observe(r, hb, 0.0)
        alone = (time.thread_time() - c0) / len(beats) * 1e6
    print(f"{n} ranks, {args.pairs} interleaved pairs of ticks, {n // 2} heartbeats a tick")
    print(f"tick with the detector / without: {ratio:.3f} (95% bootstrap interval {low:.3f}-{high:.3f})")
    print(
        f"per heartbeat: {per_hb_on:.1f} us with, {per_hb_off:.1f} us without: {per_hb_on - per_hb_off:+.1f} us"
    )
    print(f"Detector.observe alone: {alone:.2f} us per heartbeat")
    print(
        f"median tick: {statistics.median(times[True]) * 1e3:.1f} ms with, "
        f"{statistics.median(times[False]) * 1e3:.1f} ms without"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
