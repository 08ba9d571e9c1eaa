"""Incidents benchmark: the watcher tick at 1,024 stalled ranks, alert delivery, stack capture latency.

``.venv/bin/python -m tests.bench.incidents [--ranks 1024] [--ticks 40] [--skip-capture]``

* **tick**: 1,024 ranks in the bridge's heartbeat format
  (``tests/helpers/heartbeats.py``), first healthy, then all hung together (they
  keep writing heartbeats but finish no step, as ranks blocked in one
  AllReduce do). Two watchers read the same files tick for tick: the
  baseline without the incident step, and one with alerts (to a real
  receiver on a loopback port) and the policy in dry run. Between ticks
  half the heartbeats are rewritten, as a 2 Hz tick sees 1 Hz heartbeats.
  It prints each one's median and p95 tick (wall and CPU) per phase, the
  ratio, the cores at ``TICK_S`` = 0.5, and the alerts the receiver got
  (one summary is the target).
* **live**: the same stall for real: ``tests.bench.simulate --hang-after``
  writer processes, ``python -m app`` with a webhook to the receiver; the
  dashboard process's CPU while healthy and while all ranks are stalled
  (psutil, as ``tests.bench.scale``), and the alerts received.
* **alerts**: 50 alerts through ``WebhookSender`` to the receiver: latency
  from ``send`` to arrival.
* **capture**: a real 2-rank demo job; 10 requests for a stack through the
  API, without and with native frames; latency from the POST to the
  capture being readable. And py-spy on a stopped local process (the
  dashboard's fallback).

The scale target (README, "Scale benchmark") is at most 0.5 core for the
dashboard at 1,024 ranks; a tick is budgeted against it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from app import create_app
from tests.bench.scale import percentile
from tests.helpers.app import AUTH, TOKEN
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.incidents import HANGER
from tests.helpers.jobs import DEMO_DATA, DemoJob
from tests.helpers.receiver import Receiver
from trainer_bridge.rundir import pyspy

TICK_S = 0.5


def settings(run_dir: Path, **extra) -> dict:
    return {"RUN_DIR": str(run_dir), "TESTING": True, "TOKEN": TOKEN, "TICK_S": TICK_S, **extra}


def timed_tick(watcher) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.thread_time()
    watcher.tick()
    return (time.perf_counter() - wall) * 1e3, (time.thread_time() - cpu) * 1e3


def bench_tick(ranks: int, ticks: int, workdir: Path) -> dict:
    run_dir = workdir / "tick"
    write_job(run_dir, ranks)
    t0 = time.time() - 60.0
    for r in range(ranks):
        write_heartbeat(run_dir, heartbeat(r, ranks, now=t0, global_step=100), history=False)
    with Receiver() as receiver:
        base = create_app(settings(run_dir))
        base.extensions["rankwatch"].watcher.incidents = None
        full = create_app(
            settings(run_dir, WEBHOOK_URL=receiver.url, POLICY_MODE="dry_run", POLICY_RULES="stalled:5")
        )
        watchers = {
            "baseline": base.extensions["rankwatch"].watcher,
            "incidents": full.extensions["rankwatch"].watcher,
        }
        # The incident step alone, tick by tick (its share is lost in the tick's noise otherwise).
        incidents = full.extensions["rankwatch"].incidents
        step_ms: list[float] = []
        inner = incidents.tick

        def timed_step(*args, inner=inner):
            started = time.thread_time()
            try:
                return inner(*args)
            finally:
                step_ms.append((time.thread_time() - started) * 1e3)

        incidents.tick = timed_step
        results = {name: {"healthy": [], "stalled": []} for name in watchers}
        seq = [1] * ranks
        clock = [t0]
        for w in watchers.values():
            w.clock = lambda: clock[0]
            w.tick()  # the first read of every file is not a steady tick
        for i in range(2 * ticks):
            phase = "healthy" if i < ticks else "stalled"
            clock[0] += TICK_S
            half = range(i % 2, ranks, 2)
            for r in half:
                seq[r] += 1
                last = clock[0] if phase == "healthy" else t0 + ticks * TICK_S
                write_heartbeat(
                    run_dir,
                    heartbeat(
                        r, ranks, seq=seq[r], now=clock[0], global_step=100 + seq[r], last_step_at=last
                    ),
                    history=False,
                )
            for name, w in watchers.items():
                results[name][phase].append(timed_tick(w))
        full_rw = full.extensions["rankwatch"]
        counts = full_rw.state.summary(clock[0])["summary"]["counts"]
        raised = full_rw.incidents.alerts.sender.raised
        got = receiver.wait_for(lambda p: len(p) >= raised and p, f"{raised} alert(s)") if raised else []
    return {
        "results": results,
        "counts": counts,
        "alerts": [p["event"] for p in got],
        "first": got[:1],
        "step_ms": step_ms[1:],
    }


def bench_live(ranks: int, workdir: Path, hang_after: float = 40.0, window: float = 15.0) -> dict:
    """The real thing: simulator processes, ``python -m app`` with a webhook, all ranks hanging at once.

    Returns the dashboard's CPU (cores) while healthy and while all ranks are
    stalled, and what the receiver got.
    """
    import json
    import urllib.request

    import psutil

    from tests.helpers.liveserver import REPO, start_dashboard
    from trainer_bridge.rundir import runfiles

    run_dir = workdir / "live"
    with Receiver() as receiver:
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.bench.simulate",
                "--run-dir",
                str(run_dir),
                "--ranks",
                str(ranks),
                "--hang-after",
                str(hang_after),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        started = time.monotonic()
        server = None
        try:
            while not runfiles.job_path(run_dir).exists():
                time.sleep(0.1)
            server = start_dashboard(
                run_dir, workdir / "live-dashboard.log", env={"RANKWATCH_WEBHOOK_URL": receiver.url}
            )
            dash = psutil.Process(server.proc.pid)

            def counts():
                with urllib.request.urlopen(server.url + "/api/summary", timeout=30) as r:
                    return json.loads(r.read())["summary"].get("counts", {})

            def cores_over(seconds: float) -> float:
                cpu0, t0 = dash.cpu_times(), time.monotonic()
                time.sleep(seconds)
                cpu1 = dash.cpu_times()
                return ((cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)) / (time.monotonic() - t0)

            while counts().get("healthy", 0) < ranks:
                time.sleep(0.5)
            healthy = cores_over(max(1.0, hang_after - 3.0 - (time.monotonic() - started)))
            while counts().get("stalled", 0) < ranks:
                time.sleep(0.5)
            stalled = cores_over(window)
            got = receiver.events()
        finally:
            if server is not None:
                server.stop()
            sim.terminate()
            sim.wait()
    return {"healthy": healthy, "stalled": stalled, "alerts": [p["event"] for p in got], "first": got[:1]}


def bench_alerts(n: int, workdir: Path) -> list[float]:
    from app.incidents.webhooks import WebhookSender

    with Receiver() as receiver:
        sender = WebhookSender(
            [receiver.url],
            workdir / "alerts.sqlite3",
            timeout_s=5,
            give_up_s=60,
            retry_max_s=5,
            start_task=lambda f, *a: threading.Thread(target=f, args=a, daemon=True).start(),
        )
        sent = []
        for i in range(n):
            sent.append(time.time())
            sender.send({"event": "verdict", "text": f"alert {i}", "job": "bench", "at": sent[-1]})
            receiver.wait_for(lambda p, i=i: len(p) > i, f"alert {i}")
        sender.close()
        return [(a - s) * 1e3 for s, a in zip(sent, receiver.arrived, strict=True)]


def bench_capture(workdir: Path, requests: int = 10) -> dict:
    rng = random.Random(0)
    run_dir = workdir / "capture"
    out = {}
    job = DemoJob(run_dir, epochs=200, step_delay=0.05, **DEMO_DATA).start()
    try:
        job.wait_for_step(5)
        app = create_app(settings(run_dir))
        client = app.test_client()
        auth = AUTH
        for native in (False, True):
            latencies = []
            for _ in range(requests):
                # A user's request comes at any point of the rank's poll cycle; back to back,
                # each would come just after the last poll, and measure the worst case.
                time.sleep(rng.uniform(0.0, 1.5))
                started = time.perf_counter()
                r = client.post("/api/ranks/0/stack", json={"native": native}, headers=auth)
                rid = r.get_json()["request_id"]
                while True:
                    got = client.get("/api/ranks/0/stack")
                    if got.status_code == 200 and got.get_json()["request_id"] == rid:
                        break
                    time.sleep(0.01)
                latencies.append(time.perf_counter() - started)
                took = got.get_json()["took_ms"]
            out["bridge, native" if native else "bridge"] = (latencies, took)
    finally:
        job.kill()
    (workdir / "pyspy").mkdir()  # a run directory: the writer never creates its root
    proc = subprocess.Popen([sys.executable, "-c", HANGER], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        latencies = []
        for _ in range(requests):
            started = time.perf_counter()
            pyspy.capture_pyspy(workdir / "pyspy", 0, proc.pid, None, request_id=None, native=False)
            latencies.append(time.perf_counter() - started)
        out["py-spy (stopped process)"] = (latencies, None)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.incidents", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--ticks", type=int, default=40, help="ticks measured per phase")
    parser.add_argument("--skip-capture", action="store_true", help="no msrun job (the capture latency)")
    parser.add_argument(
        "--skip-live", action="store_true", help="no simulator processes and live dashboard (its CPU)"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-") as tmp:
        work = Path(tmp)
        print(
            f"tick: {args.ranks} ranks, {args.ticks} ticks healthy then {args.ticks} all stalled ...",
            flush=True,
        )
        tick = bench_tick(args.ranks, args.ticks, work)
        print(
            f"\n{'watcher':>10} {'phase':>8} {'wall p50 ms':>11} {'wall p95 ms':>11} {'cpu p50 ms':>10} "
            f"{'cpu max ms':>10} {'cores':>6}"
        )
        for name, phases in tick["results"].items():
            for phase, samples in phases.items():
                walls, cpus = [s[0] for s in samples], [s[1] for s in samples]
                print(
                    f"{name:>10} {phase:>8} {statistics.median(walls):>11.1f} {percentile(walls, 0.95):>11.1f} "
                    f"{statistics.median(cpus):>10.1f} {max(cpus):>10.1f} "
                    f"{statistics.mean(cpus) / 1e3 / TICK_S:>6.3f}"
                )
        for phase in ("healthy", "stalled"):
            base = statistics.median(s[1] for s in tick["results"]["baseline"][phase])
            full = statistics.median(s[1] for s in tick["results"]["incidents"][phase])
            print(
                f"incident step, {phase}: CPU per tick x{full / base:.2f} of the baseline (+{full - base:.1f} ms)"
            )
        steps = tick["step_ms"]
        print(
            f"the incident step alone: CPU p50 {statistics.median(steps):.2f} ms, max {max(steps):.1f} ms "
            f"(over every tick, the one in which all {args.ranks} verdicts changed included)"
        )
        print(f"verdicts at the end: {tick['counts']}")
        print(f"alerts received: {tick['alerts']}")
        if tick["first"]:
            print(f"  {tick['first'][0]['text'][:160]}")

        if not args.skip_live:
            print(
                f"\nlive: {args.ranks} simulated ranks, python -m app with a webhook, all hanging at once ..."
            )
            live = bench_live(args.ranks, work)
            print(
                f"dashboard CPU: {live['healthy']:.2f} core while healthy, {live['stalled']:.2f} core with "
                f"all {args.ranks} ranks stalled (target <= 0.5); alerts received: {live['alerts']}"
            )
            if live["first"]:
                print(f"  {live['first'][0]['text'][:160]}")

        lat = bench_alerts(50, work)
        print(
            f"\nalert delivery, send() to arrival, 50 alerts: p50 {statistics.median(lat):.1f} ms, "
            f"p95 {percentile(lat, 0.95):.1f} ms, max {max(lat):.1f} ms"
        )

        if not args.skip_capture:
            print("\ncapture latency, POST to capture readable (10 requests each):")
            for name, (latencies, took) in bench_capture(work).items():
                extra = f"; the capture itself {took:.1f} ms" if took is not None else ""
                print(
                    f"  {name:>26}: p50 {statistics.median(latencies):.2f} s, max {max(latencies):.2f} s{extra}"
                )
    print(f"\nload average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
