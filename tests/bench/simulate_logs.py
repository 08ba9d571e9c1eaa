"""A fake job without the bridge: N ranks printing LossMonitor lines into msrun's worker logs.

``python -m tests.bench.simulate_logs --log-dir RUN/msrun_logs --ranks 256 --rate 10 [--seconds S]``

Each rank appends ``epoch: E step: S, loss is L`` (MindSpore's LossMonitor,
``per_print_times=1``) ``--rate`` times a second to ``worker_N.log``, at its
own offset within the period as real ranks drift, and a TimeMonitor line at
each epoch's end (every ``--steps-per-epoch`` steps). One line is one
``write`` + flush, as ``print(..., flush=True)`` does. The files stay open,
so a writer process manages thousands of lines a second; ``--lines-file``
receives the number of lines written when it ends (the benchmark's count).
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path


def run(
    log_dir: Path, ranks: int, rate: float, seconds: float | None, spe: int, lines_file: Path | None
) -> int:
    log_dir.mkdir(parents=True, exist_ok=True)
    files = [open(log_dir / f"worker_{r}.log", "a", buffering=1) for r in range(ranks)]
    period = 1.0 / rate
    start = time.time()
    written = 0
    step = [0] * ranks
    stop = False

    def end(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, end)
    k = 0  # the k-th line of the job: rank k % ranks, round k // ranks
    try:
        while not stop:
            rnd, r = divmod(k, ranks)
            due = start + (rnd + r / ranks) * period
            now = time.time()
            if seconds is not None and now - start >= seconds:
                break
            if due > now:
                time.sleep(min(due - now, 0.05))
                continue
            step[r] += 1
            epoch, in_epoch = divmod(step[r] - 1, spe)
            f = files[r]
            f.write(f"epoch: {epoch + 1} step: {in_epoch + 1}, loss is {2.3 / (1 + step[r] / 500):.16f}\n")
            written += 1
            if in_epoch + 1 == spe:
                f.write(
                    f"Train epoch time: {spe * period * 1000:.3f} ms, per step time: {period * 1000:.3f} ms\n"
                )
                written += 1
            k += 1
    finally:
        for f in files:
            f.close()
        if lines_file is not None:
            lines_file.write_text(str(written))
    return written


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--ranks", type=int, default=256)
    p.add_argument("--rate", type=float, default=10.0, help="lines per second per rank (default 10)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default: SIGTERM)")
    p.add_argument("--steps-per-epoch", type=int, default=100)
    p.add_argument("--lines-file", type=Path, default=None)
    args = p.parse_args(argv)
    run(args.log_dir, args.ranks, args.rate, args.seconds, args.steps_per_epoch, args.lines_file)


if __name__ == "__main__":
    main()
