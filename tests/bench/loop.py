"""Functional-loop overhead: ``python -m tests.bench.loop [--ranks 2] [--pairs 8] [--steps 100]``.

Throughput of a functional training loop with ``bridge.loop`` / the same loop
without it (target >= 0.99), measured in one ``msrun`` job: every rank runs
the two sides alternately (AB BA AB ...), ``--pairs`` times, so drift and
noise on a shared machine hit both alike. A side is ``--steps`` steps of
LeNet5 on in-memory data (``--batch``, 32) with ``ms.value_and_grad``,
``nn.DistributedGradReducer`` and ``optimizer(grads)``; each bridge side is a
fresh ``GracefulExitBridge`` (its own reporter thread, heartbeats, flag
polls and agreements, none resumed or stopped). Each step's period is timed
in the loop body (end to end: the step, the fetch of the next row and, with
the bridge, its hooks), leaving out the first ``--warmup`` steps of every
side, so graph compilation and the bridge's first agreement (which compiles
its AllReduce, once per process in real use) count on neither side.

Printed on rank 0, per pair and over all: the ratio of the summed periods
(without / with), the ratio of the median periods (robust to another
process's burst on a shared machine), and what the bridge's own accounting
says it spent over the timed steps (agreements, including the wait for the
peer that the next gradient AllReduce would otherwise wait, and the reporter
thread's CPU time: heartbeat ``bridge_cost``) as a share of the side, an
upper bound that noise does not move.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = "LOOP-BENCH "


def worker(args) -> None:
    import mindspore as ms
    import mindspore.dataset as ds
    import numpy as np
    from mindspore import nn
    from mindspore.communication import get_group_size, get_rank, init

    from trainer_bridge import GracefulExitBridge
    from trainer_bridge.demo.train import LeNet5

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    init()
    rank, world = get_rank(), get_group_size()
    ms.set_auto_parallel_context(
        parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world
    )
    ms.set_seed(1)
    rng = np.random.default_rng(rank)
    images = rng.random((args.steps * args.batch, 1, 32, 32), dtype=np.float32)
    labels = rng.integers(0, 10, args.steps * args.batch).astype(np.int32)

    class Source:  # numpy 2: return arrays, not numpy scalars (seeds/README.md)
        def __getitem__(self, i):
            return images[i], np.array(labels[i], np.int32)

        def __len__(self):
            return len(labels)

    dataset = ds.GeneratorDataset(Source(), ["x", "y"], shuffle=False).batch(args.batch)

    net = LeNet5()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    grad_reducer = nn.DistributedGradReducer(opt.parameters)

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grad_reducer(grads))
        return loss

    def cost(bridge) -> tuple[int, float, float]:
        """The bridge's own accounting so far (what its heartbeat's ``bridge_cost`` shows)."""
        engine = bridge._engine
        c = engine.counters
        return c.agreements, c.agree_ms, engine.reporter.reporter_cpu_ms

    def side(rows, bridge=None) -> tuple[list[float], dict | None]:
        """Each step's period (body end to body end: the step and the fetch of its row), and the
        bridge's cost over the same steps."""
        ends, spent = [], None
        for x, y in rows:
            loss = train_step(x, y)
            if bridge is not None:
                bridge.report(loss=loss)
            ends.append(time.perf_counter())
            if bridge is not None and len(ends) == args.warmup + 1:
                spent = cost(bridge)
        if bridge is not None:
            after = cost(bridge)
            names = ("agreements", "agree_ms", "reporter_cpu_ms")
            spent = {k: b - a for k, a, b in zip(names, spent, after, strict=True)}
        ends = ends[args.warmup :]
        return [b - a for a, b in zip(ends, ends[1:], strict=False)], spent

    side(dataset.create_tuple_iterator(num_epochs=1))  # compile the step
    results = []
    for pair in range(args.pairs):
        times = {}
        order = ("bridge", "plain") if pair % 2 == 0 else ("plain", "bridge")
        for which in order:
            if which == "plain":
                times[which], _ = side(dataset.create_tuple_iterator(num_epochs=1))
            else:
                bridge = GracefulExitBridge(Path(args.run_dir) / f"pair{pair}", resume=False)
                rows = bridge.loop(dataset, network=net, optimizer=opt, epochs=1)
                times[which], times["bridge_cost"] = side(rows, bridge)
        results.append(times)
    if rank == 0:
        print(RESULT + json.dumps(results), flush=True)


def launch(args) -> list[dict]:
    from trainer_bridge.demo.__main__ import free_port, job_env

    run_dir = Path(args.run_dir)
    (run_dir / "msrun_logs").mkdir(parents=True, exist_ok=True)
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "mindspore.parallel.cluster.run",
        f"--worker_num={args.ranks}",
        f"--local_worker_num={args.ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--join=True",
        f"--log_dir={run_dir / 'msrun_logs'}",
        str(Path(__file__).resolve()),
        "--as-worker",
        "--run-dir",
        str(run_dir),
        "--pairs",
        str(args.pairs),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(args.batch),
    ]
    with open(run_dir / "launcher.log", "wb") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    worker_log = run_dir / "msrun_logs" / "worker_0.log"
    log = worker_log.read_text(errors="replace") if worker_log.exists() else ""
    line = next((ln for ln in log.splitlines() if ln.startswith(RESULT)), None)
    if code != 0 or line is None:
        tail = "\n".join((log or (run_dir / "launcher.log").read_text(errors="replace")).splitlines()[-30:])
        raise SystemExit(f"the benchmark job failed ({code}):\n{tail}")
    return json.loads(line[len(RESULT) :])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="msrun workers (default 2)")
    p.add_argument("--pairs", type=int, default=8, help="AB/BA pairs of sides (default 8)")
    p.add_argument("--steps", type=int, default=100, help="steps per side (default 100)")
    p.add_argument("--batch", type=int, default=32, help="batch size per rank (default 32)")
    p.add_argument("--warmup", type=int, default=20, help="steps of each side left out (default 20)")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.as_worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-loop-") as tmp:
        args.run_dir = tmp
        started = time.monotonic()
        results = launch(args)
    steps = args.steps - args.warmup - 1  # periods timed per side
    print(f"functional loop, {args.ranks} ranks under msrun, {args.pairs} pairs of {steps} timed steps each")
    print(
        f"{'pair':>4} {'with ms/step':>13} {'without':>8} {'ratio':>7} {'median':>7}  "
        "bridge's own over the timed steps (rank 0): agreements, agree ms, reporter CPU ms, share"
    )
    ratios, medians, shares, totals = [], [], [], [0.0, 0.0]
    for i, r in enumerate(results):
        with_s, without_s = sum(r["bridge"]), sum(r["plain"])
        ratios.append(without_s / with_s)
        medians.append(statistics.median(r["plain"]) / statistics.median(r["bridge"]))
        cost = r["bridge_cost"]
        # An upper bound on what the bridge took: agreements include waiting
        # for the peer, which the next gradient AllReduce would wait anyway.
        shares.append((cost["agree_ms"] + cost["reporter_cpu_ms"]) / (with_s * 1e3))
        totals[0] += without_s
        totals[1] += with_s
        print(
            f"{i + 1:>4} {with_s / steps * 1e3:>13.3f} {without_s / steps * 1e3:>8.3f} {ratios[-1]:>7.4f}"
            f" {medians[-1]:>7.4f}"
            f"  {cost['agreements']}, {cost['agree_ms']:.1f}, {cost['reporter_cpu_ms']:.1f}, "
            f"{shares[-1] * 100:.2f}%"
        )
    pooled = totals[0] / totals[1]
    print(
        f"throughput with bridge.loop / without: median of pairs {statistics.median(ratios):.4f}, "
        f"pooled {pooled:.4f}, median step ratio {statistics.median(medians):.4f} (target >= 0.99); "
        f"load average {os.getloadavg()[0]:.1f}; "
        f"{time.monotonic() - started:.0f} s"
    )
    print(
        f"1 - bridge's own cost (an upper bound of its share), median of pairs: {1 - statistics.median(shares):.4f}"
    )


if __name__ == "__main__":
    main()
