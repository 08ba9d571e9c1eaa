"""``rankwatch agent``: read this host's ranks, judge them, publish one digest a second.

The agent reads its host's run directory with the dashboard's own
``RunState``: the same reader (heartbeat files, msrun worker logs), the
same ``VerdictBoard`` and the same rows, and its process probes work, since
the ranks run here. It publishes only the ranks whose heartbeats name this
host, so agents on nodes that share a run directory do not claim each
other's ranks.

Each digest (``app/agent/digest.py``) carries the rows whose verdict, state
or stop stage changed since the last digest (at most ``MAX_ROWS``, the rest
next time), and a few more from a rolling resynchronisation that goes
through every rank once per ``resync_s``, so a hub that starts late or
missed a digest catches up; a hub that asks (``{p}:resync``) gets every row
over the next digests.

Redis away: digests wait in a bounded buffer (the oldest dropped first)
and go out in order once Redis answers; nothing here blocks or stops the
training, which never talks to the agent.

The stop: the hub mirrors its run directory's flag to ``{p}:flag``; when
its version is newer than the one applied, the agent writes the same flag
into its host's run directory with ``runfiles.write_flag``, the bridge's and
the dashboard's own writer, and its digests carry the ranks' stop stages.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import statistics
import time
import uuid
from collections import Counter, deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.agent import ask
from app.agent import digest as dg
from app.run import peers
from app.run.judging import ALIVE
from app.run.state import RunState
from app.run.verdicts import TERMINAL_STATES
from trainer_bridge.rundir import redisbus, runfiles
from trainer_bridge.rundir.ckptmeta import MetaCache

log = logging.getLogger("rankwatch.agent")

STEPPING = ("training", "stopping")


class Outbox(redisbus.Guarded):
    """The agent's one Redis connection: digests out (buffered while Redis is away), flag, resync and
    the hub's requests in (``app/agent/ask.py``), answers out."""

    def __init__(self, url: str, run: str, key: bytes | None, buffer: int, host: str, **kw):
        super().__init__(url, run, **kw)
        self.run = run
        self.key = key
        self.stream = dg.keys(run)[0]
        self.flag_key = dg.flag_key(run, host)
        self.resync_key = dg.resync_key(run, host)
        self.ask_key = ask.ask_key(run, host)
        self.pending: deque[dict] = deque(maxlen=buffer)
        self.dropped = 0
        self.sent = 0

    def send(self, digest: dict) -> tuple[bytes | None, bytes | None, list[bytes]] | None:
        """Queue ``digest`` and flush the queue; (flag value, resync value, the hub's requests), or None
        if Redis is away."""
        if len(self.pending) == self.pending.maxlen:
            if not self.dropped:
                log.warning(
                    "rankwatch agent: %d digests wait for redis; dropping the oldest from now on "
                    "(the hub catches up from the next digests' rows and resync)",
                    len(self.pending),
                )
            self.dropped += 1
        self.pending.append(dg.encode(digest, self.key))

        def flush(client):
            pipe = client.pipeline(transaction=False)
            for fields in self.pending:
                pipe.xadd(self.stream, fields, maxlen=dg.STREAM_MAXLEN, approximate=True)
            pipe.mget(self.flag_key, self.resync_key)
            # The oldest requests first (the hub pushes at the head); at most MAX_ASKS a tick.
            pipe.rpop(self.ask_key, ask.MAX_ASKS)
            results = pipe.execute(raise_on_error=False)
            for result in results[:-1]:
                if isinstance(result, Exception):
                    raise result
            # A key of another type where the requests go (something else writes to redis) is no
            # request, and must not cost the digests their round trip.
            asks = results[-1] if not isinstance(results[-1], Exception) else None
            return results[-2], asks

        try:
            (flag, resync), asks = self._call(flush)
        except redisbus.RedisUnavailable:
            return None
        self.sent += len(self.pending)
        self.pending.clear()
        return flag, resync, asks or []

    def answer(self, answers: list[tuple[str, bytes]]) -> None:
        """Put the answers where the hub waits for them (a hub that gave up lets them expire)."""

        def put(client):
            pipe = client.pipeline(transaction=False)
            for key, value in answers:
                pipe.set(key, value, ex=ask.ANSWER_TTL_S)
            pipe.execute()

        try:
            self._call(put)
        except redisbus.RedisUnavailable:
            pass  # the hub shows the digest's row instead


def _key(row: Mapping) -> tuple:
    return row["health"], row["state"], row["stop_stage"]


def _median(values: list[float]) -> float:
    return float(statistics.median(values))


class Agent:
    """One host's agent: ``tick(now)`` reads, judges, builds and sends one digest."""

    def __init__(
        self,
        run_dir: str | os.PathLike,
        url: str,
        run: str,
        config: Mapping[str, Any],
        *,
        key: bytes | None = None,
        host: str | None = None,
        interval_s: float = 1.0,
        resync_s: float = 10.0,
        buffer: int = 300,
    ):
        self.run_dir = Path(run_dir)
        self.run = dg.check_run(run)
        self.host = host or socket.gethostname()
        # This host's own key (a master key given derives it): it signs for this host only, and
        # a handed key of another host is a ValueError here (issue 32, P7).
        own = redisbus.own_key(key, redisbus.agent_label(self.host))
        self.state = RunState(self.run_dir, config, hostname=self.host)
        self.outbox = Outbox(url, run, key, buffer, self.host)
        self.ckpt_cache = MetaCache()
        # This node's checkpoint listing, re-walked at most every ``CHECKPOINT_SCAN_S``: its
        # version goes in every digest, the listing itself only to a hub that asks for it.
        self.scan_s = float(config.get("CHECKPOINT_SCAN_S", 2.0))
        self._listing: dict | None = None
        self.listing_version: str | None = None
        self._listings = ask.ListingHistory()  # the last few, so a hub gets what changed since its own
        self._listed_at = -math.inf
        self.asks_refused = 0
        self.key = own  # opens the hub's requests and flag, signs the answers
        self.interval_s = interval_s
        self.resync_s = resync_s
        self.token = f"{self.host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"[:100]
        self.boot = time.time()
        self.seq = 0
        self._sent: dict[int, tuple] = {}
        self._pending: dict[int, None] = {}  # changed ranks not sent yet, in order
        self._cursor = 0
        self.flag_version: float | None = None
        self._resync_seen: bytes | None = None  # the value read last
        self._resync_at = self.boot  # the newest request taken: one older than this agent is moot
        self.resyncs_refused = 0
        self.flag_error: str | None = None
        self._flag_seen: tuple[float, float] | None = None  # (version, publication time) taken last
        self.flags_refused = 0
        self._refused_at = -math.inf
        self._bad_rows: dict[int, str] = {}

    def tick(self, now: float) -> dict:
        """One round: scan, digest, send, apply the hub's flag. Returns the digest built."""
        self.state.scan(now)
        self._list_checkpoints()
        digest = self.build(now)
        answer = self.outbox.send(digest)
        if answer is not None:
            flag, resync, asks = answer
            answers = ask.serve(self, asks, now) if asks else []
            if answers:
                self.outbox.answer(answers)
            if resync is not None and resync != self._resync_seen:
                self._resync_seen = resync
                self.take_resync(resync)
            if flag is not None:
                self.apply_flag(flag, now)
        return digest

    def build(self, now: float) -> dict:
        rows = [row for row in self.state.rows() if row["host"] == self.host][: dg.MAX_HOST_RANKS]
        beats, world = self.state.heartbeats()
        by_rank = {row["rank"]: row for row in rows}
        for rank in set(self._sent) - set(by_rank):
            del self._sent[rank]
            self._pending.pop(rank, None)
        for rank, row in by_rank.items():
            if self._sent.get(rank) != _key(row):
                self._pending[rank] = None
        chosen = list(self._pending)[: dg.MAX_ROWS]
        changed = set(chosen)
        ordered = sorted(by_rank)
        if ordered:
            spread = max(1, math.ceil(len(ordered) * self.interval_s / self.resync_s))
            for _ in range(min(spread, len(ordered))):
                if len(chosen) >= dg.MAX_ROWS:
                    break
                self._cursor %= len(ordered)
                rank = ordered[self._cursor]
                self._cursor += 1
                if rank not in chosen:
                    chosen.append(rank)
        entries = []
        for rank in chosen:
            row = by_rank[rank]
            hb = beats.get(rank) or {}
            entry = {
                "row": row,
                "stop": hb.get("stop"),
                "started_at": hb.get("started_at"),
                "sync_every": hb.get("sync_every"),
            }
            self._sent[rank] = _key(row)
            self._pending.pop(rank, None)
            # One row the hub would refuse must not cost the whole host its digest.
            problem = dg.entry_problem(entry)
            if problem is None:
                entries.append(entry)
            elif self._bad_rows.get(rank) != problem:
                self._bad_rows[rank] = problem
                log.warning("rankwatch agent: rank %d's row left out of the digest (field %s)", rank, problem)
        self.seq += 1
        return {
            "v": dg.VERSION,
            "run": self.run,
            "host": self.host,
            "agent": self.token,
            "boot": self.boot,
            "seq": self.seq,
            "time": now,
            "attempt": min(
                (s for r in by_rank if (s := (beats.get(r) or {}).get("started_at"))), default=None
            ),
            "world_size": world or None,
            "ranks": [ordered[0], ordered[-1]] if ordered else None,
            "n": len(ordered),
            "flag": self.flag_version,
            # Said for a while after the last refusal, though good values came since: one
            # written over by something else in Redis every tick must not flicker out of sight.
            "flag_problem": self.flag_error[:300]
            if self.flag_error and now - self._refused_at <= dg.FLAG_FRESH_S
            else None,
            "ckpt": self.listing_version,
            "rows": entries,
            "changed": [e["row"]["rank"] for e in entries if e["row"]["rank"] in changed],
            **figures(rows),
        }

    def full_row(self, rank: int, now: float) -> dict | None:
        """Rank ``rank``'s row and chart history (``RunState.rank``), if it runs on this host."""
        found = self.state.rank(rank, now)
        if found is None or found["rank"]["host"] != self.host:
            return None
        row = {k: found["rank"][k] for k in dg.ROW_FIELDS}
        problem = dg.entry_problem({"row": row})
        if problem is not None:
            raise ValueError(f"rank {rank}'s row would be refused (field {problem})")
        history = [{k: ask.finite(v) for k, v in p.items()} for p in found["history"][-ask.MAX_HISTORY :]]
        return {"row": row, "history": history}

    def node_rows(self) -> dict:
        """Every row of this host's ranks as read now (those a hub would refuse left out, as in digests)."""
        rows = [row for row in self.state.rows() if row["host"] == self.host][: dg.MAX_HOST_RANKS]
        return {"rows": [row for row in rows if dg.entry_problem({"row": row}) is None]}

    def checkpoint_files(self, base: str | None = None) -> dict:
        """This host's checkpoint files for a hub's checkpoint browser, as ``ask.files_answer``
        makes them: what changed since the listing ``base`` the hub holds, or all of them."""
        self._list_checkpoints()
        return ask.files_answer(self._listing, self.listing_version, base, self._listings.get(base))

    def _list_checkpoints(self) -> None:
        """Re-walk this node's checkpoints if the last walk is ``scan_s`` old; a new version if they changed."""
        if time.monotonic() - self._listed_at < self.scan_s and self._listing is not None:
            return
        try:
            listing = ask.file_listing(self.run_dir, self.ckpt_cache)
        except Exception as e:  # a walk that fails must not cost the host its digest: said in the listing
            log.exception("rankwatch agent: cannot list the checkpoint files")
            listing = {"files": [], "errors": [f"the agent cannot list its checkpoint files: {e}"[:4000]]}
        self._listed_at = time.monotonic()
        if listing != self._listing:
            self._listing, self.listing_version = listing, dg.listing_version(listing)
            self._listings.keep(self.listing_version, listing)

    def take_resync(self, value: bytes) -> None:
        """Send every row again soon if ``value`` is a request of the hub newer than the last taken.

        Refused, and logged, when unsigned, badly signed (another host's key included) or
        malformed, or older than the last taken (a replay): nothing is sent for it.
        """
        try:
            at = dg.open_resync(value, self.key, self.run)
            if at < self._resync_at and at < self.boot:
                return  # a request from before this agent started: it sent everything at its start
            if at < self._resync_at:
                raise ValueError(
                    f"a resync request older than the last taken ({at:.3f} < {self._resync_at:.3f})"
                )
        except ValueError as e:
            self.resyncs_refused += 1
            if self.resyncs_refused == 1:
                log.warning(
                    "rankwatch agent: refused a resync request: %s; is something else writing to redis?", e
                )
            return
        if at > self._resync_at:
            self._resync_at = at
            self._pending.update(dict.fromkeys(sorted(self._sent)))

    def apply_flag(self, value: bytes, now: float | None = None) -> None:
        """Write the hub's flag into this host's run directory when it is newer than the one applied.

        Refused, and said (the log, ``flag_problem`` in every digest: the hub's page names this
        host), never applied: a value unsigned or badly signed, malformed, published more than
        ``FLAG_FRESH_S`` from this host's clock (a replay: the hub publishes every tick), with a
        version out of bounds, not bound to the request its flag names, or older than the one
        applied (issue 32, P4). A refused value changes nothing here: the flag written last stays.
        """
        now = time.time() if now is None else now
        try:
            raw, version, at, request_id = dg.open_flag(value, self.key, self.run, now)
            flag = runfiles.parse_flag(raw)
            if flag.request_id != request_id:
                raise ValueError("a flag value bound to another request than its flag names")
            if self._flag_seen is not None and version < self._flag_seen[0]:
                raise ValueError(
                    f"a flag older than the one applied (version {version:.3f} < {self._flag_seen[0]:.3f})"
                )
        except (ValueError, runfiles.FlagError) as e:
            self._refuse_flag(str(e))
            return
        if self._flag_seen is not None and (version, at) <= self._flag_seen:
            return  # the same publication again, or an earlier one of the same flag: nothing new
        if self.flag_version is not None and version <= self.flag_version:
            self._flag_seen = (version, at)
            return  # the hub's every-tick republication of the flag already written
        try:
            current = runfiles.read_flag(self.run_dir)
        except runfiles.FlagError:
            current = None
        if current is None or current.raw != flag.raw:
            extra = {k: v for k, v in flag.raw.items() if k != runfiles.FLAG_KEY}
            try:
                runfiles.write_flag(self.run_dir, flag.exit, **extra)
            except OSError as e:
                log.warning("rankwatch agent: cannot write the stop flag in %s: %s", self.run_dir, e)
                return  # tried again next tick: the version stays unapplied
            log.warning(
                "rankwatch agent: wrote the hub's stop flag (GracefulExit %d, request %s) in %s",
                int(flag.exit),
                flag.request_id,
                self.run_dir,
            )
        self.flag_version = version
        self._flag_seen = (version, at)

    def _refuse_flag(self, why: str) -> None:
        self.flags_refused += 1
        self._refused_at = time.time()
        if self.flag_error != why:
            log.error(
                "rankwatch agent: REFUSED the hub's stop flag in redis (a stop may not reach this node): %s",
                why,
            )
        self.flag_error = why


def figures(rows: list[dict]) -> dict:
    """The host's figures (counts, steps, step times, slowest and stalest rank) from its rows."""
    counts = Counter(row["health"] for row in rows)
    steps = sorted(g for row in rows if (g := row["global_step"]) is not None)
    alive = [row for row in rows if row["health"] in ALIVE and row["state"] in STEPPING]
    times = [
        (t, row["rank"])
        for row in alive
        if (t := row["step_time_mean_ms"] or row["step_time_ms"]) is not None
    ]
    live = [
        (row["time"], row["rank"])
        for row in rows
        if row["time"] is not None and row["state"] not in TERMINAL_STATES
    ]
    last = [t for row in rows if (t := row["last_step_at"]) is not None]
    rates = [r for row in alive if (r := row["samples_per_s"]) is not None]
    worst = peers.pick([r for _, r in times], [t for t, _ in times])
    return {
        "counts": dict(counts),
        "global_step": [steps[0], int(statistics.median_low(steps)), steps[-1]] if steps else None,
        "step_time_ms": [round(_median([t for t, _ in times]), 2), worst[1]] if times else None,
        "slowest": {"rank": worst[0], "step_time_ms": worst[1]} if worst else None,
        "stalest": min(live)[1] if live else None,
        "last_step_at": max(last) if last else None,
        "samples_per_s": round(sum(rates), 1) if rates else None,
        "stop_stages": dict(Counter(s for row in rows if (s := row["stop_stage"]) is not None)),
    }


def run_forever(agent: Agent, stopping=None) -> None:
    """Tick every ``interval_s`` until ``stopping`` is set; one bad tick is logged, never fatal."""
    deadline = time.monotonic()
    while stopping is None or not stopping.is_set():
        try:
            agent.tick(time.time())
        except Exception:
            log.exception("rankwatch agent: tick failed; the next one starts again from the files")
        deadline = max(deadline + agent.interval_s, time.monotonic() + agent.interval_s / 2)
        wait = max(0.0, deadline - time.monotonic())
        if stopping is not None:
            stopping.wait(wait)
        else:
            time.sleep(wait)
