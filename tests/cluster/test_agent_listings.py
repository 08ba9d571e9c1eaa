"""The hub asks an agent for its checkpoint listing only when the listing's version changes (issue 36).

A real redis-server and a real dashboard (``create_app`` with ``AGENTS``,
retention in ``dry_run``), ticked by its own watcher; a few thousand
simulated hosts (``tests/bench/hostsim.py``: the agents benchmark's)
put their digests, with their listing versions, in the run's stream and
answer the hub's requests with ``ask.serve``, as agents do. The test counts
the requests the hosts find in Redis after each tick, and the sets and files
the hub pushes to the checkpoint pages: not a timing.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import redis as redis_py

from app.agent import ask
from app.agent import digest as dg
from app.checkpoints.indexbody import apply_delta
from app.extensions import socketio
from app.push import CHECKPOINTS_DELTA_EVENT, CHECKPOINTS_EVENT
from tests.bench.hostsim import (
    KEY,
    RANKS_PER_HOST,
    RUN,
    SETS_BEFORE,
    STEPS_PER_SET,
    SimHosts,
    answer_requests,
    listing_entry,
)
from tests.helpers.app import make_app
from tests.helpers.checkpoints import bridge_id
from trainer_bridge.rundir import ckptindex, redisbus

HOSTS = 3000


def test_listing_requests_per_tick_do_not_grow_with_the_hosts_while_nothing_changes(
    tmp_path, redis_server, monkeypatch
):
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
    # What the hub pushes to the checkpoint pages: recorded on its way to Socket.IO, and sent on.
    # The operators' room's pushes (the viewers' room gets the same, redacted: app/push.py).
    pushed: list[tuple[str, dict]] = []
    emit = socketio.emit

    def recorded(event, payload, **kwargs):
        to = kwargs.get("to")
        rooms = to if isinstance(to, list) else [to]
        if event in (CHECKPOINTS_EVENT, CHECKPOINTS_DELTA_EVENT) and any(
            str(r).endswith('"operator"]') for r in rooms
        ):
            pushed.append((event, payload))
        return emit(event, payload, **kwargs)

    monkeypatch.setattr(socketio, "emit", recorded)

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
        assert len(rw.state.source.hub.owner) == HOSTS * RANKS_PER_HOST
        assert (
            rw.state.source.hub.accepted == (RANKS_PER_HOST + 1) * HOSTS and rw.state.source.hub.refused == 0
        )
        index = rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False)
        assert [s.id for s in index.sets] == [bridge_id(g * STEPS_PER_SET) for g in range(SETS_BEFORE, 0, -1)]
        assert all(s.complete for s in index.sets), [(s.id, s.ranks_missing[:5]) for s in index.sets]
        # The pages got the whole index once (the first push), then deltas as the listings came in.
        assert [e for e, _ in pushed].count(CHECKPOINTS_EVENT) == 1, [e for e, _ in pushed]
        page = pushed[0][1]
        for _, payload in pushed[1:]:
            page = apply_delta(page, payload)
        assert [s["id"] for s in page["sets"]] == [s.id for s in index.sets]
        assert sum(len(s["files"]) for s in page["sets"]) == HOSTS * RANKS_PER_HOST * SETS_BEFORE
        pushed.clear()
        # Nothing changes: no request at all, and the index is the same object (nothing re-grouped,
        # so retention has nothing to recompute), tick after tick.
        for _ in range(5):
            assert tick() == {}
            assert rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False) is index
        assert pushed == []  # nor anything pushed to the pages
        # One host saves a set: its version changes, exactly that host is asked, and its answer
        # carries that set's files alone (the changes since the version the hub holds).
        entries = rw.state.source.hub.listing_entries
        assert entries == HOSTS * SETS_BEFORE * RANKS_PER_HOST  # each host's whole listing, once
        sim.listings.changed.add(7)
        assert tick() == {"sim-00007": 1}
        tick()
        assert rw.state.source.hub.listing_entries - entries == RANKS_PER_HOST
        assert tick() == {}
        index = rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False)
        newest = index.sets[0]
        assert newest.id == bridge_id((SETS_BEFORE + 1) * STEPS_PER_SET) and not newest.complete
        assert newest.ranks_present == tuple(range(7 * RANKS_PER_HOST, 8 * RANKS_PER_HOST))
        assert {f.host for f in newest.files} == {"sim-00007"}
        # The pages are sent that set's files alone, in one delta: not the index's 72,000 files
        # (every set, whole), as each push was before.
        assert [e for e, _ in pushed] == [CHECKPOINTS_DELTA_EVENT], pushed
        delta = pushed[0][1]
        whole = [s for s in delta["sets"] if "files" in s]
        assert [s["id"] for s in whole] == [newest.id] and "removed" not in delta
        assert sum(len(s.get("files", ())) for s in delta["sets"]) == RANKS_PER_HOST
        page = apply_delta(page, delta)
        assert [s["id"] for s in page["sets"]] == [s.id for s in index.sets]
        assert {f["path"] for f in page["sets"][0]["files"]} == {f.path for f in newest.files}
        # Another host saves the same set: the delta carries that host's files, not the set's all.
        pushed.clear()
        sim.listings.changed.add(8)
        while not pushed:  # a guard: the answer comes in at the next tick or the one after
            assert len(pushed) == 0 and seq < 100
            tick()
        [(event, delta)] = pushed
        [entry] = [s for s in delta["sets"] if s["id"] == newest.id]
        assert "files" not in entry and entry["files_removed"] == []
        assert {f["rank"] for f in entry["files_changed"]} == set(
            range(8 * RANKS_PER_HOST, 9 * RANKS_PER_HOST)
        )
        assert sum(len(s.get("files", ())) + len(s.get("files_changed", ())) for s in delta["sets"]) == 8
        page = apply_delta(page, delta)
        index = rw.checkpoints.index(HOSTS * RANKS_PER_HOST, wait=False)
        assert [f["path"] for f in page["sets"][0]["files"]] == [f.path for f in index.sets[0].files]
        assert page["sets"][0]["ranks_present"] == list(range(7 * RANKS_PER_HOST, 9 * RANKS_PER_HOST))
    finally:
        rw.state.source.hub.close()


class RandomListings:
    """Listings that change at random, for ``SimHosts`` and ``answer_requests``: each host's files
    (path -> ``ask.file_listing`` entry) and its last few listings (the agent's ``ask.ListingHistory``)."""

    def __init__(self, hosts: int, rng: random.Random):
        self.rng = rng
        self.files: list[dict[str, dict]] = [{} for _ in range(hosts)]
        self.history = [ask.ListingHistory() for _ in range(hosts)]
        self.current: list[tuple[dict, str]] = [({}, "")] * hosts
        for h in range(hosts):
            for g in range(1, rng.randint(1, 4)):
                self.add_set(h, g * STEPS_PER_SET)
            self.publish(h)

    def add_set(self, h: int, g: int) -> None:
        for r in range(h * RANKS_PER_HOST, (h + 1) * RANKS_PER_HOST):
            e = listing_entry(r, g)
            self.files[h][e["path"]] = e

    def change(self, h: int) -> None:
        """One random change on host ``h``: a new set, the oldest gone, a file corrupt, another
        rank's file copied here (misplaced), or the agent restarted (it holds no old listing)."""
        rng, files = self.rng, self.files[h]
        steps = sorted({e["global_step"] for e in files.values()})
        what = rng.choice(["save", "save", "drop", "corrupt", "copy", "restart"])
        if what == "save" or not steps:
            self.add_set(h, ((steps[-1] if steps else 0) // STEPS_PER_SET + 1) * STEPS_PER_SET)
        elif what == "drop":
            for path in [p for p, e in files.items() if e["global_step"] == steps[0]]:
                del files[path]
        elif what == "corrupt":
            path = rng.choice(sorted(files))
            files[path] = listing_entry(int(path.split("/")[1][5:]), files[path]["global_step"], "corrupt")
        elif what == "copy":
            e = listing_entry(rng.randrange(len(self.files) * RANKS_PER_HOST), rng.choice(steps))
            files[e["path"]] = e
        else:
            self.history[h] = ask.ListingHistory()
        self.publish(h)

    def publish(self, h: int) -> None:
        listing = {"files": list(self.files[h].values()), "errors": []}
        version = dg.listing_version(listing)
        self.history[h].keep(version, listing)
        self.current[h] = (listing, version)

    # What SimHosts and answer_requests ask of a host's listings.
    def version(self, h: int, seq: int) -> str:
        return self.current[h][1]

    def listing(self, h: int, seq: int) -> tuple[dict, str]:
        return self.current[h]

    def held(self, h: int, seq: int, version: str | None) -> dict | None:
        return self.history[h].get(version)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_listing_changes_cost_what_changed_and_the_index_stays_a_full_rebuilds(tmp_path, redis_server, seed):
    """Seeded random changes on random hosts: each answer carries the changed entries alone (the
    whole listing only when the agent no longer holds the hub's version), and after each round the
    hub's index equals the one grouped afresh from every host's whole listing."""
    hosts = 40
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = make_app(
        hub_dir,
        REDIS_URL=redis_server.url,
        REDIS_KEY=KEY,
        AGENTS=True,
        AGENT_LOST_S=3600.0,
        CHECKPOINT_SCAN_S=0.001,
        RETENTION_MODE="dry_run",
    )
    rw = app.extensions["rankwatch"]
    hub = rw.state.source.hub
    client = redis_py.Redis.from_url(redis_server.url)
    stream = dg.keys(RUN)[0]
    rng = random.Random(seed)
    truth = RandomListings(hosts, rng)
    sim = SimHosts(0, hosts, listings=truth)
    world = hosts * RANKS_PER_HOST
    seq = 0

    def tick() -> dict[str, int]:
        nonlocal seq
        seq += 1
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for i in range(hosts):
            pipe.xadd(stream, dg.encode(sim.digest(i, seq, now)[0], KEY.encode()))
        pipe.execute()
        rw.watcher.tick()
        return answer_requests(client, truth, lambda host: seq)

    def rebuilt() -> ckptindex.Index:
        listed = {
            f"sim-{h:05d}": ([ckptindex.from_listing(e, f"sim-{h:05d}") for e in truth.files[h].values()], [])
            for h in range(hosts)
        }
        files, errors = ask.remote_files(listed, dict(hub.owner))
        return ckptindex.build_index(str(hub_dir), files, world, errors)

    def shape(index: ckptindex.Index) -> tuple:
        sets = sorted((s.to_dict(now=0) for s in index.sets), key=lambda s: s["id"])
        return sets, [f.to_dict() for f in index.other_files]

    try:
        rw.watcher.tick()
        for _ in range(RANKS_PER_HOST + 1):  # every host listed in full, every rank's host known
            tick()
        assert len(hub.owner) == world and hub.refused == 0
        assert hub.listing_entries == sum(len(f) for f in truth.files)
        for _ in range(30):
            before = [dict(f) for f in truth.files]
            restarted = set()
            for h in rng.sample(range(hosts), rng.randint(1, 6)):
                fresh = truth.history[h]
                truth.change(h)
                if truth.history[h] is not fresh:
                    restarted.add(h)
            expected = 0
            for h in range(hosts):
                now_files = truth.files[h]
                diff = sum(1 for p, e in now_files.items() if before[h].get(p) != e)
                diff += sum(1 for p in before[h] if p not in now_files)
                if diff:  # a host whose listing did not change is not asked, restarted or not
                    expected += len(now_files) if h in restarted or diff >= len(now_files) else diff
            entries = hub.listing_entries
            asked = tick()
            tick()
            assert set(asked) <= {f"sim-{h:05d}" for h in range(hosts)}
            assert hub.listing_entries - entries == expected
            assert shape(rw.checkpoints.index(world, wait=False)) == shape(rebuilt())
        assert hub.refused == 0
    finally:
        hub.close()


class LyingAgent:
    """What ``ask.serve`` needs of an agent, answering a listing request with ``answer(base)``."""

    def __init__(self, name: str, answer):
        self.host, self.run, self.key = name, RUN, redisbus.derive(KEY.encode(), redisbus.agent_label(name))
        self.asks_refused = 0
        self.checkpoint_files = answer


def test_a_listing_change_the_hub_did_not_ask_for_or_past_the_bound_is_refused(tmp_path, redis_server):
    """Changes since a version the hub does not hold, or leaving a host more than MAX_FILES files,
    change nothing: counted with the refused, and the next request asks for the whole listing."""
    hosts = 3
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    app = make_app(
        hub_dir,
        REDIS_URL=redis_server.url,
        REDIS_KEY=KEY,
        AGENTS=True,
        AGENT_LOST_S=3600.0,
        CHECKPOINT_SCAN_S=0.001,
    )
    rw = app.extensions["rankwatch"]
    hub = rw.state.source.hub
    client = redis_py.Redis.from_url(redis_server.url)
    stream = dg.keys(RUN)[0]
    sim = SimHosts(0, hosts, listings=None)
    sim.listings.save_every = 0
    world = hosts * RANKS_PER_HOST
    seq = 0
    requests: list[dict] = []

    responder = None  # how host 1 answers its next listing request (None: as its listing says)

    def tick() -> None:
        """Digests, a hub tick, and the hosts' answers (host 1's next one by ``responder``, once)."""
        nonlocal seq, responder
        seq += 1
        pipe = client.pipeline(transaction=False)
        for i in range(hosts):
            pipe.xadd(stream, dg.encode(sim.digest(i, seq, time.time())[0], KEY.encode()))
        pipe.execute()
        rw.watcher.tick()
        raws = client.lrange(ask.ask_key(RUN, "sim-00001"), 0, -1)
        for raw in reversed(raws):
            requests.append(
                json.loads(dg.unseal(raw, "ask", "sim-00001", LyingAgent("sim-00001", None).key, RUN, 4096))
            )
        if raws and responder is not None:
            client.delete(ask.ask_key(RUN, "sim-00001"))
            for key, value in ask.serve(LyingAgent("sim-00001", responder), raws, time.time()):
                client.set(key, value, ex=ask.ANSWER_TTL_S)
            responder = None
        answer_requests(client, sim.listings, lambda host: seq)

    def lie(answer) -> int:
        """Host 1's next request answered by ``answer``; tick until the hub has read it and any
        request that follows is answered. The index of that request in ``requests``."""
        nonlocal responder
        responder, asked = answer, len(requests)
        for _ in range(50):  # a guard: the request goes at the tick that reads the new version
            tick()
            if responder is None and not rw.state.source.listings._pending:
                break
        assert responder is None and len(requests) > asked, requests
        return asked

    def files_of_host_1() -> set[str]:
        index = rw.checkpoints.index(world, wait=False)
        return {f.path for s in index.sets for f in s.files if f.host == "sim-00001"} | {
            f.path for f in index.other_files if f.host == "sim-00001"
        }

    def real_files() -> set[str]:
        return {e["path"] for e in sim.listings.listing(1, seq)[0]["files"]}

    try:
        rw.watcher.tick()
        for _ in range(RANKS_PER_HOST + 1):
            tick()
        assert files_of_host_1() == real_files() and hub.refused == 0
        held = sim.listings.version(1, seq)
        # Host 1's version changes; its answer claims changes since a version the hub does not hold.
        sim.listings.changed.add(1)
        gone = {
            "files": [],
            "errors": [],
            "version": "a" * 32,
            "base": "f" * 32,
            "removed": sorted(real_files()),
        }
        at = lie(lambda base: gone)
        assert requests[at]["base"] == held
        assert hub.refused == 1 and "not the one held" in hub.refused_last
        # Nothing removed; the next request asked for the whole listing, and the real one was taken.
        assert [r["base"] for r in requests[at + 1 :]] == [None]
        assert files_of_host_1() == real_files() and len(real_files()) == (SETS_BEFORE + 1) * RANKS_PER_HOST
        # A whole listing of MAX_FILES files is taken; one more file in a change is refused.
        sim.listings.changed.discard(1)
        entry = sim.listings.listing(1, seq)[0]["files"][0]
        many = [dict(entry, path=f"checkpoints/rank_8/x-{i}.ckpt") for i in range(ask.MAX_FILES)]
        # (with the version the digests name, or the hub would ask again at once)
        version = sim.listings.version(1, seq)
        lie(lambda base: {"files": many, "errors": [], "version": version, "base": None, "removed": []})
        assert len(files_of_host_1()) == ask.MAX_FILES and hub.refused == 1
        sim.listings.changed.add(1)
        one_more = [dict(entry, path="checkpoints/rank_8/x-extra.ckpt")]
        at = lie(
            lambda base: {"files": one_more, "errors": [], "version": "c" * 32, "base": base, "removed": []}
        )
        assert requests[at]["base"] == version
        assert hub.refused == 2 and f"more than {ask.MAX_FILES} files" in hub.refused_last
        assert [r["base"] for r in requests[at + 1 :]] == [None]
        assert files_of_host_1() == real_files()  # the real whole listing, asked for next
    finally:
        hub.close()
