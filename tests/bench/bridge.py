"""Bridge benchmarks: ``python -m tests.bench.bridge [--jobs 4] [--pairs 10] [--quick] [--figures 1 2 3]``.

Prints three figures, each against a baseline measured in the same run:

1. Throughput of ``Model.train`` with the bridge's callback / the same
   ``Model.train`` without it (target >= 0.99, the 95% interval's low end
   >= 0.98), both sides with a trivial step-timing callback so both pay the
   same callback machinery, alternating in 2-rank ``msrun`` jobs by the
   method of ``tests/bench/ab.py`` (ranks bound, MindSpore's threads
   bounded, side order shuffled per round, warm-up left out), at two step
   sizes (LeNet5, and a tiny dense net of a few ms a step). ``--variants``
   adds sides with one part of the bridge switched off, to attribute a cost.
2. Per-step cost of the bridge's hooks / native ``OnRequestExit``'s hooks
   (target <= 1.0), timed inside one real single-process training run each,
   with ``MS_ENABLE_GRACEFUL_EXIT=1`` and a ``{"GracefulExit": 0}`` flag that
   native reads on every step.
3. Stop latency of the 2-rank job with the dashboard up: from ``POST
   /api/exit`` (what the button sends) and from the flag file's write to
   every rank exited (the launcher returned), median and p95 over several
   stops, broken down by stage (first rank saw the flag, every rank agreed,
   saved, left the training loop), with the per-stop target
   ``1 s + one step + save time``. The processes end seconds after leaving
   the loop: that is MindSpore's and msrun's own teardown.
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
import urllib.request
from pathlib import Path

from tests.bench import ab
from tests.helpers.app import AUTH, TOKEN
from tests.helpers.jobs import DEMO_BATCH, DemoJob
from tests.helpers.liveserver import start_dashboard


def callback_sides(args, size: str, rank: int) -> dict:
    """``Model.train`` with a step timer, and with the bridge's variants before it, at ``size``."""
    from mindspore import nn
    from mindspore.train import Callback, Model

    from trainer_bridge import GracefulExitBridge

    steps, warmup = ab.plan(args, size)
    batch = ab.SIZES[size]["batch"]
    net, inputs, labels = ab.size_model(size, batch, steps, rank)
    dataset = ab.dataset_of(inputs, labels, batch)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    model = Model(net, loss_fn, nn.Momentum(net.trainable_params(), 0.01, 0.9))

    class StepTimer(Callback):
        """The trivial callback both sides run: it times each step's end."""

        side: ab.Side

        def on_train_step_end(self, run_context):
            self.side.step_ended()

    timer = StepTimer()

    def plain(_round):
        timer.side = ab.Side(warmup)
        model.train(1, dataset, callbacks=[timer], dataset_sink_mode=False)
        return timer.side.done()

    def with_bridge(name):
        def run(i):
            switched_off, kwargs = ab.variant(name)
            with switched_off:
                bridge = GracefulExitBridge(Path(args.run_dir) / f"{size}-{name}-{i}", resume=False, **kwargs)
                timer.side = ab.Side(warmup, bridge)
                model.train(1, dataset, callbacks=[bridge, timer], dataset_sink_mode=False)
                return timer.side.done()

        return run

    plain(-1)  # compile the step
    return {ab.BASELINE: plain, **{name: with_bridge(name) for name in args.variants}}


def worker(args) -> None:
    ab.run_worker(args, callback_sides)


HOOK_COST_SCRIPT = r'''
import json, os, sys, time
import numpy as np, mindspore as ms, mindspore.dataset as ds
from mindspore import nn
from mindspore.train import Callback, Model, OnRequestExit
from trainer_bridge import GracefulExitBridge
from trainer_bridge.rundir.runfiles import flag_path, write_flag

run_dir, which, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
write_flag(run_dir, False)

class Timed(Callback):
    """Times the wrapped callback's per-step hooks from inside a real training run."""
    def __init__(self, inner):
        super().__init__(); self.inner = inner; self.total = 0.0; self.steps = 0
    def __getattribute__(self, name):
        if name in ("on_train_begin", "on_train_end", "on_train_epoch_begin", "on_train_epoch_end"):
            return getattr(object.__getattribute__(self, "inner"), name)
        return object.__getattribute__(self, name)
    def on_train_step_begin(self, rc):
        t = time.perf_counter(); self.inner.on_train_step_begin(rc); self.total += time.perf_counter() - t
    def on_train_step_end(self, rc):
        t = time.perf_counter(); self.inner.on_train_step_end(rc); self.total += time.perf_counter() - t
        self.steps += 1

class Src:
    def __getitem__(self, i): return np.ones((16,), np.float32), np.array(i % 2, np.int32)
    def __len__(self): return steps
data = ds.GeneratorDataset(Src(), ["x", "y"], shuffle=False).batch(1)
net = nn.SequentialCell(nn.Dense(16, 16), nn.ReLU(), nn.Dense(16, 2))
model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
              nn.Momentum(net.trainable_params(), 0.01, 0.9))
if which == "native":
    cb = OnRequestExit(save_ckpt=False, save_mindir=False, directory=run_dir, config_file=str(flag_path(run_dir)))
else:
    cb = GracefulExitBridge(run_dir)
timed = Timed(cb)
model.train(1, data, callbacks=[timed], dataset_sink_mode=False)
print(json.dumps({"per_step_us": timed.total / timed.steps * 1e6, "steps": timed.steps}))
'''


def hook_cost(steps: int, root: Path, repeats: int = 3) -> dict:
    import json

    env = {**os.environ, "MS_ENABLE_GRACEFUL_EXIT": "1", "GLOG_v": "3"}
    out = {"bridge": [], "native": []}
    for i in range(repeats):
        for which in ("bridge", "native"):
            run = root / f"hook-{which}-{i}"
            run.mkdir(parents=True)
            res = subprocess.run(
                [sys.executable, "-c", HOOK_COST_SCRIPT, str(run), which, str(steps)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            out[which].append(json.loads(res.stdout.strip().splitlines()[-1])["per_step_us"])
    bridge, native = min(out["bridge"]), min(out["native"])
    return {"bridge_us": bridge, "native_us": native, "ratio": bridge / native}


def _post_stop(url: str) -> None:
    req = urllib.request.Request(
        url + "/api/exit",
        data=json.dumps({"reason": "benchmark"}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **AUTH},
    )
    with urllib.request.urlopen(req) as r:
        assert r.status == 202


def stop_latency(stops: int, samples: int, root: Path) -> dict:
    rows = []
    for i in range(stops):
        job = DemoJob(root / f"stop-{i}", epochs=50, samples=samples, batch=DEMO_BATCH).start()
        server = start_dashboard(
            job.run_dir, root / f"stop-{i}-dashboard.log", env={"RANKWATCH_TOKEN": TOKEN}
        )
        try:
            job.wait_for_step(8)
            t0 = time.time()
            _post_stop(server.url)
            code = job.wait()
            t_exit = time.time()
            with urllib.request.urlopen(server.url + "/api/exit") as r:
                t_flag = json.load(r)["request"]["requested_at"]  # just before the flag write
        finally:
            job.kill()
            server.stop()
        if code != 0:
            raise SystemExit(f"stop {i} failed ({code}):\n{job.logs()}")
        hbs = job.heartbeats()
        at = [h["stop"]["at"] for h in hbs]
        step_s = max(h["step_time_mean_ms"] or h["step_time_ms"] or 0 for h in hbs) / 1e3
        save_s = max(h["stop"]["checkpoint"]["seconds"] for h in hbs)
        rows.append(
            {
                "total": t_exit - t0,
                "from_flag": t_exit - t_flag,
                "seen": min(a.get("seen", float("inf")) for a in at) - t0,
                "agreed": max(a["agreed"] for a in at) - t0,
                "saved": max(a["saved"] for a in at) - t0,
                "exited": max(a["exited"] for a in at) - t0,
                "target": 1.0 + step_s + save_s,
            }
        )
        r = rows[-1]
        print(
            f"  stop {i + 1}: seen {r['seen']:.2f} s, agreed {r['agreed']:.2f} s, saved {r['saved']:.2f} s, "
            f"left loop {r['exited']:.2f} s, processes gone {r['total']:.2f} s after the POST, "
            f"{r['from_flag']:.2f} s after the flag write "
            f"(target {r['target']:.2f} s)",
            flush=True,
        )
    return {k: _median_p95([r[k] for r in rows]) for k in rows[0]}


def _median_p95(values: list[float]) -> tuple[float, float]:
    values = sorted(values)
    p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
    return statistics.median(values), p95


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab.add_arguments(p)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["bridge"],
        choices=list(ab.VARIANTS),
        help="figure 1: bridge sides against Model.train without it (default: bridge)",
    )
    p.add_argument("--figures", nargs="+", type=int, choices=[1, 2, 3], default=[1, 2, 3], help="default all")
    p.add_argument("--stops", type=int, default=5, help="stops timed (default 5)")
    p.add_argument("--samples", type=int, default=4000, help="synthetic samples per stop job (default 4000)")
    p.add_argument("--hook-steps", type=int, default=2000, help="steps in the hook-cost runs")
    args = ab.parse(p, argv)
    if args.as_worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-bridge-") as tmp:
        root = Path(tmp)
        if 1 in args.figures:
            args.run_dir = str(root / "ab")
            result, load = ab.launch(Path(__file__).resolve(), args, ["--variants", *args.variants])
            ab.print_report(
                "1. throughput, Model.train with the bridge's callback / without it, " + ab.where(args),
                args,
                result,
                load,
            )
        if 2 in args.figures:
            print("2. per-step hook cost, single process (bridge vs native OnRequestExit):", flush=True)
            hc = hook_cost(args.hook_steps, root)
            print(f"{'hook cost per step, bridge / native OnRequestExit':<52}{hc['ratio']:>12.4f}  <= 1.0")
            print(f"{'  per step, bridge / native (us)':<52}{hc['bridge_us']:>6.1f}/{hc['native_us']:<5.1f}")
        if 3 in args.figures:
            print("3. stop latency, 2-rank demo, flag write -> every rank exited:", flush=True)
            sl = stop_latency(args.stops, args.samples, root)
            for key in ("seen", "agreed", "saved", "exited", "target", "total", "from_flag"):
                med, p95 = sl[key]
                label = {
                    "exited": "stop latency, POST -> every rank saved, left loop (s)",
                    "target": "  target 1 s + step + save (s)",
                    "seen": "  first rank saw the flag (s)",
                    "total": "POST -> all processes gone (s)",
                    "from_flag": "flag write -> all processes gone (s)",
                }.get(key, f"  every rank {key} (s)")
                print(f"{label:<52}{med:>6.2f} med {p95:>5.2f} p95")


if __name__ == "__main__":
    main()
