"""Agents benchmark: the hub's CPU per host digest, and one real agent's CPU and RSS.

``.venv/bin/python -m tests.bench.agents [--hosts 12500] [--seconds 20] [--agent-ranks 8]``

* **Hub.** A simulator (``--workers`` processes of their own, niced) plays
  ``--hosts`` agents of 8 ranks each: every host adds one digest a second to
  the run's stream on a real ``redis-server`` (started here on a free
  loopback port), built as a real agent builds it (``app.agent.digest``:
  the same fields, rows made by ``app.ranks.rows.make_row`` from heartbeats in the
  bridge's format, one row per digest from the rolling resync, signed with a
  key). A real dashboard (``python -m app`` with ``RANKWATCH_AGENTS``) reads
  them. After a warm-up, the digests it took in over the window are the
  growth of the sum of its host rows' ``seq`` (``GET /api/ranks``, read just
  outside the window) and its CPU is psutil's ``cpu_times`` delta.
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
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from tests.bench.ingest import start_redis
from tests.helpers.liveserver import REPO, start_dashboard

RUN = "bench"
KEY = "bench-key"
RANKS_PER_HOST = 8


def host_digests(first: int, count: int, url: str, stop, flips=None) -> None:
    """One simulator process: hosts ``first`` .. ``first + count - 1``, one digest each per second.

    ``flips``: ``(hosts, every, queue)``: each of those hosts turns its first
    rank straggler, then healthy again, every ``every`` digests, and puts
    ``(rank, verdict, time)`` on ``queue`` as it adds that digest (the window benchmark's p95).
    """
    import redis

    from app.agent import digest as dg
    from app.agent.runner import figures
    from app.ranks.health import Verdict
    from app.ranks.rows import make_row
    from tests.helpers.heartbeats import heartbeat

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = redis.Redis.from_url(url)
    stream = dg.keys(RUN)[0]
    key = KEY.encode()
    boot = time.time()
    world = (first + count) * RANKS_PER_HOST
    hosts = []
    for h in range(first, first + count):
        name = f"sim-{h:05d}"
        rows = [
            make_row(
                r,
                heartbeat(r, 131072, seq=1, host=name),
                Verdict("healthy", "training at the pace of its peers", 1.0),
            )
            for r in range(h * RANKS_PER_HOST, (h + 1) * RANKS_PER_HOST)
        ]
        # The figures of a steady host do not change: computed once, so the simulator keeps up.
        hosts.append((name, rows, figures(rows)))
    flip_hosts, flip_every, flip_queue = flips if flips is not None else (frozenset(), 0, None)
    seq = 0
    period = 1.0
    next_at = time.monotonic()
    while not stop.is_set():
        seq += 1
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for i, (name, rows, figs) in enumerate(hosts):
            row = rows[seq % RANKS_PER_HOST]
            row.update(time=round(now, 3), seq=seq, global_step=seq * 20, last_step_at=round(now, 3))
            sent = [row]
            if first + i in flip_hosts and seq % flip_every == 0:
                flipped = rows[0]
                flipped["health"] = "straggler" if flipped["health"] == "healthy" else "healthy"
                if flipped is not row:
                    sent.append(flipped)
                flip_queue.put((flipped["rank"], flipped["health"], now))
            digest = {
                "v": dg.VERSION,
                "run": RUN,
                "host": name,
                "agent": f"{name}:1:bench",
                "boot": boot,
                "seq": seq,
                "time": now,
                "attempt": boot,
                "world_size": world,
                "ranks": [rows[0]["rank"], rows[-1]["rank"]],
                "n": RANKS_PER_HOST,
                "flag": None,
                "rows": [{"row": r, "stop": None, "started_at": boot, "sync_every": 16} for r in sent],
                **figs,
            }
            pipe.xadd(stream, dg.encode(digest, key), maxlen=dg.STREAM_MAXLEN, approximate=True)
            if i % 500 == 499:
                pipe.execute()
                pipe = client.pipeline(transaction=False)
        pipe.execute()
        next_at += period
        wait = next_at - time.monotonic()
        if wait > 0:
            stop.wait(wait)
        else:
            next_at = time.monotonic()  # behind: say so in the figures, do not burst


def host_seq_sum(url: str) -> tuple[int, int]:
    """(digests the dashboard took in, hosts it heard), from ``GET /api/health``."""
    with urllib.request.urlopen(url + "/api/health", timeout=120) as r:
        hub = json.loads(r.read())["hub"]
    return hub["accepted"], hub["hosts"]


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


def end_simulators(stop, procs, server, wait_s: float = 10) -> None:
    """Tell the simulator processes to stop, kill those that do not, and stop the dashboard."""
    stop.set()
    for p in procs:
        p.join(wait_s)
        if p.is_alive():
            p.kill()
    server.stop()


def measure_hub(hosts: int, seconds: float, warmup: float, workers: int, workdir: Path, url: str) -> dict:
    server = start_hub(workdir, url)
    stop = multiprocessing.Event()
    share = -(-hosts // workers)
    procs = [
        multiprocessing.Process(
            target=host_digests, args=(i * share, min(share, hosts - i * share), url, stop)
        )
        for i in range(workers)
        if i * share < hosts
    ]
    try:
        for p in procs:
            p.start()
            os.setpriority(os.PRIO_PROCESS, p.pid, 10)  # the hub's cost is measured, not the simulator's
        time.sleep(warmup)
        seq0, _ = host_seq_sum(server.url)
        cpu0, t0 = server.cpu_seconds(), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = server.cpu_seconds(), time.monotonic()
        seq1, heard = host_seq_sum(server.url)
        rss = server.rss_bytes()
    finally:
        end_simulators(stop, procs, server)
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
    proc = multiprocessing.Process(target=host_digests, args=(0, hosts, url, stop))
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
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-agents-") as tmp:
        workdir = Path(tmp)
        redis_proc, url = start_redis(workdir)
        try:
            drain = measure_drain(args.hosts, workdir, url)
            print(
                f"hub (drain, in-process): {drain['digests']} digests in {drain['cpu_s']:.2f} s CPU, "
                f"{drain['us_per_digest']:.1f} us/digest = {1e6 / drain['us_per_digest']:.0f} digests/s per core"
            )
            hub = measure_hub(args.hosts, args.seconds, args.warmup, args.workers, workdir, url)
            print(
                f"hub: {hub['hosts']} hosts ({hub['heard']} heard), {hub['digests_per_s']:.0f} digests/s, "
                f"{hub['cores']:.3f} cores, {hub['us_per_digest']:.1f} us/digest, RSS {hub['rss_mb']:.0f} MB"
            )
            if args.agent_ranks:
                agent = measure_agent(args.agent_ranks, args.seconds, args.warmup, workdir, url)
                print(
                    f"agent: {agent['ranks']} ranks at 1 Hz, {agent['cores']:.4f} cores, RSS {agent['rss_mb']:.0f} MB"
                )
        finally:
            redis_proc.terminate()
            redis_proc.wait()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
