"""Agents benchmark: the hub's CPU per host digest, and one real agent's CPU and RSS.

``.venv/bin/python -m tests.bench.agents [--hosts 12500] [--seconds 20] [--agent-ranks 8]``

* **Hub.** A simulator (``tests/bench/hostsim.py``, ``--workers``
  processes of their own, niced) plays ``--hosts`` agents of 8 ranks each:
  every host adds one digest a second to the run's stream on a real
  ``redis-server`` (started here on a free loopback port), built as a real
  agent builds it (``app.agent.digest``: the same fields, rows made by
  ``app.run.rows.make_row`` from heartbeats in the bridge's format, one
  row per digest from the rolling resync, signed with a key). By default
  (``--sender prebuilt``) every digest is built and serialised before the
  window and only written to a socket during it, so that the simulator
  does not take the hub's CPU; ``--sender live`` builds each one when due.
  A real dashboard (``python -m app`` with ``RANKWATCH_AGENTS``) reads them.
  After a warm-up, the digests it took in over the window are the growth
  of its ``accepted`` count (``GET /api/health``, read just outside the
  window) and its CPU is psutil's ``cpu_times`` delta.
* **Agent.** A real ``rankwatch agent`` on a run directory where
  ``tests.bench.simulate`` writes ``--agent-ranks`` heartbeat files at 1 Hz:
  its CPU (cores) and RSS over the window.

Targets (issue 20): the hub ingests 12,500 digests per second in at most 1 core.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from tests.bench.hostsim import KEY, RUN, SENDERS, Simulators, live_digests
from tests.bench.ingest import start_redis
from tests.helpers.liveserver import REPO, start_dashboard


def host_seq_sum(url: str) -> tuple[int, int]:
    """(digests the dashboard took in, hosts it heard), from ``GET /api/health``."""
    with urllib.request.urlopen(url + "/api/health", timeout=120) as r:
        hub = json.loads(r.read())["hub"]
    return hub["accepted"], hub["hosts"]


def simulator_line(r: dict) -> str:
    """How the simulator ran: a hub's figures mean 1 Hz per host only if it kept its schedule."""
    return (
        f"simulator ({r['sender']}): built {r['built_late_s']:.1f} s late, slices up to {r['late_s']:.2f} s late, "
        f"{r['errors']} redis errors" + (f" (first: {r['error']})" if r["error"] else "")
    )


def start_hub(workdir: Path, url: str, run: str = RUN, key: str = KEY, lost_s: float = 30, **env):
    """A real dashboard reading the agents' digests of ``run`` (``RANKWATCH_AGENTS``), on an empty run directory."""
    hub_dir = workdir / "hub" / run
    hub_dir.mkdir(parents=True)
    settings = {
        "RANKWATCH_REDIS_URL": url,
        "RANKWATCH_AGENTS": "1",
        "RANKWATCH_REDIS_KEY": key,
        "RANKWATCH_AGENT_LOST_S": str(lost_s),
        **env,
    }
    return start_dashboard(hub_dir, workdir / "dashboard.log", env=settings)


def measure_hub(
    hosts: int,
    seconds: float,
    warmup: float,
    workers: int,
    workdir: Path,
    url: str,
    sender: str = "prebuilt",
    profile: str | None = None,
) -> dict:
    """A real dashboard fed by ``hosts`` simulated agents: digests taken in a second, its CPU and RSS.

    ``profile``: a flame graph of the dashboard's serving process over the
    window, by ``py-spy record`` (sampling from outside, without pausing it).
    """
    server = start_hub(workdir, url)
    # Enough digests for the warm-up, the window and the reads of /api/health around it.
    sims = Simulators.start(sender, hosts, workers, url, horizon=warmup + seconds + 30)
    try:
        began = sims.sending()
        time.sleep(warmup)
        seq0, _ = host_seq_sum(server.url)
        spy = (
            subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "--nonblocking", "-o", profile]
                + ["--format", "flamegraph" if profile.endswith(".svg") else "raw"]
                + ["--duration", str(round(seconds)), "--pid", str(server.worker_pid())],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if profile
            else None
        )
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = server.cpu_seconds(), time.monotonic()
        seq1, heard = host_seq_sum(server.url)
        rss = server.rss_bytes()
        if spy is not None:
            spy.wait(60)
    finally:
        ran = sims.end(server)
    wall = t1 - t0
    per_s = (seq1 - seq0) / wall
    cores = (cpu1 - cpu0) / wall
    return {
        "hosts": hosts,
        "heard": heard,
        "digests_per_s": per_s,
        "cores": cores,
        "us_per_digest": cores / per_s * 1e6 if per_s else float("nan"),
        "rss_mb": rss / 2**20,
        "sender": sender,
        "built_late_s": began["built_late_s"],
        **ran,
    }


def measure_drain(hosts: int, workdir: Path, url: str) -> dict:
    """The hub's cost per digest at saturation, in this process: a full stream drained by scans.

    The simulator first fills the stream (``STREAM_MAXLEN`` digests) while
    nobody reads; then ``HubState.scan`` and ``take_delta`` (what the
    watcher does each tick) take them all in. Without the web server
    around it, and with every digest read in batches, this is the hub's
    ceiling: 1e6 / (us per digest) digests a second per core.
    """
    import redis

    from app.agent import digest as dg
    from app.agent.hubstate import hub_state
    from app.config import from_env

    hub_dir = workdir / "drain" / RUN
    hub_dir.mkdir(parents=True)
    config = {**from_env(), "REDIS_URL": url, "AGENTS": True, "REDIS_KEY": KEY, "AGENT_LOST_S": 3600.0}
    redis.Redis.from_url(url).delete(dg.keys(RUN)[0])
    state = hub_state(str(hub_dir), config)
    state.scan(time.time())  # joins the stream at its end
    stop = multiprocessing.Event()
    proc = multiprocessing.Process(target=live_digests, args=(0, hosts, url, stop, multiprocessing.Queue()))
    proc.start()
    client = redis.Redis.from_url(url)
    while client.xlen(dg.keys(RUN)[0]) < dg.STREAM_MAXLEN * 0.9:
        time.sleep(0.5)
    stop.set()
    proc.join()
    cpu0 = time.process_time()
    while True:
        before = state.hub.accepted
        state.scan(time.time())
        state.take_delta(time.time())
        if state.hub.accepted == before:
            break
    cpu = time.process_time() - cpu0
    digests = state.hub.accepted
    state.hub.close()
    return {
        "digests": digests,
        "cpu_s": cpu,
        "us_per_digest": cpu / digests * 1e6 if digests else float("nan"),
    }


def measure_agent(ranks: int, seconds: float, warmup: float, workdir: Path, url: str) -> dict:
    run_dir = workdir / "node" / RUN
    run_dir.mkdir(parents=True)
    sim = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.simulate", "--run-dir", str(run_dir), "--ranks", str(ranks)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "agent", "--run-dir", str(run_dir), "--redis", url],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(warmup)
        proc = psutil.Process(agent.pid)
        c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
        time.sleep(seconds)
        c1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
        rss = proc.memory_info().rss
    finally:
        for p in (agent, sim):
            p.terminate()
            p.wait()
    return {"ranks": ranks, "cores": (c1 - c0) / (t1 - t0), "rss_mb": rss / 2**20}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.agents", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=12_500)
    parser.add_argument("--workers", type=int, default=2, help="simulator processes")
    parser.add_argument("--agent-ranks", type=int, default=8, help="ranks of the real agent's host (0: skip)")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument(
        "--sender",
        choices=sorted(SENDERS),
        default="prebuilt",
        help="the hub's simulator: digests built before the window and written as raw RESP, or built live",
    )
    parser.add_argument("--no-drain", action="store_true", help="skip the in-process drain")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="py-spy's profile of the hub over the window: a flame graph (.svg) or collapsed stacks (other names)",
    )
    args = parser.parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="rankwatch-agents-") as tmp:
        workdir = Path(tmp)
        redis_proc, url = start_redis(workdir)
        try:
            if not args.no_drain:
                drain = measure_drain(args.hosts, workdir, url)
                print(
                    f"hub (drain, in-process): {drain['digests']} digests in {drain['cpu_s']:.2f} s CPU, "
                    f"{drain['us_per_digest']:.1f} us/digest = {1e6 / drain['us_per_digest']:.0f} digests/s per core"
                )
            hub = measure_hub(
                args.hosts, args.seconds, args.warmup, args.workers, workdir, url, args.sender, args.profile
            )
            print(
                f"hub: {hub['hosts']} hosts ({hub['heard']} heard), {hub['digests_per_s']:.0f} digests/s, "
                f"{hub['cores']:.3f} cores, {hub['us_per_digest']:.1f} us/digest, RSS {hub['rss_mb']:.0f} MB"
            )
            print(simulator_line(hub))
            if args.agent_ranks:
                agent = measure_agent(args.agent_ranks, args.seconds, args.warmup, workdir, url)
                print(
                    f"agent: {agent['ranks']} ranks at 1 Hz, {agent['cores']:.4f} cores, RSS {agent['rss_mb']:.0f} MB"
                )
        finally:
            redis_proc.terminate()
            redis_proc.wait()
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
