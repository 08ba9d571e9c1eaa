"""The A/B harness both overhead benchmarks share (``tests.bench.loop``, ``tests.bench.bridge``).

One method, so the functional loop and the ``Model.train`` callback are
measured alike:

* **Several msrun jobs.** Every rank runs all sides in turn, in rounds; within a
  round the order is shuffled by a seeded RNG that every rank seeds alike,
  so the ranks always run the same side at the same time (their collectives
  pair up) and drift hits every side alike. Each job has its own seed, and
  the interval resamples jobs before rounds (see ``DEFAULT_JOBS``).
* **A quiet process.** Before MindSpore is imported each rank binds itself
  to one core of its own (``os.sched_setaffinity``: the threads MindSpore
  starts later inherit it), and MindSpore's CPU kernel and dispatch pools
  are set to ``--threads`` threads (``OMP_NUM_THREADS`` too). Two ranks
  with MindSpore's default pools (25 kernel threads each) oversubscribe two
  cores; the sides then differ by tens of percent for reasons that have
  nothing to do with the bridge. The state is read back from
  ``/proc/self/task`` and printed.
* **Warm-up outside the timed steps.** A first untimed side compiles the
  step; each side then leaves out its first ``warmup`` steps, which hold
  what a fresh bridge does once per process in real use: its first
  agreement compiles its AllReduce, and its reporter hands its work from
  its thread to the agreements within about two of them (``handover.py``;
  each side records whether that thread still ran when the timing began).
* **Step periods, end to end.** A side's time is the sum of its step
  periods (one step end to the next: the step, the data, the bridge's
  hooks); the side's process CPU time is kept beside it.

The report, per side against the baseline: the pooled throughput ratio
(baseline time / side time over all rounds) with a 95% bootstrap interval
over jobs, then rounds (numpy, seeded), the median and range of the per-round ratios,
and the bridge's own accounted share of the side's time (agreements and
the reporter thread's CPU time). A claim of >= 0.99 needs the interval's
lower end at or above 0.98.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULT = "AB-BENCH "
BASELINE = "plain"
TARGET, FLOOR = 0.99, 0.98
QUICK_ROUNDS = 4
MIN_ROUNDS = 8
# Jobs: a side's ratio shifts by up to about 2% from one msrun job to the
# next (the same bridge variant measured 0.96 in one job and 1.01 in
# another, each job's own interval +-0.5%), so a verdict needs several jobs
# and an interval that resamples them.
DEFAULT_JOBS = 4
MIN_JOBS = 3

# Step sizes: LeNet5 (as in the demo), and a tiny dense net whose steps take
# a few ms, where a per-step cost shows most. Per size: steps per side and
# steps left out of each side (decisive, --quick).
SIZES = {
    "lenet": {"batch": 32, "steps": 240, "warmup": 60, "quick": (100, 50)},
    "tiny": {"batch": 16, "steps": 2400, "warmup": 400, "quick": (700, 300)},
}


def add_arguments(p, *, rounds: int = 10) -> None:
    """The command-line options both benchmarks take."""
    p.add_argument("--ranks", type=int, default=2, help="msrun workers (default 2)")
    p.add_argument(
        "--pairs",
        type=int,
        help=f"rounds of all sides in each job (default {rounds}, {QUICK_ROUNDS} with --quick)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        help=f"msrun jobs, each with its own side order (default {DEFAULT_JOBS}, 1 with --quick)",
    )
    p.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["lenet", "tiny"], help="step sizes")
    p.add_argument(
        "--threads", type=int, default=1, help="MindSpore's CPU kernel and dispatch threads (default 1)"
    )
    p.add_argument(
        "--no-bind", action="store_true", help="leave the ranks unbound (to see what binding buys)"
    )
    p.add_argument(
        "--quick", action="store_true", help="4 rounds of short sides: checks the harness, decides nothing"
    )
    p.add_argument("--seed", type=int, default=1, help="side order and bootstrap seed")
    p.add_argument("--save", metavar="FILE", help="also write the raw rounds and the summary as JSON")
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--as-worker", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(default_rounds=rounds)


def parse(p, argv=None):
    """Parse, then fill the rounds from the profile."""
    args = p.parse_args(argv)
    if args.pairs is None:
        args.pairs = QUICK_ROUNDS if args.quick else args.default_rounds
    if args.jobs is None:
        args.jobs = 1 if args.quick else DEFAULT_JOBS
    return args


def plan(args, size: str) -> tuple[int, int]:
    """(steps per side, steps left out) for ``size``."""
    spec = SIZES[size]
    return spec["quick"] if args.quick else (spec["steps"], spec["warmup"])


# ------------------------------------------------------------------ worker side


def bind_worker(args) -> None:
    """Bind this rank to one core and bound MindSpore's threads: call before importing mindspore."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    if args.no_bind:
        return
    cpus = sorted(os.sched_getaffinity(0))
    local = int(os.environ.get("DEVICE_ID", "0") or 0)  # msrun: the local rank
    os.sched_setaffinity(0, {cpus[local % len(cpus)]})


def configure_mindspore(args) -> None:
    """MindSpore's CPU kernel pool and dispatch pool, ``--threads`` each (both default to more)."""
    import mindspore as ms

    ms.device_context.cpu.op_tuning.threads_num(args.threads)
    ms.runtime.dispatch_threads_num(args.threads)


def machine_state() -> dict:
    """What this process really runs with: its threads and the cores they may use."""
    cores = set()
    threads = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue
        threads += 1
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cores.add(line.split(":", 1)[1].strip())
    return {"threads": threads, "cores": sorted(cores), "online": os.cpu_count()}


def size_model(size: str, batch: int, steps: int, rank: int):
    """(network, inputs, labels) for ``size``: in-memory data, ``steps`` batches of ``batch``."""
    import numpy as np
    from mindspore import nn

    rng = np.random.default_rng(rank)
    n = steps * batch
    labels = rng.integers(0, 10, n).astype(np.int32)
    if size == "lenet":
        from trainer_bridge.demo.train import LeNet5

        return LeNet5(), rng.random((n, 1, 32, 32), dtype=np.float32), labels
    net = nn.SequentialCell(nn.Dense(32, 32), nn.ReLU(), nn.Dense(32, 10))
    return net, rng.random((n, 32), dtype=np.float32), labels


def dataset_of(inputs, labels, batch: int):
    import mindspore.dataset as ds
    import numpy as np

    class Source:  # numpy 2: return arrays, not numpy scalars (seeds/README.md)
        def __getitem__(self, i):
            return inputs[i], np.array(labels[i], np.int32)

        def __len__(self):
            return len(labels)

    return ds.GeneratorDataset(Source(), ["x", "y"], shuffle=False).batch(batch)


def bridge_cost(bridge) -> tuple[int, float, float]:
    """The bridge's own accounting so far (its heartbeat's ``bridge_cost``)."""
    engine = bridge._engine
    c = engine.counters
    return c.agreements, c.agree_ms, engine.reporter.reporter_cpu_ms


class Side:
    """One side's timing: call ``step_ended()`` at each step end, ``done()`` after the last.

    ``bridge`` (optional) is read once the warm-up is over and at the end,
    for what its own accounting says it spent over the timed steps.
    """

    def __init__(self, warmup: int, bridge=None):
        self.warmup = warmup
        self.bridge = bridge
        self.ends: list[float] = []
        self._cpu = 0.0
        self._spent = None
        self._thread = None

    def step_ended(self) -> None:
        self.ends.append(time.perf_counter())
        if len(self.ends) == self.warmup + 1:
            self._cpu = time.process_time()
            if self.bridge is not None:
                self._spent = bridge_cost(self.bridge)
                self._thread = self.bridge._engine.reporter.handover.thread is not None

    def done(self) -> dict:
        cpu = time.process_time() - self._cpu
        ends = self.ends[self.warmup :]
        periods = [b - a for a, b in zip(ends, ends[1:], strict=False)]
        out = {"s": sum(periods), "steps": len(periods), "median_ms": statistics.median(periods) * 1e3}
        out["cpu_s"] = cpu
        if self.bridge is not None and self._spent is not None:
            after = bridge_cost(self.bridge)
            names = ("agreements", "agree_ms", "reporter_cpu_ms")
            out["cost"] = {k: b - a for k, a, b in zip(names, self._spent, after, strict=True)}
            out["reporter_thread_at_start"] = self._thread  # False once handed over (reporter.py)
        return out


# Attribution (--variants): the bridge with one part switched off, each a
# side of its own against the same baseline. Patched for the side only.
VARIANTS = {
    "bridge": "the bridge as shipped",
    "no-reporter": "no reporter thread (heartbeats only at begin and end: no flag, stacks, psutil)",
    "no-poll": "the reporter without its file polls (flag, stack requests)",
    "no-psutil": "the reporter without psutil's CPU and RSS sample",
    "no-loss": "the loss never converted (report(loss=) / net_outputs ignored)",
    "no-agree": "one agreement only, in the warm-up (sync interval 1e5 s)",
    "hooks-only": "only the step hooks: no reporter thread, no loss, one agreement",
    "no-step-begin": "the callback without on_train_step_begin (the callback only)",
    "nice-reporter": "the reporter thread at nice 10 (it then rarely preempts the training thread on a busy core)",
    "poll-1s": "the reporter wakes once a second (flag and stack polls at the heartbeat's rate)",
    "beat-5s": "a heartbeat every 5 s (polls unchanged)",
    "no-history": "heartbeats without their history line",
    "reporter-core": "the reporter thread moved to a core the rank is not bound to (with --ranks 1, a free one)",
    "idle-thread": "no reporter thread, but a Python thread of the bridge's that only sleeps (Event.wait, 1 s)",
    "parked-thread": "no reporter thread, but a Python thread of the bridge's blocked until the close (no wake-up)",
    "thread-always": "the reporter's work on its thread all the time, never handed to the agreements (the design before)",
}


def variant(name: str):
    """(a context manager that switches the part off, extra ``GracefulExitBridge`` arguments)."""
    import contextlib
    from unittest import mock

    from trainer_bridge.beatsink import BeatSink
    from trainer_bridge.bridge import GracefulExitBridge
    from trainer_bridge.handover import HandOver
    from trainer_bridge.procstats import ProcessStats
    from trainer_bridge.reporter import Reporter

    def no_loss(self, outputs):
        self.loss_due = float("inf")

    run = HandOver.run

    def nice_run(self):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        run(self)

    def own_core_run(self):
        mine = os.sched_getaffinity(0)
        free = sorted(set(range(os.cpu_count() or 1)) - mine)
        if free:
            os.sched_setaffinity(0, {free[-1]})  # this thread only (Linux affinity is per task)
        run(self)

    def idle_run(self):
        while not self.work.closed.wait(1.0):
            pass

    patches = {
        "thread-always": [("may_hand_over", HandOver, lambda self, now: False)],
        "idle-thread": [("run", HandOver, idle_run)],
        "parked-thread": [("run", HandOver, lambda self: self.work.closed.wait())],
        "nice-reporter": [("run", HandOver, nice_run)],
        "reporter-core": [("run", HandOver, own_core_run)],
        "no-reporter": [("run", HandOver, lambda self: None)],
        "no-poll": [("_poll_flag", Reporter, lambda self, force=False: None)],
        "no-psutil": [("sample", ProcessStats, lambda self: (None, None, None))],
        "no-loss": [("take_loss", Reporter, no_loss)],
        "hooks-only": [("run", HandOver, lambda self: None), ("take_loss", Reporter, no_loss)],
        "no-step-begin": [("on_train_step_begin", GracefulExitBridge, lambda self, rc: None)],
        "no-history": [("append_history", BeatSink, lambda self, beat: None)],
    }.get(name, [])
    stack = contextlib.ExitStack()
    for attr, owner, value in patches:
        stack.enter_context(mock.patch.object(owner, attr, value))
    quiet = {"sync_interval_s": 1e5, "max_sync_every": 10**6}  # within the heartbeat schema's bounds
    kwargs = {
        "no-agree": quiet,
        "hooks-only": quiet,
        "poll-1s": {"poll_interval_s": 1.0},
        "beat-5s": {"heartbeat_interval_s": 5.0},
    }.get(name, {})
    return stack, kwargs


def alternate(rounds: int, seed: int, sides: dict[str, Callable[[int], dict]]) -> list[dict]:
    """Run every side once per round, in an order shuffled alike on every rank."""
    order = random.Random(seed)
    results = []
    for i in range(rounds):
        names = list(sides)
        order.shuffle(names)
        results.append({"order": names, **{name: sides[name](i) for name in names}})
    return results


def run_worker(args, make_sides: Callable) -> None:
    """One rank: bind, set MindSpore up, run every size's rounds; rank 0 prints the result line.

    ``make_sides(args, size, rank)`` returns the sides, baseline first, the step compiled.
    With ``--ranks 1`` there is no msrun and no collective: a single-process
    run whose process CPU time attributes a cost on a loaded machine.
    """
    bind_worker(args)
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    configure_mindspore(args)
    rank = 0
    if args.ranks > 1:
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank = get_rank()
        ms.set_auto_parallel_context(
            parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=get_group_size()
        )
    ms.set_seed(1)
    out = {
        "sizes": {size: alternate(args.pairs, args.seed, make_sides(args, size, rank)) for size in args.sizes}
    }
    out["state"] = machine_state()
    if rank == 0:
        print(RESULT + json.dumps(out), flush=True)


# ------------------------------------------------------------------ launcher side


def launch(script: Path, args, worker_argv: list[str]) -> tuple[dict, dict]:
    """Run ``args.jobs`` jobs of ``script``, seeds ``args.seed``, +1, ...; their rounds tagged with ``job``.

    Returns the rounds of every job per size, rank 0's machine state in the
    first job, and the load average at the start of the first and the end of the last.
    """
    merged: dict = {"sizes": {}}
    load: dict = {}
    for job in range(args.jobs):
        one, job_load = launch_one(script, args, worker_argv, seed=args.seed + job, name=f"job{job}")
        for size, rounds in one["sizes"].items():
            merged["sizes"].setdefault(size, []).extend({**r, "job": job} for r in rounds)
        merged.setdefault("state", one["state"])
        load = {
            "start": load.get("start", job_load["start"]),
            "end": job_load["end"],
            "seconds": load.get("seconds", 0.0) + job_load["seconds"],
        }
    return merged, load


def launch_one(script: Path, args, worker_argv: list[str], *, seed: int, name: str) -> tuple[dict, dict]:
    """Run ``script --as-worker`` under msrun (alone with ``--ranks 1``); return rank 0's result and the load."""
    from trainer_bridge.demo.__main__ import free_port, job_env

    run_dir = Path(args.run_dir) / name
    (run_dir / "msrun_logs").mkdir(parents=True, exist_ok=True)
    env = job_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    common = ["--run-dir", str(run_dir), "--pairs", str(args.pairs), "--threads", str(args.threads)]
    common += ["--seed", str(seed), "--sizes", *args.sizes]
    common += ["--quick"] * args.quick + ["--no-bind"] * args.no_bind
    worker_log = run_dir / "msrun_logs" / "worker_0.log"
    script_argv = [str(script), "--as-worker", "--ranks", str(args.ranks), *common, *worker_argv]
    msrun = [
        "-m",
        "mindspore.parallel.cluster.run",
        f"--worker_num={args.ranks}",
        f"--local_worker_num={args.ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        "--join=True",
        f"--log_dir={run_dir / 'msrun_logs'}",
    ]
    cmd = [sys.executable, *(msrun if args.ranks > 1 else []), *script_argv]
    load = {"start": os.getloadavg()[0], "started": time.monotonic()}
    with open(run_dir / "launcher.log" if args.ranks > 1 else worker_log, "wb") as out:
        code = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    load.update(end=os.getloadavg()[0], seconds=time.monotonic() - load.pop("started"))
    log = worker_log.read_text(errors="replace") if worker_log.exists() else ""
    line = next((ln for ln in log.splitlines() if ln.startswith(RESULT)), None)
    if code != 0 or line is None:
        kept = Path(tempfile.mkdtemp(prefix="rankwatch-bench-failed-"))
        shutil.copytree(run_dir / "msrun_logs", kept / "msrun_logs")
        if (run_dir / "launcher.log").exists():
            shutil.copy(run_dir / "launcher.log", kept)
        tail = "\n".join((log or (run_dir / "launcher.log").read_text(errors="replace")).splitlines()[-30:])
        raise SystemExit(f"the benchmark job failed ({code}); its logs are in {kept}:\n{tail}")
    return json.loads(line[len(RESULT) :]), load


def summarise(rounds: list[dict], side: str, seed: int, resamples: int = 10000) -> dict:
    """``side`` against the baseline over ``rounds``: pooled ratio, bootstrap interval, pairs, jobs.

    The interval resamples at two levels, as the rounds were made: the jobs
    (each ``round["job"]``, 0 when untagged) with replacement, then each
    picked job's rounds with replacement. A shift that holds for a whole job
    then widens the interval instead of hiding in it.
    """
    import numpy as np

    base = np.array([r[BASELINE]["s"] for r in rounds])
    other = np.array([r[side]["s"] for r in rounds])
    ratios = base / other
    job_of = np.array([r.get("job", 0) for r in rounds])
    jobs = sorted(set(job_of.tolist()))
    members = [np.flatnonzero(job_of == j) for j in jobs]
    rng = np.random.default_rng(seed)
    picked_jobs = rng.integers(0, len(jobs), (resamples, len(jobs)))
    base_sum = np.zeros(resamples)
    other_sum = np.zeros(resamples)
    for k in range(len(jobs)):
        for j, idx in enumerate(members):
            rows = picked_jobs[:, k] == j
            pick = idx[rng.integers(0, len(idx), (int(rows.sum()), len(idx)))]
            base_sum[rows] += base[pick].sum(axis=1)
            other_sum[rows] += other[pick].sum(axis=1)
    boot = base_sum / other_sum
    lo, hi = np.percentile(boot, [2.5, 97.5])
    per_job = [float(base[idx].sum() / other[idx].sum()) for idx in members]
    steps = sum(r[side]["steps"] for r in rounds)
    costs = [r[side].get("cost") for r in rounds]
    share = None
    if all(costs):
        spent_ms = sum(c["agree_ms"] + c["reporter_cpu_ms"] for c in costs)
        share = spent_ms / (other.sum() * 1e3)
    return {
        "rounds": len(rounds),
        "jobs": len(jobs),
        "job_min": min(per_job),
        "job_max": max(per_job),
        "pooled": float(base.sum() / other.sum()),
        "lo": float(lo),
        "hi": float(hi),
        "median": float(np.median(ratios)),
        "min": float(ratios.min()),
        "max": float(ratios.max()),
        "ms_per_step": float(other.sum() / steps * 1e3),
        "base_ms_per_step": float(base.sum() / sum(r[BASELINE]["steps"] for r in rounds) * 1e3),
        "step_ratio": float(np.median([r[BASELINE]["median_ms"] / r[side]["median_ms"] for r in rounds])),
        "base_cpu_ms": float(sum(r[BASELINE]["cpu_s"] for r in rounds) / steps * 1e3),
        "cpu_us": float(
            (sum(r[side]["cpu_s"] for r in rounds) - sum(r[BASELINE]["cpu_s"] for r in rounds)) / steps * 1e6
        ),
        "cpu_ratio": float(sum(r[BASELINE]["cpu_s"] for r in rounds) / sum(r[side]["cpu_s"] for r in rounds)),
        "agreements": sum(c["agreements"] for c in costs) if all(costs) else None,
        "share": share,
    }


def verdict(s: dict) -> str:
    # The machine's noise is bimodal (a rank alone on its core, or sharing it):
    # a bootstrap over a few rounds is overconfident, so it decides nothing.
    if s["rounds"] < MIN_ROUNDS:
        return f"none: fewer than {MIN_ROUNDS} rounds"
    if s["jobs"] < MIN_JOBS:
        return f"none: fewer than {MIN_JOBS} jobs"
    if s["pooled"] >= TARGET and s["lo"] >= FLOOR:
        return f">= {TARGET} shown"
    if s["hi"] < TARGET:
        return f"< {TARGET} shown"
    return "undecided"


def where(args) -> str:
    return f"{args.ranks} ranks under msrun" if args.ranks > 1 else "one process (no msrun, no collective)"


def describe_state(args, state: dict, load: dict) -> str:
    bound = (
        "unbound" if args.no_bind else f"each rank bound to one core ({', '.join(state['cores'])} on rank 0)"
    )
    return (
        f"{args.jobs} msrun job(s) of {args.pairs} rounds; "
        f"machine: {state['online']} cores, {bound}, MindSpore kernel/dispatch threads {args.threads}, "
        f"{state['threads']} threads in rank 0; load average {load['start']:.2f} at start, "
        f"{load['end']:.2f} at end; {load['seconds']:.0f} s"
    )


def print_report(title: str, args, result: dict, load: dict) -> list[dict]:
    """Print one table row per (size, side) against the baseline; return the rows."""
    print(title)
    print(describe_state(args, result["state"], load))
    print(
        f"{'size':<6} {'side':<16} {'jobs':>4} {'rounds':>6} {'per job':>13} {'ms/step':>8} {'base':>7} {'cpu ms':>6} {'pooled':>7} {'95% interval':>15} "
        f"{'median':>7} {'range':>13} {'m.step':>6} {'cpu':>6} {'cpu+us':>7} {'agreed':>6} {'own share':>9}  verdict"
    )
    rows = []
    for size, rounds in result["sizes"].items():
        sides = [k for k in rounds[0] if k not in ("order", "job", BASELINE)]
        for side in sides:
            s = summarise(rounds, side, args.seed)
            share = f"{s['share'] * 100:.2f}%" if s["share"] is not None else "-"
            print(
                f"{size:<6} {side:<16} {s['jobs']:>4} {len(rounds):>6} {s['job_min']:>6.3f}-{s['job_max']:<6.3f} {s['ms_per_step']:>8.3f} {s['base_ms_per_step']:>7.3f} {s['base_cpu_ms']:>6.3f} "
                f"{s['pooled']:>7.4f} {s['lo']:>7.4f}-{s['hi']:<7.4f} {s['median']:>7.4f} "
                f"{s['min']:>6.3f}-{s['max']:<6.3f} {s['step_ratio']:>6.3f} {s['cpu_ratio']:>6.3f} {s['cpu_us']:>7.0f} {s['agreements'] or '-':>6} {share:>9}"
                f"  {verdict(s)}"
            )
            rows.append({"size": size, "side": side, **s})
    if args.save:
        raw = {"title": title, "ranks": args.ranks, "threads": args.threads, "bound": not args.no_bind}
        raw.update(seed=args.seed, jobs=args.jobs, pairs=args.pairs)
        raw.update(load=load, state=result["state"], summary=rows, rounds=result["sizes"])
        Path(args.save).write_text(json.dumps(raw, indent=1))
    print(
        "pooled: baseline time / side time over all rounds of all jobs (a throughput ratio, 1 = free); per job: the lowest and highest job's pooled ratio; "
        "cpu ms: the baseline's process CPU per step; interval: 95% "
        "bootstrap over jobs, then over each job's rounds; range: of the rounds' ratios; m.step: the median over rounds of the ratio of median step periods (what a "
        "cost on every step moves, a cost on some steps does not); cpu: the same ratio of process CPU time, cpu+us: the side's extra process CPU per step; own share: the bridge's accounted "
        f"agreements + reporter CPU, of the side's time. >= {TARGET} needs the interval's low end >= {FLOOR}."
    )
    return rows
