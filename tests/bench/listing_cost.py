"""The hub's CPU per host digest at rest and while every host saves checkpoint sets, in-process.

    python -m tests.bench.listing_cost [--hosts 3000] [--save-every 10] [--ticks 30]

A real redis-server and a real dashboard (``make_app`` with ``AGENTS``,
retention in ``dry_run``); the simulated hosts of ``tests/bench/hostsim.py``
put one digest each per tick in the stream and answer the hub's listing
requests with ``ask.serve`` (``answer_requests``). The figure is the CPU
time of the thread running the watcher's ticks (``time.thread_time``), not
a wall-clock rate, so a machine shared with others changes it little: the
cost of a change with listing deltas against whole listings can be compared
on a busy machine, by running this module against either tree
(``PYTHONPATH``). ``--ticks`` ticks at rest, then as many with every host
saving a set every ``--save-every`` digests, all at once.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def measure(hosts: int, save_every: int, ticks: int) -> dict:
    import redis as redis_py

    from app.agent import digest as dg
    from tests.bench.hostsim import KEY, RANKS_PER_HOST, RUN, SimHosts, answer_requests
    from tests.helpers.app import make_app
    from tests.helpers.redisserver import RedisServer

    tmp = Path(tempfile.mkdtemp(prefix="rankwatch-listing-cost-"))
    server = RedisServer(tmp).start()
    try:
        hub_dir = tmp / "hub" / RUN
        hub_dir.mkdir(parents=True)
        app = make_app(
            hub_dir,
            REDIS_URL=server.url,
            REDIS_KEY=KEY,
            AGENTS=True,
            AGENT_LOST_S=3600.0,
            CHECKPOINT_SCAN_S=0.001,
            RETENTION_MODE="dry_run",
        )
        rw = app.extensions["rankwatch"]
        client = redis_py.Redis.from_url(server.url)
        stream = dg.keys(RUN)[0]
        sim = SimHosts(0, hosts, listings=None)
        sim.listings.save_every = 0
        seq = 0

        def tick() -> float:
            nonlocal seq
            seq += 1
            now = time.time()
            pipe = client.pipeline(transaction=False)
            for i in range(hosts):
                pipe.xadd(stream, dg.encode(sim.digest(i, seq, now)[0], KEY.encode()))
            pipe.execute()
            start = time.thread_time()
            rw.watcher.tick()
            cpu = time.thread_time() - start
            answer_requests(client, sim.listings, lambda host: seq)
            return cpu

        try:
            rw.watcher.tick()
            for _ in range(RANKS_PER_HOST + 2):  # every host's first listing, every rank's host known
                tick()
            rest = sum(tick() for _ in range(ticks))
            sim.listings.save_every = save_every
            saving = sum(tick() for _ in range(ticks))
            index = rw.checkpoints.index(hosts * RANKS_PER_HOST, wait=False)
            return {
                "rest_us": 1e6 * rest / (ticks * hosts),
                "saving_us": 1e6 * saving / (ticks * hosts),
                "sets": len(index.sets),
                "entries": getattr(rw.state.source.hub, "listing_entries", None),
            }
        finally:
            rw.state.source.hub.close()
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=3000)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--ticks", type=int, default=30)
    args = parser.parse_args(argv)
    r = measure(args.hosts, args.save_every, args.ticks)
    print(
        f"hosts {args.hosts}: at rest {r['rest_us']:.1f} us/digest; every host saving a set every "
        f"{args.save_every} digests {r['saving_us']:.1f} us/digest ({args.ticks} ticks each, {r['sets']} sets "
        f"in the end; listing entries taken: {r['entries']})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
