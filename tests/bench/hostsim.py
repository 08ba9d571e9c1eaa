"""Simulated agents for the agent benchmarks: host digests, built as real agents build them, into Redis.

One builder, ``SimHosts.digest`` (rows from ``app.run.rows.make_row``
for hosts of ``RANKS_PER_HOST`` ranks, one row per digest from the rolling
resync, the figures of ``app.agent.runner.figures``, optional verdict
flips), and two senders of its digests, both run in processes of their own:

* ``live_digests`` builds, encodes, signs (``dg.encode``) and adds each
  digest when it is due, through redis-py pipelines. It needs about 40 us a
  digest, so on a 2-core machine it cannot keep 12,500 hosts at 1 Hz and
  takes CPU from the hub it feeds.
* ``prebuilt_digests`` builds every digest it will send before it starts
  (the same digests, their ``time`` the moment each is scheduled), already
  as raw RESP ``XADD`` commands, one run of bytes per slice of a second;
  then it writes each slice to a socket to ``redis-server`` when it is due
  and a thread reads and discards the replies (counting errors). Sending
  costs a ``sendall`` per slice, so the machine's cores go to
  ``redis-server`` and the hub.

Every sender of a benchmark sends from one moment, ``t0``: each first puts
on its ``reports`` queue how long it needs to get ready (``{"estimate":
...}``), then waits for the ``plan`` (an event, and the ``t0`` the parent
chose from the longest estimate); it reports again when it begins sending
(``{"t0": ...}``) and when it ends (how late it ran, Redis errors).
"""

from __future__ import annotations

import math
import multiprocessing
import os
import queue
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from urllib.parse import urlsplit

RUN = "bench"
KEY = "bench-key"
RANKS_PER_HOST = 8
SLICES = 10  # a prebuilt second is written in this many evenly spaced slices
# Checkpoint sets every simulated host holds before the first digest (steps 100, 200, 300), and
# how often (in digests) each saves one more: a real hub's checkpoint browser and retention.
SETS_BEFORE = 3
SAVE_EVERY = 30
STEPS_PER_SET = 100


class SimListings:
    """Every simulated host's checkpoint listing (``ask.file_listing``'s shape) and its version.

    Host ``i`` (of the job: ``first`` + its index) holds, by its digest
    number ``seq``, ``SETS_BEFORE`` sets plus one per ``save_every``
    digests, each a file per rank in the bridge's layout; its digests carry
    the listing's version (``dg.listing_version``), and ``answer_listings``
    answers a hub's request with the same listing. ``changed`` hosts hold
    one extra set from then on (the request-count test's one change).
    """

    def __init__(self, save_every: int = SAVE_EVERY):
        self.save_every = save_every
        self.changed: set[int] = set()
        self._versions: dict[tuple[int, int, bool], str] = {}

    def sets(self, seq: int) -> int:
        return SETS_BEFORE + (max(seq, 1) - 1) // self.save_every if self.save_every else SETS_BEFORE

    def listing(self, host: int, seq: int) -> tuple[dict, str]:
        """(listing, version) of job host ``host`` as of its digest ``seq``."""
        return self._listing(host, self.sets(seq) + (host in self.changed))

    def held(self, host: int, seq: int, version: str | None) -> dict | None:
        """The listing of version ``version`` if host ``host`` held it among its last few (as an
        agent keeps them, ``ask.ListingHistory``) by its digest ``seq``; else None."""
        from app.agent import ask

        if version is None:
            return None
        top = self.sets(seq) + (host in self.changed)
        for sets in range(top, max(0, top - ask.LISTING_HISTORY), -1):
            listing, v = self._listing(host, sets)
            if v == version:
                return listing
        return None

    def _listing(self, host: int, sets: int) -> tuple[dict, str]:
        from app.agent import digest as dg

        files = [
            listing_entry(r, g)
            for g in range(STEPS_PER_SET, (sets + 1) * STEPS_PER_SET, STEPS_PER_SET)
            for r in range(host * RANKS_PER_HOST, (host + 1) * RANKS_PER_HOST)
        ]
        listing = {"files": files, "errors": []}
        return listing, dg.listing_version(listing)

    def version(self, host: int, seq: int) -> str:
        """The version of ``listing(host, seq)`` (only the versions are kept: a digest carries no more)."""
        key = (host, self.sets(seq), host in self.changed)
        got = self._versions.get(key)
        if got is None:
            got = self._versions[key] = self.listing(host, seq)[1]
        return got


class SimAgent:
    """What ``ask.serve`` needs of an agent, for one simulated host: its name and its listing."""

    def __init__(self, name: str, listing: tuple[dict, str], key: bytes, held=lambda version: None):
        from trainer_bridge.rundir import redisbus

        # Its own key, derived from the master as the hub derives it to check (issue 32, P7).
        self.host, self.run, self.key = name, RUN, redisbus.own_key(key, redisbus.agent_label(name))
        self.asks_refused = 0
        self._listing, self._version = listing
        self._held = held  # version -> that listing, if the host still holds it

    def checkpoint_files(self, base: str | None = None) -> dict:
        from app.agent import ask

        return ask.files_answer(self._listing, self._version, base, self._held(base))

    def full_row(self, rank, now):
        return None  # the benchmarks' pages ask for no rank

    def node_rows(self) -> dict:
        return {"rows": []}


def answer_requests(client, listings: SimListings, seq_of) -> dict[str, int]:
    """Answer every request the hub queued for the simulated hosts (``ask.serve``, as an agent does);
    host -> how many it had. ``seq_of(host)``: the digest number the host has sent by now."""
    from app.agent import ask

    prefix = ask.ask_key(RUN, "")
    keys = list(client.scan_iter(match=prefix + "sim-*", count=10_000))
    if not keys:
        return {}
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.rpop(k, 10_000)
    popped = pipe.execute()
    answers = []
    now = time.time()
    for k, raws in zip(keys, popped, strict=True):
        if not raws:
            continue
        name = k.decode()[len(prefix) :]
        host = int(name.split("-")[1])
        seq = seq_of(host)
        agent = SimAgent(
            name,
            listings.listing(host, seq),
            KEY.encode(),
            lambda v, host=host, seq=seq: listings.held(host, seq, v),
        )
        answers += ask.serve(agent, raws, now)
        # ask.serve answers at most MAX_ASKS a call, as an agent per tick: the rest are answered too.
        for at in range(ask.MAX_ASKS, len(raws), ask.MAX_ASKS):
            answers += ask.serve(agent, raws[at:], now)
    pipe = client.pipeline(transaction=False)
    for key, value in answers:
        pipe.set(key, value, ex=ask.ANSWER_TTL_S)
    pipe.execute()
    return {k.decode()[len(prefix) :]: len(r) for k, r in zip(keys, popped, strict=True) if r}


def answer_listings(url: str, t0, stop, counts=None, save_every: int = SAVE_EVERY) -> None:
    """The simulated hosts' answers to the hub's listing requests, in a process of their own, until ``stop``.

    A host's digest number is known from the clock (its first digest goes
    at ``t0``, one a second), so each answer lists what its digests said.
    ``counts``: a queue that gets (time, requests answered) every second.
    """
    import redis

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    client = redis.Redis.from_url(url)
    listings = SimListings(save_every)
    total, reported = 0, time.monotonic()
    while not stop.is_set():
        seq = max(1, int(time.time() - t0.value) + 1)  # every host's digest number by now
        total += sum(answer_requests(client, listings, lambda host, seq=seq: seq).values())
        if counts is not None and time.monotonic() - reported >= 1:
            counts.put((time.time(), total))
            reported = time.monotonic()
        stop.wait(0.05)


class SimHosts:
    """Hosts ``first`` .. ``first + count - 1`` of a job: their rows, and the digest each sends.

    ``flip_hosts`` turn their first rank straggler, then healthy again, every
    ``flip_every`` digests (the window benchmark's latency).
    """

    def __init__(
        self,
        first: int,
        count: int,
        flip_hosts=frozenset(),
        flip_every: int = 0,
        listings: SimListings | None = None,
    ):
        from app.agent.runner import figures
        from app.run.health import Verdict
        from app.run.rows import make_row
        from tests.helpers.heartbeats import heartbeat

        self.first = first
        self.listings = listings if listings is not None else SimListings()
        self.flip_hosts, self.flip_every = flip_hosts, flip_every
        self.boot = time.time()
        self.world = (first + count) * RANKS_PER_HOST
        self.hosts = []
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
            # The figures of a steady host do not change: computed once.
            self.hosts.append((name, rows, figures(rows)))

    def digest(self, i: int, seq: int, now: float) -> tuple[dict, tuple[int, str] | None]:
        """Host ``i``'s digest number ``seq``, sent at ``now``; and ``(rank, verdict)`` if it flips one."""
        from app.agent import digest as dg

        name, rows, figs = self.hosts[i]
        row = rows[seq % RANKS_PER_HOST]
        row.update(time=round(now, 3), seq=seq, global_step=seq * 20, last_step_at=round(now, 3))
        sent = [row]
        flip = None
        if self.first + i in self.flip_hosts and seq % self.flip_every == 0:
            flipped = rows[0]
            flipped["health"] = "straggler" if flipped["health"] == "healthy" else "healthy"
            if flipped is not row:
                sent.append(flipped)
            flip = (flipped["rank"], flipped["health"])
        digest = {
            "v": dg.VERSION,
            "run": RUN,
            "host": name,
            "agent": f"{name}:1:bench",
            "boot": self.boot,
            "seq": seq,
            "time": now,
            "attempt": self.boot,
            "world_size": self.world,
            "ranks": [rows[0]["rank"], rows[-1]["rank"]],
            "n": RANKS_PER_HOST,
            "flag": None,
            "ckpt": self.listings.version(self.first + i, seq),
            "rows": [{"row": r, "stop": None, "started_at": self.boot, "sync_every": 16} for r in sent],
            **figs,
        }
        return digest, flip

    def __len__(self) -> int:
        return len(self.hosts)


def _planned_t0(reports, plan, first: int, estimate: float) -> float:
    """Say how long getting ready takes; the moment to send from, once the parent has chosen it."""
    reports.put({"first": first, "estimate": estimate})
    if plan is None:
        return time.time() + estimate
    planned, t0 = plan
    planned.wait()
    return t0.value


def live_digests(
    first: int,
    count: int,
    url: str,
    stop,
    reports,
    flips=None,
    horizon: float = 0,
    plan=None,
    save_every: int = SAVE_EVERY,
) -> None:
    """Sender: each host's digest built, signed and added when due, once a second (redis-py pipelines).

    ``flips``: ``(hosts, every, queue)``; each flip is put on ``queue`` as
    ``(rank, verdict, time)`` when its digest is added. ``horizon`` is unused
    (it sends until ``stop``).
    """
    import redis

    from app.agent import digest as dg

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    flip_hosts, flip_every, flip_queue = flips if flips is not None else (frozenset(), 0, None)
    sim = SimHosts(first, count, flip_hosts, flip_every, SimListings(save_every))
    client = redis.Redis.from_url(url)
    stream = dg.keys(RUN)[0]
    key = KEY.encode()
    _planned_t0(reports, plan, first, 0.0)
    reports.put({"first": first, "t0": time.time()})
    seq, behind = 0, 0.0
    next_at = time.monotonic()
    while not stop.is_set():
        seq += 1
        now = time.time()
        pipe = client.pipeline(transaction=False)
        for i in range(len(sim)):
            digest, flip = sim.digest(i, seq, now)
            if flip is not None:
                flip_queue.put((*flip, now))
            pipe.xadd(stream, dg.encode(digest, key), maxlen=dg.STREAM_MAXLEN, approximate=True)
            if i % 500 == 499:
                pipe.execute()
                pipe = client.pipeline(transaction=False)
        pipe.execute()
        next_at += 1.0
        wait = next_at - time.monotonic()
        if wait > 0:
            stop.wait(wait)
        else:
            behind = max(behind, -wait)
            next_at = time.monotonic()  # behind: say so in the figures, do not burst
    reports.put({"first": first, "late_s": behind, "errors": 0})


def command(*args: bytes) -> bytes:
    """One Redis command in RESP, as redis-py would write it."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def build(sim: SimHosts, t0: float, seconds: int, slices: int = SLICES) -> deque:
    """Every digest ``sim``'s hosts send in ``seconds`` from ``t0``: ``(at, RESP bytes, flips)`` per slice.

    Host ``i`` sends in slice ``i * slices // len(sim)`` of each second, its
    digest's ``time`` the slice's ``at``.
    """
    from app.agent import digest as dg

    key = KEY.encode()
    head = (b"XADD", dg.keys(RUN)[0].encode(), b"MAXLEN", b"~", str(dg.STREAM_MAXLEN).encode(), b"*")
    bounds = [math.ceil(k * len(sim) / slices) for k in range(slices + 1)]
    out = deque()
    for s in range(seconds):
        for k in range(slices):
            at = t0 + s + k / slices
            cmds, flipped = [], []
            for i in range(bounds[k], bounds[k + 1]):
                digest, flip = sim.digest(i, s + 1, at)
                fields = dg.encode(digest, key)
                cmds.append(command(*head, *(b for kv in fields.items() for b in (kv[0].encode(), kv[1]))))
                if flip is not None:
                    flipped.append(flip)
            out.append((at, b"".join(cmds), flipped))
    return out


def _discard_replies(sock: socket.socket, errors: list) -> None:
    """Read the replies to the commands and drop them, counting the error replies (``-ERR ...``)."""
    last = b"\n"
    while True:
        try:
            data = sock.recv(1 << 16)
        except OSError:
            return
        if not data:
            return
        seen = last + data
        n = seen.count(b"\n-")
        if n:
            errors[0] += n
            if errors[1] is None:
                at = seen.index(b"\n-") + 1
                errors[1] = seen[at : at + 200].split(b"\r\n")[0].decode(errors="replace")
        last = data[-1:]


def prebuilt_digests(
    first: int,
    count: int,
    url: str,
    stop,
    reports,
    flips=None,
    horizon: float = 60.0,
    plan=None,
    save_every: int = SAVE_EVERY,
) -> None:
    """Sender: ``horizon`` seconds of digests built first, then written as raw RESP when due.

    The first digest's time is chosen ahead (``plan``) from the time a
    sample of them took to build (with a margin), so that building ends
    before it; if it ends later anyway, the late slices go at once and the
    report says how late.
    ``flips``: as ``live_digests``, each flip's time is when its slice's bytes were written.
    """
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    flip_hosts, flip_every, flip_queue = flips if flips is not None else (frozenset(), 0, None)
    seconds = math.ceil(horizon)
    probe = SimHosts(first, min(count, 200))
    # Each host's listing version is made once and kept: the probe's first second would count it.
    build(probe, time.time(), 1)
    start = time.perf_counter()
    build(probe, time.time(), 1)
    per_digest = (time.perf_counter() - start) / len(probe)
    sim = SimHosts(first, count, flip_hosts, flip_every, SimListings(save_every))
    t0 = _planned_t0(reports, plan, first, 3 + 1.5 * per_digest * count * seconds)
    batches = build(sim, t0, seconds)
    built = time.time()
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port or 6379))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    errors: list = [0, None]
    reader = threading.Thread(target=_discard_replies, args=(sock, errors), daemon=True)
    reader.start()
    reports.put({"first": first, "t0": t0, "built_late_s": max(0.0, built - t0)})
    late = 0.0
    while batches and not stop.is_set():
        at, data, flipped = batches.popleft()  # sent bytes are freed as they go
        wait = at - time.time()
        if wait > 0 and stop.wait(wait):
            break
        sent_at = time.time()
        late = max(late, sent_at - at)
        sock.sendall(data)
        for rank, verdict in flipped:
            flip_queue.put((rank, verdict, sent_at))
    stop.wait()
    sock.close()
    reader.join(5)
    reports.put({"first": first, "late_s": late, "errors": errors[0], "error": errors[1]})


SENDERS = {"prebuilt": prebuilt_digests, "live": live_digests}


@dataclass
class Simulators:
    """The simulator processes of one benchmark, ``hosts`` split evenly between ``workers``."""

    stop: object
    procs: list
    reports: object
    # Kept while the senders run: freed, its shared memory would go to the next Value made here,
    # and a sender not yet woken would read that one's value as its t0.
    plan: tuple = ()

    @classmethod
    def start(
        cls,
        sender: str,
        hosts: int,
        workers: int,
        url: str,
        horizon: float,
        flips=None,
        save_every: int = SAVE_EVERY,
    ) -> Simulators:
        stop, reports = multiprocessing.Event(), multiprocessing.Queue()
        plan = (multiprocessing.Event(), multiprocessing.Value("d", 0.0))
        share = -(-hosts // workers)
        procs = [
            multiprocessing.Process(
                target=SENDERS[sender],
                args=(
                    i * share,
                    min(share, hosts - i * share),
                    url,
                    stop,
                    reports,
                    flips,
                    horizon,
                    plan,
                    save_every,
                ),
            )
            for i in range(workers)
            if i * share < hosts
        ]
        for p in procs:
            p.start()
        # One t0 for all: hosts of a process that began earlier would run out of digests earlier.
        try:
            estimates = [reports.get(timeout=600)["estimate"] for _ in procs]
        except BaseException:
            stop.set()
            for p in procs:
                p.kill()
            raise
        plan[1].value = time.time() + max(estimates)
        plan[0].set()
        return cls(stop, procs, reports, plan)

    def sending(self, timeout: float = 600) -> dict:
        """Wait until every process sends (its first digest is due); what they said when they began."""
        started = [self.reports.get(timeout=timeout) for _ in self.procs]
        for p in self.procs:
            # Built at the priority of the rest; sending, the hub's cost is measured, not the simulator's.
            os.setpriority(os.PRIO_PROCESS, p.pid, 10)
        t0 = max(r["t0"] for r in started)
        time.sleep(max(0.0, t0 - time.time()))
        return {"t0": t0, "built_late_s": max(r.get("built_late_s", 0.0) for r in started)}

    def end(self, server, wait_s: float = 10) -> dict:
        """Stop the processes and the dashboard; how late the senders ran and Redis's errors."""
        end_simulators(self.stop, self.procs, server, wait_s)
        done = []
        while True:
            try:
                report = self.reports.get(timeout=1)
            except queue.Empty:  # a killed sender leaves no report: the figures say so
                break
            if "late_s" in report:  # not a start report left unread
                done.append(report)
        errors = [r.get("error") for r in done if r.get("error")]
        return {
            "reported": len(done),
            "late_s": max((r["late_s"] for r in done), default=float("nan")),
            "errors": sum(r["errors"] for r in done),
            "error": errors[0] if errors else None,
        }


def end_simulators(stop, procs, server, wait_s: float = 10) -> None:
    """Tell the simulator processes to stop, kill those that do not, and stop the dashboard."""
    stop.set()
    for p in procs:
        p.join(wait_s)
        if p.is_alive():
            p.kill()
    server.stop()


def listing_entry(rank: int, g: int, status: str = "ok") -> dict:
    """An agent's listing entry (``ask.file_listing``'s) of rank ``rank``'s 1 MiB bridge file at step ``g``."""
    from trainer_bridge.rundir import runfiles

    return {
        "path": f"{runfiles.CHECKPOINT_DIR}/rank_{rank}/{runfiles.CHECKPOINT_PREFIX}-1_{g}.ckpt",
        "format": "ckpt",
        "bytes": 1 << 20,
        "mtime": 1.7e9 + g,
        "status": status,
        "reason": None if status == "ok" else "truncated",
        "epoch": 1,
        "step": g,
        "global_step": g,
        "step_source": "contents",
    }
