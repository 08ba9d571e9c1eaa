"""Stop fan-out through agents: from the stop button to every host's flag file.

``.venv/bin/python -m tests.bench.fanout [--hosts 1000] [--workers 2]``

Without a shared filesystem a stop reaches a node only through its agent
(docs/production.md, "One agent per node"): the dashboard writes the flag
in its own run directory and mirrors it to Redis; each agent reads it in
the same round trip that sends its digest, once per ``interval_s``, and
writes it into its host's run directory with the bridge's flag writer.

Here ``--hosts`` real ``app.agent.runner.Agent`` objects (the agent's own
code: scan, digest, ``Outbox.send``, ``apply_flag``), each with a run
directory of its own, run in ``--workers`` processes, their rounds spread
evenly over the second as agents started at different moments would be.
A real dashboard (``python -m app`` with ``RANKWATCH_AGENTS``) reads their
digests from a real ``redis-server``. Once it has heard every host, one
``POST /api/exit`` stops the job; each host reports the moment its agent
wrote the flag, and the flag file of every host is then read back.

Printed: the time from the POST to each host's flag (p50, p95, max, and
when the last host had it), and how late the simulator ran the agents'
rounds (if the machine cannot keep up, this says so, and the fan-out
times include it).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.bench.agents import start_hub
from tests.bench.hostsim import end_simulators
from tests.bench.ingest import start_redis
from tests.helpers.app import AUTH, TOKEN

RUN = "fanout"
KEY = "bench-fanout-key"
PERIOD_S = 1.0


def host_name(h: int) -> str:
    return f"sim-{h:05d}"


def play_hosts(first: int, count: int, total: int, url: str, workdir: str, results, stop) -> None:
    """One simulator process: real agents for hosts ``first`` .. ``first + count - 1``."""
    from app.agent.runner import Agent
    from app.config import from_env

    logging.getLogger("rankwatch.agent").setLevel(logging.ERROR)  # a line per host would time the terminal
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    config = from_env()
    agents = []
    for h in range(first, first + count):
        run_dir = Path(workdir) / "hosts" / host_name(h) / RUN
        run_dir.mkdir(parents=True)
        agents.append(
            Agent(run_dir, url, RUN, config, key=KEY.encode(), host=host_name(h), interval_s=PERIOD_S)
        )
    start = time.monotonic()
    # Host h's round is due at h / total of each period: the rounds of all hosts spread evenly.
    due = [start + (first + i) / total * PERIOD_S for i in range(count)]
    applied: set[int] = set()
    worst_lag = 0.0
    while not stop.is_set():
        i = min(range(count), key=due.__getitem__)
        wait = due[i] - time.monotonic()
        if wait > 0:
            stop.wait(wait)
            continue
        worst_lag = max(worst_lag, -wait)
        agent = agents[i]
        agent.tick(time.time())
        if agent.flag_version is not None and i not in applied:
            applied.add(i)
            results.put(("flag", first + i, time.time(), worst_lag))
        due[i] += PERIOD_S
        if due[i] < time.monotonic():  # behind a whole period: skip ahead rather than burst
            due[i] = time.monotonic() + PERIOD_S / 2
    results.put(("lag", first, worst_lag, None))
    for agent in agents:
        agent.outbox.close()


def hub_hosts(url: str) -> int:
    with urllib.request.urlopen(url + "/api/health", timeout=60) as r:
        return json.loads(r.read())["hub"]["hosts"]


def post_exit(url: str) -> str:
    req = urllib.request.Request(
        url + "/api/exit",
        data=json.dumps({"reason": "fan-out benchmark", "who": "bench"}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **AUTH},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["request_id"]


def quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def measure(hosts: int, workers: int, workdir: Path, url: str, timeout_s: float) -> dict:
    from trainer_bridge.rundir import runfiles

    server = start_hub(workdir, url, RUN, KEY, lost_s=60, RANKWATCH_TOKEN=TOKEN)
    results = multiprocessing.Queue()
    stop = multiprocessing.Event()
    share = -(-hosts // workers)
    procs = [
        multiprocessing.Process(
            target=play_hosts,
            args=(i * share, min(share, hosts - i * share), hosts, url, str(workdir), results, stop),
        )
        for i in range(workers)
        if i * share < hosts
    ]
    flags: dict[int, float] = {}
    lags: list[float] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while (heard := hub_hosts(server.url)) < hosts:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the dashboard heard {heard} of {hosts} hosts in {timeout_s} s")
            time.sleep(0.5)
        t0 = time.time()
        rid = post_exit(server.url)
        posted = time.time()
        deadline = time.monotonic() + timeout_s
        while len(flags) < hosts and time.monotonic() < deadline:
            try:
                kind, h, at, lag = results.get(timeout=1)
            except Exception:  # queue.Empty: keep waiting until the deadline
                continue
            if kind == "flag":
                flags[h] = at
                lags.append(lag)
    finally:
        end_simulators(stop, procs, server, wait_s=30)
    while not results.empty():
        kind, _, lag, _ = results.get()
        if kind == "lag":
            lags.append(lag)
    # Read back: every host's flag file is the dashboard's request.
    written = 0
    for h in range(hosts):
        flag = runfiles.read_flag(workdir / "hosts" / host_name(h) / RUN)
        written += bool(flag is not None and flag.exit and flag.request_id == rid)
    delays = sorted(at - t0 for at in flags.values())
    return {
        "hosts": hosts,
        "reached": len(flags),
        "files": written,
        "post_s": posted - t0,
        "p50_s": quantile(delays, 0.50) if len(delays) > 1 else float("nan"),
        "p95_s": quantile(delays, 0.95) if len(delays) > 1 else float("nan"),
        "max_s": delays[-1] if delays else float("nan"),
        "worst_lag_s": max(lags, default=0.0),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.fanout", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=2, help="simulator processes")
    parser.add_argument("--timeout", type=float, default=120.0, help="upper bound on each wait, seconds")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rankwatch-fanout-") as tmp:
        workdir = Path(tmp)
        redis_proc, url = start_redis(workdir)
        try:
            m = measure(args.hosts, args.workers, workdir, url, args.timeout)
        finally:
            redis_proc.terminate()
            redis_proc.wait()
    print(
        f"stop fan-out through agents: {m['reached']}/{m['hosts']} hosts reported the flag, "
        f"{m['files']} flag files hold the request; POST answered in {m['post_s']:.2f} s; "
        f"from the POST to a host's flag p50 {m['p50_s']:.2f} s, p95 {m['p95_s']:.2f} s, "
        f"max (the last host) {m['max_s']:.2f} s; agent rounds ran up to {m['worst_lag_s']:.2f} s late"
    )
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0 if m["files"] == m["hosts"] else 1


if __name__ == "__main__":
    sys.exit(main())
