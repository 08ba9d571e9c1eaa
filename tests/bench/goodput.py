"""Goodput under injected faults (issue 31, section 5): ``python -m tests.bench.goodput [--quick]``.

Runs by hand, never in CI. The same 2-rank demo job (CPU, LeNet5, periodic
sets every ``--ckpt-every`` steps) runs three ways, one after the other:

1. ``plain``: plain ``msrun`` (``--join True``), relaunched by the benchmark
   itself as soon as msrun has exited after a failure, as a person at the
   terminal would at once, pinned to the newest complete and healthy set
   (``RANKWATCH_RESUME_STEP``, the set ``rankwatch launch`` would pick);
2. ``launch``: ``rankwatch launch`` without the dying gasp (``--gasp-s 0``);
3. ``launch+gasp``: ``rankwatch launch`` with it.

The faults follow one seeded schedule for all three: ``kill -9`` of a
random rank a random time after the current attempt's first step, and one
hang (``SIGSTOP`` of a random rank). Under ``rankwatch launch`` the hang
rule ends a hang (``--hang-restart-s 10 --hang-mode restart``); plain msrun
has none, so its survivor fails at MindSpore's own collective timeout.

Reported per way: the goodput (the kept steps' wall time, from the engine the
dashboard uses, ``app.run.goodput``, over the wall time from the first
spawn to the job's end on the benchmark's clock, the same for all three),
the steps lost per fault, the time from each fault to the next attempt's first
step in its parts, and the processes of the run left behind at the end. The
part from relaunch to the first step is MindSpore's own start (msrun,
building the cluster, compiling), measured on its own.

``--quick``: one kill and the hang on a shorter job (about 10 minutes in
all on 2 cores). The full run: a kill every 2 to 4 minutes over 20 minutes
of training, plus the hang, then ``TAIL_S`` of training and a graceful stop
(about 85 minutes in all).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from app import attempts as app_attempts
from app.compose import build
from app.config import from_env
from app.supervise import policy, procs
from tests.helpers.jobs import DEMO_DATA
from tests.helpers.launch import LaunchJob
from trainer_bridge.demo.__main__ import free_port
from trainer_bridge.rundir import attempts, runfiles

HANG_S = 10.0
# The full run: the job is stopped gracefully (the flag) this long after the last fault's next first step,
# so that each way's training ends where its faults do, not 12,400 steps later.
TAIL_S = 60.0
LLAMA3_MTBF_S = 3 * 3600.0  # Llama 3: 419 interruptions in 54 days, about one every 3 hours


def schedule(seed: int, quick: bool) -> list[tuple[str, int, float]]:
    """(kind, rank, seconds after the attempt's first step) of each fault, the hang last."""
    rng = random.Random(seed)
    if quick:
        kills = [("kill", rng.randrange(2), rng.uniform(12, 20))]
    else:
        kills, total = [], 0.0
        while total < 20 * 60:
            gap = rng.uniform(120, 240)
            kills.append(("kill", rng.randrange(2), gap))
            total += gap
    return [*kills, ("hang", rng.randrange(2), rng.uniform(12, 20))]


def run_processes(job: LaunchJob) -> int:
    """Live processes of the run: marked by the supervisor, or naming the run directory."""
    n = {p.pid for p in job.marked()}
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(str(job.run_dir) in a for a in p.info["cmdline"] or ()):
                n.add(p.pid)
        except psutil.Error:
            continue
    return len(n - {os.getpid()})


def first_step_at(job: LaunchJob, after: float, timeout: float = 600.0) -> float:
    """When a rank of an attempt started after ``after`` first reported a step (its heartbeat's time)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for rank in (0, 1):
            hb = job.heartbeat(rank) or {}
            if (hb.get("started_at") or 0) > after and hb.get("last_step_at"):
                return hb["last_step_at"]
        time.sleep(0.05)
    raise TimeoutError(f"no first step after {after}\n{job.output()[-3000:]}")


def inject(job: LaunchJob, kind: str, rank: int) -> tuple[float, int]:
    proc = job.wait_until(lambda: job.workers().get(rank), f"rank {rank}'s worker")
    proc.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    return time.time(), proc.pid


class Plain:
    """msrun alone, relaunched by the benchmark after each exit that was not the job's end."""

    def __init__(self, job: LaunchJob):
        self.job = job
        self.argv = job.cmd[job.cmd.index("--") + 1 :]
        self.env = {**job.env, procs.MARK_ENV: procs.run_mark(str(job.run_dir))}
        self.proc: subprocess.Popen | None = None
        self.spawned: list[float] = []

    def spawn(self) -> None:
        argv = [re.sub(r"^--master_port=\d+$", f"--master_port={free_port()}", a) for a in self.argv]
        if self.spawned:
            # The person picks the newest complete, healthy set (as `rankwatch checkpoints` lists it) and
            # pins it: the bridge resumes by itself only from its own sets, not MindSpore's periodic ones.
            choice = policy.choose_resume(str(self.job.run_dir), self.job.ranks)
            self.env.pop(runfiles.RESUME_STEP_ENV, None)
            if choice.global_step is not None:
                self.env[runfiles.RESUME_STEP_ENV] = str(choice.global_step)
        self.spawned.append(time.time())
        out = open(self.job.output_path, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def run_way(name: str, base: Path, plan, train: list[str], quick: bool) -> dict:
    run_dir = base / name
    launch_args = ["--backoff-s", "0", "--grace-s", "5", "--max-restarts", "20", "--no-progress", "20"]
    launch_args += ["--hang-restart-s", str(HANG_S), "--hang-mode", "restart"]
    if name == "launch":
        launch_args += ["--gasp-s", "0"]
    job = LaunchJob(run_dir, train, launch_args, **DEMO_DATA)  # the demo's batch, as documented
    plain = Plain(job) if name == "plain" else None
    t0 = time.time()
    if plain:
        plain.spawn()
        job.proc = plain.proc
    else:
        job.start()
    faults = []
    attempt_start = t0
    for kind, rank, after in plan:
        first = first_step_at(job, attempt_start)
        # Wait ``after`` seconds of training (the wait is the schedule, not a guard).
        while time.time() < first + after:
            time.sleep(0.1)
        at, pid = inject(job, kind, rank)
        fault = {"kind": kind, "rank": rank, "at": at, "pid": pid}
        if plain:
            plain.proc.wait()
            fault["detected_at"] = fault["ended_at"] = time.time()  # msrun's exit is what a person sees
            fault["left_at_end"] = run_processes(job)
            for p in job.marked():  # a person kills what msrun left, then relaunches
                p.kill()
            plain.spawn()
            job.proc = plain.proc
            fault["relaunched_at"] = plain.spawned[-1]
        attempt_start = fault["at"]
        fault["first_step_at"] = first_step_at(job, attempt_start)
        faults.append(fault)
    if not quick:
        while time.time() < faults[-1]["first_step_at"] + TAIL_S:
            time.sleep(0.1)
        runfiles.write_flag(
            run_dir, True, request_id="bench-end", requested_at=time.time(), reason="bench end"
        )
    code = job.proc.wait()
    t_end = time.time()
    time.sleep(2.0)
    left = run_processes(job)
    rows = attempts.fold(attempts.read_lines(run_dir)[0])
    if not plain:
        for fault, row in zip(faults, rows, strict=False):
            sup = row.get("supervisor") or {}
            fault.update({k: sup.get(k) for k in ("detected_at", "ended_at", "relaunched_at")})
    for fault, row, nxt in zip(faults, rows, rows[1:], strict=False):
        fault["bridge_at"] = nxt["started_at"]
        # The steps the attempt the fault ended had trained that the next one trained again.
        fault["steps_lost"] = max(0, (row["last_step"] or 0) - (nxt["first_step"] - 1))
    state = build(str(run_dir), {**from_env(), "RUN_DIR": str(run_dir)}, live=False).state
    state.scan(time.time())
    beats, _ = state.heartbeats()
    g = state.goodput(app_attempts.answer(state.run_dir, beats, state.job_ended())["attempts"], time.time())
    wall = t_end - t0
    return {
        "way": name,
        "exit": code,
        "wall_s": wall,
        "kept_s": g["kept_s"],
        "goodput": (g["kept_s"] or 0.0) / wall,
        "steps_lost": g["steps_lost"],
        "kept_steps": g["kept_steps"],
        "faults": faults,
        # Processes of the run alive once it was over (plain msrun: also once msrun had exited after a fault).
        "left": max([left, *(f.get("left_at_end", 0) for f in faults)]),
        "attempts": len(rows),
    }


def parts(fault: dict) -> dict:
    def gap(a, b):
        x, y = fault.get(a), fault.get(b)
        return y - x if x is not None and y is not None else math.nan

    return {
        "detect": gap("at", "detected_at"),
        "end": gap("detected_at", "ended_at"),
        "relaunch": gap("ended_at", "relaunched_at"),
        "ms_start": gap("relaunched_at", "first_step_at"),
        "total": gap("at", "first_step_at"),
    }


def table(results: list[dict]) -> str:
    head = (
        "| way | goodput | steps lost / fault | fault → detected | → ended | → relaunched | "
        "→ first step (MindSpore's start) | fault → first step | processes left | goodput at 1 fault / 3 h |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in results:
        n = len(r["faults"])
        ps = [parts(f) for f in r["faults"]]

        def mean(k, ps=ps):
            vals = [p[k] for p in ps if not math.isnan(p[k])]
            return sum(vals) / len(vals) if vals else math.nan

        lost = r["steps_lost"] / n if n else 0.0
        step_s = r["kept_s"] / r["kept_steps"] if r["kept_steps"] else math.nan
        per_fault = mean("total") + lost * step_s
        llama = 1 - per_fault / LLAMA3_MTBF_S
        lines.append(
            f"| {r['way']} | {r['goodput']:.1%} | {lost:.1f} | {mean('detect'):.1f} s | {mean('end'):.1f} s | "
            f"{mean('relaunch'):.1f} s | {mean('ms_start'):.1f} s | {mean('total'):.1f} s | {r['left']} | "
            f"{llama:.3%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.goodput", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="one kill and the hang, a shorter job")
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--ways", default="plain,launch,launch+gasp")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    plan = schedule(args.seed, args.quick)
    # 2,000 samples, 2 ranks, batch 32: 31 steps an epoch; long enough for every fault of the plan.
    epochs = 8 if args.quick else 400
    train = ["--epochs", str(epochs), "--step-delay", "0.05", "--ckpt-every", "10"]
    print(f"goodput benchmark: plan {plan} (seed {args.seed}), {epochs} epochs of 31 steps", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="rankwatch-goodput-") as tmp:
        for way in args.ways.split(","):
            r = run_way(way, Path(tmp), plan, train, args.quick)
            print(json.dumps({k: v for k, v in r.items() if k != "faults"}), flush=True)
            results.append(r)
    print(table(results))
    for r in results:
        lost = ", ".join(f"{f['kind']} {f.get('steps_lost', '?')}" for f in r["faults"])
        print(f"steps lost by fault, {r['way']}: {lost}")
    step = next((r["kept_s"] / r["kept_steps"] for r in results if r["kept_steps"]), math.nan)
    print(
        "\nAt Llama 3's rate (one interruption every 3 h = 10,800 s), a way's goodput from faults alone is "
        "1 - (fault → first step + steps lost per fault x step time) / 10,800 s; "
        f"the measured step time is {step:.3f} s."
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
