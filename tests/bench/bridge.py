"""Bridge benchmarks: ``python -m tests.bench.bridge [--pairs 3] [--stops 5]``.

Prints three figures, each against a baseline measured in the same run:

1. Throughput of the 2-rank demo job under msrun with the bridge / without it
   (target >= 0.99). One warm-up run is discarded (the first job after a
   while pays for cold caches), then pairs alternate their order (AB BA AB
   ...) so drift and noise hit both sides alike; the ratio is the median of
   per-pair ratios of median step times. On a shared machine that ratio
   swings by more than the effect, so the bridge runs also report what the
   bridge spent, from its own accounting (heartbeat ``bridge_cost``: time in
   agreements after the first, the reporter thread's CPU time) plus the hook
   cost from figure 2 per step, as a fraction of the training time: a bound
   on the throughput lost that noise does not move.
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
   the loop: that is MindSpore's and msrun's own teardown, which the baseline
   runs of figure 1 pay too after their last step; it is printed beside.
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

from tests.jobs import DemoJob
from tests.liveserver import start_dashboard

TOKEN = "bench-token"


def _step_times(job: DemoJob, rank: int = 0) -> list[float]:
    """The ``time.monotonic()`` each step ended at (``--step-log``; one clock for all processes)."""
    import re

    return [float(t) for t in re.findall(r"^step \d+ epoch \d+ t (\S+)", job.worker_log(rank), re.M)]


def _median_step_s(job: DemoJob, rank: int = 0, warmup: int = 5) -> float:
    times = _step_times(job, rank)
    deltas = [b - a for a, b in zip(times, times[1:], strict=False)][warmup:]
    return statistics.median(deltas)


def _overhead(job: DemoJob, step_s: float, hook_us: float) -> float:
    """The bridge's own cost as a fraction of the training time, worst rank."""
    worst = 0.0
    for hb in job.heartbeats():
        cost, steps = hb["bridge_cost"], hb["global_step"]
        spent_ms = cost["agree_ms"] + cost["reporter_cpu_ms"] + steps * hook_us / 1e3
        worst = max(worst, spent_ms / (steps * step_s * 1e3))
    return worst


def throughput(pairs: int, samples: int, root: Path, hook_us: float) -> dict:
    DemoJob(root / "tp-warmup", epochs=1, samples=samples).start().wait()
    ratios, with_s, without_s, overheads, teardowns = [], [], [], [], []
    sides = [("bridge", []), ("baseline", ["--no-bridge"])]
    for i in range(pairs):
        result = {}
        for label, extra in sides if i % 2 == 0 else sides[::-1]:
            job = DemoJob(root / f"tp-{i}-{label}", epochs=2, samples=samples, extra=extra).start()
            code = job.wait()
            if code != 0:
                raise SystemExit(f"{label} run failed ({code}):\n{job.logs()}")
            if label == "baseline":
                teardowns.append(time.monotonic() - _step_times(job)[-1])
            result[label] = _median_step_s(job)
            if label == "bridge":
                overheads.append(_overhead(job, result[label], hook_us))
        with_s.append(result["bridge"])
        without_s.append(result["baseline"])
        ratios.append(result["baseline"] / result["bridge"])  # throughput ratio
        print(
            f"  pair {i + 1}: step with bridge {result['bridge'] * 1e3:.1f} ms, "
            f"without {result['baseline'] * 1e3:.1f} ms, ratio {ratios[-1]:.4f}; "
            f"bridge's own cost {overheads[-1] * 100:.3f}% of training time",
            flush=True,
        )
    return {
        "ratio": statistics.median(ratios),
        "with_ms": statistics.median(with_s) * 1e3,
        "without_ms": statistics.median(without_s) * 1e3,
        "ratios": ratios,
        "overhead": max(overheads),
        "teardown": _median_p95(teardowns),
    }


HOOK_COST_SCRIPT = r'''
import json, os, sys, time
import numpy as np, mindspore as ms, mindspore.dataset as ds
from mindspore import nn
from mindspore.train import Callback, Model, OnRequestExit
from trainer_bridge import GracefulExitBridge
from trainer_bridge.runfiles import flag_path, write_flag

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
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req) as r:
        assert r.status == 202


def stop_latency(stops: int, samples: int, root: Path) -> dict:
    rows = []
    for i in range(stops):
        job = DemoJob(root / f"stop-{i}", epochs=50, samples=samples).start()
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
    p.add_argument("--pairs", type=int, default=3, help="throughput run pairs (default 3)")
    p.add_argument("--stops", type=int, default=5, help="stops timed (default 5)")
    p.add_argument("--samples", type=int, default=4000, help="synthetic samples per job (default 4000)")
    p.add_argument("--hook-steps", type=int, default=2000, help="steps in the hook-cost runs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-bridge-") as tmp:
        root = Path(tmp)
        print("2. per-step hook cost, single process (bridge vs native OnRequestExit):", flush=True)
        hc = hook_cost(args.hook_steps, root)
        print("1. throughput, 2-rank demo under msrun (bridge vs none):", flush=True)
        tp = throughput(args.pairs, args.samples, root, hc["bridge_us"])
        print("3. stop latency, 2-rank demo, flag write -> every rank exited:", flush=True)
        sl = stop_latency(args.stops, args.samples, root)
    print()
    print(f"{'figure':<52}{'value':>12}  target")
    print(f"{'throughput with bridge / without (median of pairs)':<52}{tp['ratio']:>12.4f}  >= 0.99")
    print(f"{'  pair ratios (noise on a shared machine)':<52}  {' '.join(f'{r:.3f}' for r in tp['ratios'])}")
    print(f"{'  1 - bridge own cost, worst rank and pair':<52}{1 - tp['overhead']:>12.4f}  >= 0.99")
    print(f"{'  median step, with / without (ms)':<52}{tp['with_ms']:>6.1f}/{tp['without_ms']:<5.1f}")
    print(f"{'hook cost per step, bridge / native OnRequestExit':<52}{hc['ratio']:>12.4f}  <= 1.0")
    print(f"{'  per step, bridge / native (us)':<52}{hc['bridge_us']:>6.1f}/{hc['native_us']:<5.1f}")
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
    med, p95 = tp["teardown"]
    print(f"{'  teardown, last step -> msrun gone, no bridge (s)':<52}{med:>6.2f} med {p95:>5.2f} p95")


if __name__ == "__main__":
    main()
