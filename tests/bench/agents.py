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
  A real dashboard (``python -m app`` with ``RANKWATCH_AGENTS``) reads them,
  with what a real hub runs besides: every host holds checkpoint sets
  (``SimListings``: ``SETS_BEFORE`` sets, one more every ``--save-every``
  digests, its digests carrying the listing's version) and answers the
  hub's listing requests (``answer_listings``, a process of its own, with
  ``ask.serve``); the hub runs retention (``dry_run``), alerts (to a local
  webhook receiver; a few hosts flip a rank to straggler and back) and the
  stop policy (``dry_run``). After a warm-up, the digests it took in over
  the window are the growth of its ``accepted`` count (``GET /api/health``,
  read just outside the window), its CPU is psutil's ``cpu_times`` delta,
  and its lag is sampled four times a second: the age of the oldest digest
  in the stream that its consumer group has not read yet (``XINFO GROUPS``;
  the stream holds ``STREAM_MAXLEN`` digests, 4 s at 12,500 hosts, so a lag
  of 4 s there means digests were trimmed unread). With ``--save-every 0``
  the window opens once every host's first listing is in and the hub has
  caught up (lag under 1.5 s), within a bound.
* **Agent.** A real ``rankwatch agent`` on a run directory where
  ``tests.bench.simulate`` writes ``--agent-ranks`` heartbeat files at 1 Hz:
  its CPU (cores) and RSS over the window.

Targets (issues 20, 36): the hub ingests 12,500 digests per second in at most 1 core.
"""

from __future__ import annotations

import argparse
import collections
import http.server
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from tests.bench.hostsim import KEY, RUN, SAVE_EVERY, SENDERS, Simulators, answer_listings, live_digests
from tests.bench.ingest import start_redis
from tests.helpers.liveserver import REPO, start_dashboard


def host_seq_sum(url: str) -> tuple[int, int]:
    """(digests the dashboard took in, hosts it heard), from ``GET /api/health``."""
    with urllib.request.urlopen(url + "/api/health", timeout=120) as r:
        hub = json.loads(r.read())["hub"]
    return hub["accepted"], hub["hosts"]


def listings_pending(url: str) -> int:
    """Checkpoint-listing requests the dashboard has not had answered yet (``GET /api/health``)."""
    with urllib.request.urlopen(url + "/api/health", timeout=120) as r:
        return json.loads(r.read())["hub"]["listings_pending"]


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


class Webhooks:
    """A local receiver for the hub's alerts (``WEBHOOK_URL``): counts them by event."""

    def __init__(self):
        got = self.got = collections.Counter()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    got[json.loads(body).get("event", "?")] += 1
                except ValueError:
                    got["?"] += 1
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


class LagSampler:
    """The hub's lag, sampled on a thread: how long the oldest digest its group has not read has waited."""

    def __init__(self, url: str, every_s: float = 0.25):
        import redis

        from app.agent import digest as dg

        self.client = redis.Redis.from_url(url)
        self.stream = dg.keys(RUN)[0]
        self.every_s = every_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def lag_s(self) -> float:
        groups = [g for g in self.client.xinfo_groups(self.stream) if g["name"].startswith(b"hub:")]
        if not groups:
            return float("nan")
        last = groups[0]["last-delivered-id"]
        unread = self.client.xrange(self.stream, min=b"(" + last, count=1)
        if not unread:
            return 0.0
        added_ms = int(unread[0][0].split(b"-")[0])  # an entry's id is Redis's clock when it was added
        return max(0.0, time.time() - added_ms / 1000)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(self.lag_s())

    def start(self) -> LagSampler:
        self._thread.start()
        return self

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(10)
        s = sorted(x for x in self.samples if x == x)
        return {
            "lag_p50_s": statistics.median(s) if s else float("nan"),
            "lag_max_s": s[-1] if s else float("nan"),
        }


def measure_hub(
    hosts: int,
    seconds: float,
    warmup: float,
    workers: int,
    workdir: Path,
    url: str,
    sender: str = "prebuilt",
    profile: str | None = None,
    save_every: int = SAVE_EVERY,
) -> dict:
    """A real dashboard fed by ``hosts`` simulated agents: digests taken in a second, its CPU, RSS and lag.

    ``profile``: a flame graph of the dashboard's serving process over the
    window, by ``py-spy record`` (sampling from outside, without pausing it).
    """
    hooks = Webhooks()
    server = start_hub(
        workdir,
        url,
        RANKWATCH_RETENTION_MODE="dry_run",
        RANKWATCH_WEBHOOK_URL=hooks.url,
        RANKWATCH_POLICY_MODE="dry_run",
        RANKWATCH_POLICY_RULES="straggler:5,stalled:60,node_lost:60,device_unhealthy:60",
    )
    # A few hosts turn a rank straggler and back every 10 digests: verdict alerts and the policy's rule.
    flips = (frozenset(range(0, hosts, max(1, hosts // 10))), 10, multiprocessing.Queue())
    threading.Thread(target=_drain, args=(flips[2],), daemon=True).start()
    # Enough digests for the warm-up, the first listings, the window and the reads of /api/health around it.
    horizon_s = warmup + seconds + 30 + (hosts // 200 if save_every == 0 else 0)
    sims = Simulators.start(
        sender, hosts, workers, url, horizon=horizon_s, flips=flips, save_every=save_every
    )
    answering = multiprocessing.Event()
    t0 = multiprocessing.Value("d", 0.0)
    answerer = None
    try:
        began = sims.sending()
        t0.value = began["t0"]
        answerer = multiprocessing.Process(
            target=answer_listings, args=(url, t0, answering, None, save_every)
        )
        answerer.start()
        time.sleep(warmup)
        # Every host's first listing (a request and an answer each) is the hub's start-up, not its
        # steady cost: the window opens once they are in (and the merged index built once more).
        while listings_pending(server.url) and time.time() - began["t0"] < horizon_s - seconds - 10:
            time.sleep(1)
        listed_after = time.time() - began["t0"]
        # ... and once the hub has caught up with its stream after grouping them (within a bound).
        lag = LagSampler(url)
        while lag.lag_s() > 1.5 and time.time() - began["t0"] < horizon_s - seconds - 10:
            time.sleep(0.5)
        seq0, _ = host_seq_sum(server.url)
        lag.start()
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
        lags = lag.stop()
        seq1, heard = host_seq_sum(server.url)
        rss = server.rss_bytes()
        if spy is not None:
            spy.wait(60)
    finally:
        answering.set()
        if answerer is not None:
            answerer.join(10)
        ran = sims.end(server)
        hooks.close()
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
        "alerts": dict(hooks.got),
        "listed_after_s": listed_after,
        **lags,
        "sender": sender,
        "built_late_s": began["built_late_s"],
        **ran,
    }


def _drain(q) -> None:
    """Read the flips the senders report (nobody needs them here) so that their queue never fills."""
    while True:
        q.get()


def top_frames(collapsed: str, n: int = 5) -> tuple[list, list]:
    """The busiest places in py-spy's collapsed stacks (``--profile``), as shares of all samples.

    Two lists of (share, ``function (file:line)``): the ``n`` functions with
    the most samples of their own, and the ``n`` of the dashboard's
    (``app/``) with the most samples in all, leaving out the loop and the
    tick that hold everything.
    """
    inclusive: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    total = 0
    for line in Path(collapsed).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # a function, whatever its line
        total += int(count)
        for f in set(frames):
            inclusive[f] += int(count)
        own[frames[-1]] += int(count)
    loop = ("Watcher._run", "Watcher.tick ", "Thread.", "serve_forever")
    ours = [(c, f) for f, c in inclusive.most_common() if "(app/" in f and not any(w in f for w in loop)]
    return (
        [(c / total, f) for f, c in own.most_common(n)],
        [(c / total, f) for c, f in ours[:n]],
    )


def measure_drain(hosts: int, workdir: Path, url: str) -> dict:
    """The hub's cost per digest at saturation, in this process: a full stream drained by scans.

    The simulator first fills the stream (``STREAM_MAXLEN`` digests) while
    nobody reads; then ``RunState.scan`` (through ``HubSource.scan``) and ``take_delta`` (what the
    watcher does each tick) take them all in. Without the web server
    around it, and with every digest read in batches, this is the hub's
    ceiling: 1e6 / (us per digest) digests a second per core.
    """
    import redis

    from app.agent import digest as dg
    from app.agent.hubsource import hub_source
    from app.config import from_env
    from app.run.state import RunState

    hub_dir = workdir / "drain" / RUN
    hub_dir.mkdir(parents=True)
    config = {**from_env(), "REDIS_URL": url, "AGENTS": True, "REDIS_KEY": KEY, "AGENT_LOST_S": 3600.0}
    redis.Redis.from_url(url).delete(dg.keys(RUN)[0])
    state = RunState(str(hub_dir), config, source=hub_source(str(hub_dir), config))
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
        before = state.source.hub.accepted
        state.scan(time.time())
        state.take_delta(time.time())
        if state.source.hub.accepted == before:
            break
    cpu = time.process_time() - cpu0
    digests = state.source.hub.accepted
    state.source.hub.close()
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
        "--save-every",
        type=int,
        default=SAVE_EVERY,
        help="each simulated host saves a new checkpoint set every this many digests (0: never)",
    )
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
                args.hosts,
                args.seconds,
                args.warmup,
                args.workers,
                workdir,
                url,
                args.sender,
                args.profile,
                args.save_every,
            )
            print(
                f"hub: {hub['hosts']} hosts ({hub['heard']} heard), {hub['digests_per_s']:.0f} digests/s, "
                f"{hub['cores']:.3f} cores, {hub['us_per_digest']:.1f} us/digest, "
                f"lag p50 {hub['lag_p50_s']:.2f} s max {hub['lag_max_s']:.2f} s, RSS {hub['rss_mb']:.0f} MB"
            )
            print(
                f"hub's alerts received: {hub['alerts']}; every host's first listing in "
                f"{hub['listed_after_s']:.0f} s after the first digest"
            )
            print(simulator_line(hub))
            if args.profile and not args.profile.endswith(".svg"):
                print("hub's profile: share of its samples, and its us/digest times that share")
                by_self, by_total = top_frames(args.profile)
                for title, rows in (("self", by_self), ("inclusive, app/", by_total)):
                    print(f"  top 5 by {title}:")
                    for share, where in rows:
                        print(f"    {share:6.1%} {share * hub['us_per_digest']:6.1f} us/digest  {where}")
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
