"""The reporter's cost at each agreement step: ``python -m tests.bench.agreement [--calls N] [--rounds R] [--against DIR]``.

Times ``Reporter.on_agreement()``, what the training thread pays at every
agreement once the reporter's work is handed to the agreements
(``trainer_bridge/handover.py``): a clock read, the wake-up timer re-armed,
the tick lock, and a tick that finds nothing due. The intervals are 30 s,
so no heartbeat falls inside the timed calls: this is the path of the usual
agreement, not a heartbeat's (``tests.bench.reporter`` measures those).
Each round is a fresh process; ``--against DIR`` (another checkout of the
project, say ``git archive`` of the base commit) alternates rounds between
DIR's ``trainer_bridge`` and this one's and prints the ratio of the medians.
The end-to-end per-step figure is ``tests.bench.loop``'s.
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

HERE = Path(__file__).resolve().parents[2]
NS = "NS-PER-CALL "
DEADLINE_S = 60.0  # a failure guard: the hand-over happens within a few agreements


def worker(calls: int) -> None:
    import trainer_bridge

    print(f"TREE {Path(trainer_bridge.__file__).parents[1]}", flush=True)
    from trainer_bridge import handover
    from trainer_bridge.counters import Counters
    from trainer_bridge.reporter import Reporter
    from trainer_bridge.saving import NOTHING_SERVED

    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-agreement-") as tmp:
        reporter = Reporter(
            Path(tmp),
            0,
            1,
            Counters(1, 100, 0),
            served=NOTHING_SERVED,
            heartbeat_interval_s=30.0,
            poll_interval_s=30.0,
            sync_interval_s=0.5,
            batch_size=None,
            resumed=None,
        )
        # A loaded host can preempt one call past SLOW_TICK_S, which gives the work back to
        # the thread for a minute (the rule for a file system in trouble): not what is timed here.
        handover.SLOW_TICK_S = 5.0
        reporter.state = "training"
        reporter.start()
        deadline = time.monotonic() + DEADLINE_S
        while reporter.handover.thread is not None:  # until the agreements have the work
            assert time.monotonic() < deadline, "the reporter never handed its work to the agreements"
            reporter.on_agreement()
            time.sleep(0.001)
        on_agreement = reporter.on_agreement
        start = time.perf_counter()
        for _ in range(calls):
            on_agreement()
        took = time.perf_counter() - start
        assert reporter.handover.thread is None, "the thread came back during the timing"
        reporter.close()
    print(NS + f"{took / calls * 1e9:.1f}", flush=True)


def one(tree: Path, calls: int) -> float:
    # Run as a script: its own folder, not this checkout, goes first on sys.path, so
    # ``trainer_bridge`` is the one of ``tree`` (PYTHONPATH).
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, __file__, "--as-worker", "--calls", str(calls)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    out = out.stdout
    lines = out.splitlines()
    assert f"TREE {tree}" in lines, f"imported the wrong trainer_bridge: {lines[:1]}"
    return float(next(line for line in lines if line.startswith(NS))[len(NS) :])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300_000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--against", type=Path, help="another checkout: its trainer_bridge is the baseline")
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_worker:
        worker(args.calls)
        return
    trees = {"this": HERE} | ({"against": args.against.resolve()} if args.against else {})
    got: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            got[name].append(one(tree, args.calls))
    for name, values in got.items():
        print(
            f"{name:8} {trees[name]}: median {statistics.median(values):.1f}, min {min(values):.1f} "
            "ns per agreement; "
            f"rounds {', '.join(f'{v:.0f}' for v in values)}"
        )
    if args.against:
        print(
            f"ratio this / against (medians): {statistics.median(got['this']) / statistics.median(got['against']):.3f}"
        )


if __name__ == "__main__":
    main()
