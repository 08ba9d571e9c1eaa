"""A dashboard's view of a run served by agents: ``HubSource``, the source of ``RunState``'s rows.

``hub_source`` makes it when ``REDIS_URL`` is set and ``AGENTS`` is on or
``RUN`` names the run, and ``app.compose.build`` gives it to ``RunState``
(``source=``, ``app/run/sources.py``). Everything the page, the API, the
pushes and the stop service read from ``RunState`` (rows, deltas, summary,
run status, each rank's stop record) then comes from the hub
(``app/agent/hub.py``); the dashboard's own run directory holds no
heartbeats, only the flag the stop service writes, which the hub mirrors
to the agents. What only a hub can do (ask an agent for a rank's history,
a node's rows, its checkpoint files) is ``RunState.rank``/``node`` through
the source, and ``HubSource.checkpoint_files`` (the checkpoint service's
``remote``).
"""

from __future__ import annotations

import atexit
import gc
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from app.agent import ask
from app.agent import digest as dg
from app.agent.hub import Hub
from app.agent.listings import Listings, Remote
from app.cluster import redis_key
from app.run.health import Thresholds
from app.run.rows import with_age
from app.run.sources import Head, RowTable
from app.run.verdicts import VERDICTS
from trainer_bridge.rundir import redisbus, runfiles, safedirs
from trainer_bridge.rundir.listing import first_of


def run_name(config: Mapping[str, Any], run_dir: str | os.PathLike | None) -> str | None:
    """The run's name in Redis when this dashboard reads agents' digests, else None."""
    if not config.get("REDIS_URL"):
        return None
    if config.get("RUN"):
        return dg.check_run(config["RUN"])
    if config.get("AGENTS") and run_dir:
        return dg.check_run(Path(run_dir).resolve().name)
    return None


def hub_source(run_dir: str | None, config: Mapping[str, Any]) -> HubSource | None:
    """The hub of ``run_dir``'s agents when this dashboard reads their digests (``run_name``), else None."""
    name = run_name(config, run_dir)
    if name is None:
        return None
    # A hub keeps a row per rank and a digest per host, and replaces a few of
    # them every millisecond: with the default thresholds the collector scans
    # that live heap again and again (a third of the hub's CPU, measured with
    # tests/bench/agents.py); rows hold no cycles, so collect less often.
    gc.set_threshold(50_000, 50, 100)
    hub = Hub(
        config["REDIS_URL"], name, redis_key(config), float(config["AGENT_LOST_S"]), group=config["HUB_GROUP"]
    )
    # The hub's own consumer group goes when the process ends cleanly (a crashed one leaves a small group behind).
    atexit.register(hub.close)
    return HubSource(run_dir, config, hub)


class HubSource:
    """The rows, summary and run status of ``RunState`` from the agents' digests (a ``ViewSource``)."""

    def __init__(self, run_dir: str | os.PathLike | None, config: Mapping[str, Any], hub: Hub):
        self.hub = hub
        self.run_dir = Path(run_dir) if run_dir else None
        self.shown_dir = Path(safedirs.shown(run_dir)) if run_dir else None  # what the status line names
        self.straggler_ratio = Thresholds.from_config(config).straggler_ratio
        self.ask_timeout_s = float(config["AGENT_ASK_TIMEOUT_S"])
        self._counts = dict.fromkeys(VERDICTS, 0)  # the rows by verdict
        self._redis_error: str | None = None

    def attach(self, lock: threading.Lock, table: RowTable) -> None:
        self._lock = lock
        self._table = table
        # The checkpoint browser's listings of the agents, by version (``checkpoint_files``).
        self.listings = Listings(self.hub, lock, self.ask_timeout_s)

    def scan(self, now: float) -> Head:
        table = self._table
        try:
            changed = self.hub.poll(now)
            self._redis_error = None
        except redisbus.RedisUnavailable as e:
            changed, self._redis_error = set(), str(e)
        for rank in self.hub.removed:
            old = table.drop(rank)
            if old is not None:
                self._counts[old["health"]] -= 1
        self.hub.removed.clear()
        for rank in changed:
            if rank not in self.hub.rows:
                continue  # changed, then gone, in one read
            row = self.hub.shown(rank, now)
            old = table.get(rank)
            if old is not None:
                self._counts[old["health"]] -= 1
            self._counts[row["health"]] += 1
            table.put(rank, row)
        world = self.hub.world_size()
        summary = {"world_size": world, **self.hub.figures(dict(self._counts), self.straggler_ratio)}
        run = self._hub_status()
        self._mirror_flag(now)
        return Head(world, summary, run)

    def _mirror_flag(self, now: float) -> None:
        """Publish this dashboard's flag file (the stop service writes it), every scan."""
        if self.run_dir is None:
            return
        path = runfiles.flag_path(self.run_dir)
        try:
            st = path.stat()
            raw = runfiles.read_capped(path)
        except (OSError, runfiles.FileTooLarge):
            return
        try:
            request_id = runfiles.parse_flag(raw).request_id
        except runfiles.FlagError:
            return  # a flag this dashboard cannot read is not one to send its agents
        self.hub.publish_flag(raw, st.st_mtime_ns / 1e9, request_id, now)

    def _hub_status(self) -> dict:
        hub = self.hub
        lost = hub.lost
        if not hub.hosts:
            kind, message = (
                "waiting",
                f"No agent has published a digest for run {hub.run!r} yet: start `rankwatch agent "
                f"--run-dir RUN --redis URL --run {hub.run}` on every node.",
            )
        else:
            kind = "running"
            message = (
                f"{len(self._table)} ranks on {len(hub.hosts)} hosts, through their agents (run {hub.run!r})."
            )
        if lost:
            named = first_of(sorted(lost), 8)
            message += f" Agent lost on {named}: no digest for {hub.lost_after_s:g} s."
        if self._redis_error:
            message += f" Redis is unreachable ({self._redis_error}): the rows are as last heard."
        if hub.refused:
            message += f" {hub.refused} digest(s) or answer(s) refused, the last {hub.refused_last}."
        # An agent that refuses the hub's stop flag (issue 32, P4): a stop may not reach its node.
        refusing = {h: p for h, v in hub.hosts.items() if (p := v.digest.get("flag_problem"))}
        if refusing:
            host, why = sorted(refusing.items())[0]
            message += (
                f" The agent on {first_of(sorted(refusing), 8)} refuses the hub's stop flag in Redis "
                f"(on {host}: {why}): a stop may not reach that node; check what else writes to Redis."
            )
        return {
            "status": kind,
            "message": message,
            "run_dir": str(self.shown_dir or ""),
            "transport": "agents",
            "hosts": len(hub.hosts),
            "agents_lost": len(lost),
            "refused": hub.refused,
            "flag_refused_by": sorted(refusing),
        }

    def page_extras(self, rows: list[dict], now: float) -> dict:
        """The host rows of a page's ranks (an answer bounded by the page)."""
        owner = self.hub.owner
        return {"hosts": self.hub.host_rows(now, {owner[r["rank"]] for r in rows if r["rank"] in owner})}

    def heartbeats(self) -> dict[int, dict | None]:
        """What each rank's agent said of its stop record, state and start (the stop service reads these)."""
        # Each digest replaces a rank's record, never changes it: sharing them is safe.
        return dict(self.hub.beats)

    def started_at(self, rank: int) -> float | None:
        return (self.hub.beats.get(rank) or {}).get("started_at")

    # ------------------------------------------------------------------ asking the agents (app/agent/ask.py)
    def rank(self, rank: int, now: float) -> dict | None:
        """Rank ``rank``'s full row and chart history from its host's agent, else its digest row.

        ``agent`` says which: ``answered`` false (and ``error`` why) means the
        row is the digest's and there is no history. Waits at most
        ``AGENT_ASK_TIMEOUT_S``, never holding the view's lock meanwhile.
        """
        with self._lock:
            row = self._table.get(rank)
            host = self.hub.owner.get(rank)
            view = self.hub.hosts.get(host) if host is not None else None
            lost = view is not None and view.lost
        if row is None:
            return None
        if host is None or view is None:
            got: dict | str = f"no agent reports rank {rank}"
        elif lost:
            got = f"the agent on host {host} is lost: no digest for {self.hub.lost_after_s:g} s"
        else:
            got = ask.ask(self.hub, {host: ("rank", rank)}, self.ask_timeout_s)[host]
        if isinstance(got, dict):
            return {
                "now": now,
                "rank": with_age(got["row"], now),
                "history": got["history"],
                "agent": {"host": host, "answered": True, "error": None},
            }
        return {
            "now": now,
            "rank": with_age(row, now),
            "history": [],
            "agent": {"host": host, "answered": False, "error": got},
        }

    def node(self, host: str, now: float) -> dict | None:
        """Every row of ``host``'s ranks from its agent, else as its digests left them (``agent`` says which)."""
        with self._lock:
            view = self.hub.hosts.get(host)
            if view is None:
                return None
            lost = view.lost
            table = self._table.rows
            rows = [table[r] for r in sorted(view.ranks) if r in table]
        got: dict | str = (
            f"the agent on host {host} is lost: no digest for {self.hub.lost_after_s:g} s"
            if lost
            else ask.ask(self.hub, {host: ("node", None)}, self.ask_timeout_s)[host]
        )
        answered = isinstance(got, dict)
        return {
            "now": now,
            "host": host,
            "ranks": [with_age(row, now) for row in (got["rows"] if answered else rows)],
            "agent": {"host": host, "answered": answered, "error": None if answered else got},
        }

    def checkpoint_files(self, wait: bool = True) -> Remote:
        """Every agent's checkpoint files (``CheckpointService`` groups them with its own).

        Asked of an agent only when its digest's listing version changed
        (``app/agent/listings.py``); the same tuple while none did.
        """
        return self.listings.files(wait)
