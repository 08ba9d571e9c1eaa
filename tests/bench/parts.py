"""Where the bridge's time goes, part by part: ``python -m tests.bench.parts [--step-ms 28 3]``.

An in-process microbenchmark that a loaded machine cannot blur: each part
of the bridge is run on its own, many times, and its cost is the fastest of
several repeats (thread CPU time for the reporter's parts, wall time for the
training thread's). With how often each part runs at the default settings
it gives the share of a step time ``--step-ms`` each part can take: the
bridge's cost as the A/B benchmarks (``tests.bench.loop``,
``tests.bench.bridge`` figure 1) should see it, part by part.

* per step, on the training thread: the callback's ``on_train_step_begin``
  and ``on_train_step_end`` (through ``Model.train``'s own ``RunContext``),
  and ``bridge.loop``'s iterator with ``bridge.report(loss=...)``, each
  beyond the same loop without them;
* once a heartbeat (1 s), on the training thread: converting the loss Tensor
  to a float (``asnumpy``; MindSpore's CPU graph steps are synchronous, so it
  waits for nothing);
* on the reporter thread: a heartbeat (built, validated, written, its
  history line), the process sample inside it (CPU time and RSS), and one
  poll (the flag's and the stack requests' ``os.stat``), once a second;
* an agreement needs ranks: the A/B benchmarks print its accounted cost.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def fastest(fn, *, n: int, repeats: int = 7, clock=time.perf_counter) -> float:
    """Seconds per call of ``fn``: the fastest mean over ``repeats`` runs of ``n`` calls."""
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t) / n)
    return best


def measure(run_dir: Path) -> dict:
    """Each part's cost in seconds per event."""
    import mindspore as ms
    import numpy as np
    from mindspore import nn
    from mindspore.train.callback._callback import InternalCallbackParam, RunContext

    from trainer_bridge import GracefulExitBridge

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    out = {}

    # The callback's hooks, with the RunContext Model.train passes; no agreement falls due.
    bridge = GracefulExitBridge(run_dir / "callback", resume=False, sync_interval_s=1e5, max_sync_every=10**6)
    cb = InternalCallbackParam()
    cb.train_network, cb.cur_epoch_num, cb.batch_num, cb.cur_step_num = nn.Dense(2, 2), 1, 10**9, 0
    cb.net_outputs = ms.Tensor(np.float32(1.0))
    rc = RunContext(cb)
    bridge.on_train_begin(rc)
    bridge._engine.reporter.loss_due = float("inf")  # the loss conversion is timed on its own below

    def plain_step():
        cb.cur_step_num += 1

    def hooked_step():
        cb.cur_step_num += 1
        bridge.on_train_step_begin(rc)
        bridge.on_train_step_end(rc)

    out["callback hooks"] = fastest(hooked_step, n=5000) - fastest(plain_step, n=5000)
    bridge.on_train_end(rc)

    # bridge.loop's iterator and report(loss=) against iterating the same rows.
    rows = [(i, i) for i in range(40000)]

    class Rows:  # what bridge.loop needs of a dataset
        def get_dataset_size(self):
            return len(rows)

        def create_tuple_iterator(self, num_epochs=1):
            return iter(rows)

    loss = cb.net_outputs
    n = 5000

    def bare() -> float:
        t = time.perf_counter()
        for _ in zip(range(n), rows, strict=False):
            pass
        return time.perf_counter() - t

    looped = GracefulExitBridge(run_dir / "loop", resume=False, sync_interval_s=1e5, max_sync_every=10**6)
    net = nn.Dense(2, 2)

    def with_loop() -> float:
        it = looped.loop(Rows(), network=net, optimizer=net, epochs=1)
        next(it)  # begins: the reporter starts
        looped._engine.reporter.loss_due = float("inf")
        t = time.perf_counter()
        for _ in zip(range(n), it, strict=False):
            looped.report(loss=loss)
        took = time.perf_counter() - t
        it.close()
        return took

    out["loop iterator + report"] = (min(with_loop() for _ in range(5)) - min(bare() for _ in range(5))) / n

    # Once a heartbeat: the loss Tensor to a float.
    it = looped.loop(Rows(), network=net, optimizer=net, epochs=1)
    next(it)
    reporter = looped._engine.reporter
    out["loss to float"] = fastest(lambda: reporter.take_loss(loss), n=2000)

    # The reporter thread's parts, in thread CPU time.
    counters = reporter.counters

    def heartbeat():
        for _ in range(64):
            counters.step_times.append(0.003)
        counters.global_step += 64
        counters.steps_total += 64
        reporter._write_heartbeat(history=True)

    out["heartbeat"] = fastest(heartbeat, n=100, clock=time.thread_time)
    out["  process sample in it"] = fastest(reporter._procstats.sample, n=500, clock=time.thread_time)

    def poll():
        reporter._poll_flag()
        reporter.stacks.poll(steps=1, since_step_s=0.0, step_s=0.003, global_step=1, stepping=True)

    out["poll"] = fastest(poll, n=1000, clock=time.thread_time)
    it.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--step-ms", type=float, nargs="+", default=[28.0, 3.0], help="step times to share against"
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-parts-") as tmp:
        parts = measure(Path(tmp))
    # Events per step (per step) or per second (the defaults: 1 s heartbeats, 1 s polls).
    per_step = {"callback hooks", "loop iterator + report"}
    per_second = {"loss to float": 1.0, "heartbeat": 1.0, "  process sample in it": 1.0, "poll": 1.0}
    head = "".join(f"{f'share at {ms:g} ms':>16}" for ms in args.step_ms)
    print(f"{'part':<26}{'cost us':>9}  {'how often':<12}{head}")
    for name, cost in parts.items():
        often = "every step" if name in per_step else f"{per_second[name]:g}/s"
        shares = "".join(
            f"{(cost / (ms / 1e3) if name in per_step else cost * per_second[name]) * 100:>15.3f}%"
            for ms in args.step_ms
        )
        print(f"{name:<26}{cost * 1e6:>9.2f}  {often:<12}{shares}")
    print(
        "cost: the fastest of several repeats (thread CPU for the reporter's parts); share: of a step time "
        "(every step) or of a second (the rest). An agreement needs ranks: see the A/B benchmarks' own share."
    )


if __name__ == "__main__":
    main()
