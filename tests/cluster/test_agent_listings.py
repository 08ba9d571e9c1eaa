"""The hub asks an agent for its checkpoint listing only when the listing's version changes (issue 36).

A real redis-server and a real dashboard (``create_app`` with ``AGENTS``,
retention in ``dry_run``), ticked by its own watcher; a few thousand
simulated hosts (``tests/bench/hostsim.py``: the agents benchmark's)
put their digests, with their listing versions, in the run's stream and
answer the hub's requests with ``ask.serve``, as agents do. The test counts
the requests the hosts find in Redis after each tick: not a timing.
"""

from __future__ import annotations

import time

import redis as redis_py

from app.agent import digest as dg
from tests.bench.hostsim import (
    KEY,
    RANKS_PER_HOST,
    RUN,
    SETS_BEFORE,
    STEPS_PER_SET,
    SimHosts,
    answer_requests,
)
from tests.helpers.app import make_app
from tests.helpers.checkpoints import bridge_id

HOSTS = 3000


def test_listing_requests_per_tick_do_not_grow_with_the_hosts_while_nothing_changes(tmp_path, redis_server):
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    # The simulated hosts sign with the benchmark's KEY: the hub checks with the same one.
    app = make_app(
        hub_dir,
        REDIS_URL=redis_server.url,
        REDIS_KEY=KEY,
        AGENTS=True,
        AGENT_LOST_S=3600.0,
        # Every tick may re-scan: what keeps the cost down must be the versions, not the interval.
        CHECKPOINT_SCAN_S=0.001,
        RETENTION_MODE="dry_run",
    )
    rw = app.extensions["rankwatch"]
    client = redis_py.Redis.from_url(redis_server.url)
    stream = dg.keys(RUN)[0]
    sim = SimHosts(0, HOSTS, listings=None)
    sim.listings.save_every = 0  # no new set unless the test makes one
    seq = 0

    def tick() -> dict[str, int]:
        """Every host sends a digest, the hub ticks, the hosts answer: host -> requests it had."""
        nonlocal seq
        seq += 1
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for i in range(HOSTS):
            pipe.xadd(stream, dg.encode(sim.digest(i, seq, now)[0], KEY.encode()))
        pipe.execute()
        rw.watcher.tick()
        return answer_requests(client, sim.listings, lambda host: seq)

    try:
        rw.watcher.tick()  # the hub joins the stream at its end
        first = tick()
        assert first == {f"sim-{h:05d}": 1 for h in range(HOSTS)}  # one listing per host, once
        # The answers are taken in; each digest carries one rank's row (the rolling resync), so
        # every rank has its host after RANKS_PER_HOST digests. No host is asked again meanwhile.
        for _ in range(RANKS_PER_HOST):
            assert tick() == {}
        assert len(rw.state.hub.owner) == HOSTS * RANKS_PER_HOST
        assert rw.state.hub.accepted == (RANKS_PER_HOST + 1) * HOSTS and rw.state.hub.refused == 0
        index = rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False)
        assert [s.id for s in index.sets] == [bridge_id(g * STEPS_PER_SET) for g in range(SETS_BEFORE, 0, -1)]
        assert all(s.complete for s in index.sets), [(s.id, s.ranks_missing[:5]) for s in index.sets]
        # Nothing changes: no request at all, and the index is the same object (nothing re-grouped,
        # so retention has nothing to recompute), tick after tick.
        for _ in range(5):
            assert tick() == {}
            assert rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False) is index
        # One host saves a set: its version changes, and exactly that host is asked.
        sim.listings.changed.add(7)
        assert tick() == {"sim-00007": 1}
        tick()
        assert tick() == {}
        index = rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False)
        newest = index.sets[0]
        assert newest.id == bridge_id((SETS_BEFORE + 1) * STEPS_PER_SET) and not newest.complete
        assert newest.ranks_present == tuple(range(7 * RANKS_PER_HOST, 8 * RANKS_PER_HOST))
        assert {f.host for f in newest.files} == {"sim-00007"}
    finally:
        rw.state.hub.close()
