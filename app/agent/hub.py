"""The hub: a dashboard's reader of the agents' host digests (``app/agent/digest.py``).

It reads the run's digest stream through a consumer group (``XREADGROUP``
with ``NOACK``: Redis keeps no pending list). By default each dashboard
process has a group of its own (removed when it stops), so each reads
every digest and shows every host.
Processes given the same group name (``HUB_GROUP``) split the entries
between them instead: the load divides. The split is by entry, not by host,
so each process hears a host's agent about once every N intervals (N
processes), which keeps every host's figures fresh enough in each (N
intervals must stay well under ``lost_after_s``, or hosts flap to agent
lost). What the split would lose is a change: an agent sends a rank's row
once when its verdict, state or stop stage changes (the digest lists it in
``changed``), and only one process reads that digest. So the process that
reads a digest with a change forwards it, as it came and still signed, to
the group's ``{p}:peers`` stream, and every process of the group applies its
peers' forwards: each shows every host and every change within a tick, and
each checks and applies only its share of the routine digests. There is no
leader in this path: a leader that merged partial views would add a hop
and a single point of failure for what every process can read itself.
Each digest updates its host's figures and the rows
it carries; a rank's row is the one its host's agent last sent.

**Agent lost, node lost** (``app/agent/lost.py``): a host whose agent sent no
digest for ``lost_after_s`` is ``agent lost``, and the other hosts' progress
says whether its node is gone. While Redis is unreachable nobody can be
heard, so nobody is judged lost; the clocks restart when it returns.

**Refused digests** are counted and the last reason kept (never their
content): too big, malformed, badly signed or unsigned with a key, for a
rank another host's live agent owns, or not newer than the last one
accepted from that host (a replay: ``(boot, seq)`` orders each agent's
digests, across its restarts). A refused digest changes nothing else.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid

from app.agent import digest as dg
from app.agent.lost import HostView, judge_lost, shown_row
from app.run import peers
from app.run.judging import ALIVE
from app.run.verdicts import STEPPING_STATES
from trainer_bridge.rundir import redisbus

log = logging.getLogger(__name__)


class Hub(redisbus.Guarded):
    """Every host's newest digest and every rank's newest row, for one run."""

    def __init__(
        self,
        url: str,
        run: str,
        key: bytes | None,
        lost_after_s: float,
        *,
        group: str = "",
        batch: int = 2000,
        **kw,
    ):
        super().__init__(url, run, **kw)
        self.run = dg.check_run(run)
        self.key = key  # the master: each agent's key is derived from it (agent_key)
        self.keys = redisbus.Verifier(key)
        self.lost_after_s = lost_after_s
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.own_group = not group
        self.group = group or f"hub:{self.consumer}"
        self.batch = batch
        self.stream, self.flag_key, _ = dg.keys(run)
        self._resync_for: set[str] = set()  # the hosts whose agents to ask for all their rows
        self.peers = dg.peers_key(self.run)
        self._peers_from: bytes | None = None  # the last peers' entry read; None: not joined yet
        self._forward: list[dict] = []  # digests with a change, for the other processes of the group
        self.forwarded = 0  # the peers' digests applied here
        self.row_seq: dict[int, tuple[float, int]] = {}  # rank -> (boot, seq) of the digest its row came in
        self.hosts: dict[str, HostView] = {}
        self.rows: dict[int, dict] = {}  # rank -> the row its agent last sent
        self.beats: dict[
            int, dict
        ] = {}  # rank -> {stop, started_at, sync_every, state, ...} for the stop service
        self.owner: dict[int, str] = {}
        # Counts the ranks that moved or left a host: the checkpoint index's misplaced files change.
        self.owner_changes = 0
        self.removed: set[int] = set()  # ranks gone from every host since the caller last took them
        # Hosts whose checkpoint-listing version (``ckpt``) or agent-lost state changed since
        # ``HubSource.checkpoint_files`` last took them: it asks only those agents for their listing.
        self.listings_changed: set[str] = set()
        # The hosts heard, the longest silent first (a digest moves its host to the end), and the
        # hosts lost: each poll finds the newly lost at the front, without a pass over every host.
        self._heard: dict[str, None] = {}
        self.lost: set[str] = set()
        self._world: int | None = None  # world_size(), until a host's ranks or declared size change
        self.accepted = 0
        self.refused = 0
        self.refused_last: str | None = None
        self.ask_timeouts = 0  # requests to agents unanswered within the bound (app/agent/ask.py)
        self.listings_pending = 0  # checkpoint-listing requests not answered yet (app/agent/listings.py)
        # Entries the listings' answers carried (files, and paths removed): what they cost the hub.
        self.listing_entries = 0
        self._grouped = False
        self._down_since: float | None = None
        self._flag_sent: tuple | None = None

    # ------------------------------------------------------------------ reading
    def poll(self, now: float) -> set[int]:
        """Read what came since the last call; the ranks whose shown row may have changed.

        Raises RedisUnavailable when Redis cannot be reached.
        """
        try:
            entries = self._call(self._read)
        except redisbus.RedisUnavailable:
            if self._down_since is None:
                self._down_since = now
            self._grouped = False
            raise
        changed: set[int] = set()
        if self._down_since is not None:
            # Nobody could be heard while Redis was away: every agent's clock starts again now.
            for host, view in self.hosts.items():
                view.heard_at = max(view.heard_at, now)
                self._heard[host] = None
                if view.lost:
                    changed |= self._back(host, view)
            self._down_since = None
            self._flag_sent = None
        for fields, forwarded in entries:
            changed |= self._apply(fields, now, forwarded)
        if self._resync_for:
            self._ask_resync()
        if self._forward:
            try:
                self._call(self._send_forward)
            except redisbus.RedisUnavailable:
                del self._forward[: -dg.MAX_FORWARD]  # kept for the next poll, bounded
        silent = []
        for host in self._heard:
            if now - self.hosts[host].heard_at <= self.lost_after_s:
                break  # every host after it was heard later
            silent.append(host)
        for host in silent:
            del self._heard[host]  # back in the order with its next digest
            changed |= self._lose(host, self.hosts[host], now)
        changed |= self._judge_lost(now)
        return changed

    def _lose(self, host: str, view: HostView, now: float) -> set[int]:
        view.lost = True
        self.lost.add(host)
        self.listings_changed.add(host)
        log.warning(
            "rankwatch hub: the agent on host %s sent no digest for %.0f s: agent lost",
            host[:100],
            now - view.heard_at,
        )
        return view.ranks

    def _back(self, host: str, view: HostView) -> set[int]:
        view.lost, view.gone, view.evidence = False, None, ""
        self.lost.discard(host)
        self.listings_changed.add(host)
        log.warning("rankwatch hub: the agent on host %s is back", host[:100])
        return view.ranks

    def _judge_lost(self, now: float) -> set[int]:
        """Node lost or only the agent (``lost.judge_lost``); O(hosts) per poll, and only while some host is lost."""
        if not self.lost:
            return set()
        return judge_lost([self.hosts[h] for h in self.lost], self.hosts.values(), self.lost_after_s, now)

    def _read(self, client) -> list[dict]:
        import redis

        if not self._grouped:
            try:
                client.xgroup_create(self.stream, self.group, id="$", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise
            # A hub that starts (or lost Redis's state) asks every agent for all its rows: each known
            # now, and each first heard later that started before (``_apply``).
            self._resync_for.update(self.hosts)
            self._grouped = True
            self._peers_from = None
        out: list[tuple[dict, bool]] = []
        while True:
            try:
                # NOACK: a digest is used once, when read, and never read again (a newer one from its
                # host supersedes it), so Redis need keep no pending list for it, nor we acknowledge it.
                got = client.xreadgroup(
                    self.group, self.consumer, {self.stream: ">"}, count=self.batch, noack=True
                )
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                self._grouped = False  # Redis restarted empty: the group is made again next tick
                return out
            entries = got[0][1] if got else []
            out.extend((fields, False) for _, fields in entries)
            if len(entries) < self.batch or len(out) >= 10 * self.batch:
                break
        if not self.own_group:
            out.extend(self._read_peers(client))
        return out

    def _read_peers(self, client) -> list[tuple[dict, bool]]:
        """The digests the group's other processes forwarded since the last call."""
        if self._peers_from is None:  # joining: from the stream's end, as the group does
            last = client.xrevrange(self.peers, count=1)
            self._peers_from = last[0][0] if last else b"0-0"
        out: list[tuple[dict, bool]] = []
        me = self.consumer.encode()
        while True:
            got = client.xread({self.peers: self._peers_from}, count=self.batch)
            entries = got[0][1] if got else []
            if entries:
                self._peers_from = entries[-1][0]
            out.extend((fields, True) for _, fields in entries if fields.get(b"c") != me)
            if len(entries) < self.batch or len(out) >= 10 * self.batch:
                return out

    def _send_forward(self, client) -> None:
        pipe = client.pipeline(transaction=False)
        for fields in self._forward:
            pipe.xadd(
                self.peers, {**fields, b"c": self.consumer.encode()}, maxlen=dg.MAX_FORWARD, approximate=True
            )
        pipe.execute()
        self._forward.clear()

    def refuse(self, why: str) -> set[int]:
        """Count a refused digest or answer (``app/agent/ask.py``) and keep why; nothing else changes."""
        self.refused += 1
        self.refused_last = why
        if self.refused == 1:
            log.warning("rankwatch hub: refused %s: is something else writing to redis?", why)
        return set()

    def _apply(self, fields: dict, now: float, forwarded: bool = False) -> set[int]:
        """Take one digest: read from the group (``forwarded`` False) or forwarded by a peer process."""
        try:
            digest = dg.parse(fields, self.run, self.keys)
        except dg.Refused as e:
            return self.refuse(str(e))
        host = digest["host"]
        view = self.hosts.get(host)
        order = (digest["boot"], digest["seq"])
        newer = view is None or order > (view.digest["boot"], view.digest["seq"])
        if not newer and not forwarded:
            return self.refuse(
                f"a digest for host {host[:100]!r} not newer than the last one (a replay, or an older agent)"
            )
        entries = digest.pop("rows")  # the host view keeps the figures, not the rows
        if digest.pop("changed", None) and not forwarded and not self.own_group:
            self._forward.append(fields)
        self.forwarded += forwarded
        # A row newer than this digest may have come from a peer's forward: older rows are not taken.
        entries = [e for e in entries if self.row_seq.get(e["row"]["rank"], (0.0, 0)) < order]
        for entry in entries:
            owner = self.owner.get(entry["row"]["rank"])
            if owner is not None and owner != host and not self.hosts[owner].lost:
                return self.refuse(
                    f"a digest for host {host[:100]!r} claiming rank {entry['row']['rank']}, "
                    f"whose agent on {owner[:100]!r} reports"
                )
        if newer:
            if view is None:
                view = self.hosts[host] = HostView(digest, now)
                if digest["seq"] > 1:  # its agent ran before: this hub missed rows its first digest had
                    self._resync_for.add(host)
                self.listings_changed.add(host)
                self._world = None
            else:
                if view.digest.get("ckpt") != digest.get("ckpt"):
                    self.listings_changed.add(host)
                if view.digest["world_size"] != digest["world_size"]:
                    self._world = None
            view.digest, view.heard_at = digest, now
            self._heard.pop(host, None)
            self._heard[host] = None
            self.accepted += not forwarded
        changed = set()
        for entry in entries:
            row = entry["row"]
            rank = row["rank"]
            old = self.owner.get(rank)
            if old != host:
                if old is not None:
                    self.hosts[old].ranks.discard(rank)
                self.owner_changes += 1
                self._world = None
            self.owner[rank] = host
            view.ranks.add(rank)
            self.rows[rank] = row
            self.row_seq[rank] = order
            self.beats[rank] = {
                "stop": entry.get("stop"),
                "started_at": entry.get("started_at"),
                "sync_every": entry.get("sync_every"),
                "state": row["state"],
                "time": row["time"],
                "step_time_mean_ms": row["step_time_mean_ms"],
                "step_time_ms": row["step_time_ms"],
            }
            changed.add(rank)
        if not newer:
            return changed
        # Ranks the host no longer has (a relaunch placed fewer, or others, on it) leave the view.
        low, high = digest["ranks"] or (0, -1)
        for rank in [r for r in view.ranks if not low <= r <= high]:
            view.ranks.discard(rank)
            del self.owner[rank], self.rows[rank], self.beats[rank]
            self.owner_changes += 1
            self._world = None
            self.row_seq.pop(rank, None)
            self.removed.add(rank)
            changed.discard(rank)
        if view.lost:
            changed |= self._back(host, view)
        return changed

    # ------------------------------------------------------------------ what is shown
    def shown(self, rank: int, now: float) -> dict:
        """Rank ``rank``'s row as the page shows it: its agent's, or ``agent_lost`` with its last figures."""
        return shown_row(self.rows[rank], self.hosts[self.owner[rank]], now)

    def host_rows(self, now: float, hosts) -> list[dict]:
        """One row per host of ``hosts``: its agent, whether it reports, and its digest's figures."""
        out = []
        for host in sorted(hosts):
            view = self.hosts[host]
            d = view.digest
            out.append(
                {
                    "host": host,
                    "status": "agent_lost" if view.lost else "reporting",
                    "agent": d["agent"],
                    "digest_age_s": round(max(0.0, now - view.heard_at), 1),
                    "seq": d["seq"],
                    "attempt": d["attempt"],
                    "ranks": list(d["ranks"]) if d["ranks"] else None,
                    "n": d["n"],
                    "counts": dict(d["counts"]),
                    "global_step": list(d["global_step"]) if d["global_step"] else None,
                    "step_time_ms": list(d["step_time_ms"]) if d["step_time_ms"] else None,
                    "slowest": d["slowest"],
                    "stalest": d["stalest"],
                    "stop_stages": dict(d["stop_stages"]),
                    "flag": d.get("flag"),
                }
            )
        return out

    def figures(self, counts: dict, threshold_ratio: float) -> dict:
        """The summary strip's job-wide figures: from the hosts' digests, the slowest rank from the rows."""
        live = [v.digest for v in self.hosts.values() if not v.lost]
        # The board's rule (app/run/peers.py), over the live hosts' rows alive and stepping, by
        # their step time: the rank is picked from the same figures as its peer median. (It was
        # the digests' slowest, which a row newer or older than its digest could contradict.)
        ranks, costs = [], []
        for r, row in self.rows.items():
            if (
                row["health"] in ALIVE
                and row["state"] in STEPPING_STATES
                and (cost := row["step_time_mean_ms"] or row["step_time_ms"]) is not None
                and not self.hosts[self.owner[r]].lost
            ):
                ranks.append(r)
                costs.append(cost)
        worst = peers.slowest_rank(
            ranks,
            costs,
            "step",
            straggler=lambda r: self.rows[r]["health"] == "straggler",
            threshold_ratio=threshold_ratio,
        )
        rates = [d["samples_per_s"] for d in live if d["samples_per_s"] is not None]
        lasts = [d["last_step_at"] for d in live if d["last_step_at"] is not None]
        steps = [d["global_step"][2] for d in live if d["global_step"] is not None]
        return {
            "counts": counts,
            "reported": len(self.rows),
            "slowest": worst,
            "throughput": round(sum(rates), 1) if rates else None,
            "last_step_at": max(lasts) if lasts else None,
            "global_step": max(steps) if steps else None,
        }

    def status(self) -> dict:
        """This process's reading of the digests, for ``GET /api/health``."""
        return {
            "run": self.run,
            "group": self.group,
            "hosts": len(self.hosts),
            "agents_lost": len(self.lost),
            "accepted": self.accepted,
            "forwarded": self.forwarded,
            "refused": self.refused,
            "refused_last": self.refused_last,
            "ask_timeouts": self.ask_timeouts,
            "listings_pending": self.listings_pending,
            "listing_entries": self.listing_entries,
            # Agents that refuse the hub's stop flag read from Redis (issue 32, P4).
            "flag_refused_by": sorted(h for h, v in self.hosts.items() if v.digest.get("flag_problem")),
        }

    def world_size(self) -> int:
        """The largest world size a host declares, or the highest rank + 1 (recounted only when they change)."""
        if self._world is None:
            declared = max((v.digest["world_size"] or 0 for v in self.hosts.values()), default=0)
            self._world = max(declared, max(self.rows, default=-1) + 1)
        return self._world

    # ------------------------------------------------------------------ the stop, to the agents
    def publish_flag(
        self, raw: bytes, version: float, request_id: str | None, now: float | None = None
    ) -> None:
        """Put the hub's flag (its file's bytes) where the agents read it, every tick (issue 32, P4).

        Every tick, not once per change: a value written over it in Redis (an older signed one,
        a forged one) stands for one tick at most. Each carries the request id its flag names and
        the time it was published, so an agent can refuse a replay (``digest.open_flag``).
        """
        at = time.time() if now is None else now
        values = {
            dg.flag_key(self.run, host): dg.flag_value(
                raw, version, self.agent_key(host), self.run, request_id=request_id, at=at
            )
            for host in self.hosts
        }
        if not values:
            return  # no agent heard yet: nobody to publish to
        try:
            self._call(lambda client: client.mset(values))
        except redisbus.RedisUnavailable:
            return
        self._flag_sent = (raw, version)

    def _ask_resync(self) -> None:
        """Ask the agents of ``_resync_for`` for all their rows, each request signed for its host only."""
        at = time.time()
        values = {
            dg.resync_key(self.run, h): dg.resync_value(self.agent_key(h), self.run, at)
            for h in self._resync_for
        }
        try:
            self._call(lambda client: client.mset(values))
        except redisbus.RedisUnavailable:
            return  # asked again at the next poll
        self._resync_for.clear()

    def agent_key(self, host: str) -> bytes | None:
        """The key of ``host``'s agent (derived from the master): it signs only for that host."""
        return self.keys.key(redisbus.agent_label(host))

    def close(self) -> None:
        """Leave the group (remove this process's own); quietly, since Redis may be gone at exit."""
        client = self._client
        if client is not None:
            try:
                if self.own_group:
                    client.xgroup_destroy(self.stream, self.group)
                else:
                    client.xgroup_delconsumer(self.stream, self.group, self.consumer)
            except Exception:  # a group or consumer left behind is harmless; shutdown must not fail on it
                pass
        super().close()
