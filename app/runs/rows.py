"""One row per run: ``GET /api/runs``, the landing page and ``rankwatch runs``/``status --runs``.

A row is read from the run's engines, the ones its console uses (the open
container of a live or viewed run; for an idle run, ``app.compose.build``'s (``live=False``), opened
for the row and closed): the verdict counts and the global step are the
summary strip's, the run status is ``RunState``'s, the stop is
``StopService``'s, the newest complete set is the checkpoint index's.
Nothing is judged again here; ``run_state`` only names the run's state
from those answers. An idle run's row is kept while its directories do not
change (discovery's signature), so a root of finished runs is read once.
"""

from __future__ import annotations

import os
import threading
import time
import unicodedata
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from app import attempts, slurmqueue
from app.edge import params
from app.errors import RunNotFound
from app.ranks import charts
from app.run import slurmstop
from app.runs.diskuse import DiskUsage
from trainer_bridge.rundir import rollbacks

# copied: a copy of a run directory (trainer_bridge.rundir.copies), archived: it never needs attention.
STATES = ("training", "stopping", "stopped", "finished", "failed", "stalled", "idle", "copied")
# Verdicts that put a run first: a rank in trouble.
TROUBLE = ("straggler", "stalled", "dead", "node_lost", "failed", "corrupt")
SORTS = (
    "attention",
    "id",
    "state",
    "world_size",
    "global_step",
    "loss",
    "goodput",
    "restarts",
    "disk_bytes",
    "last_activity",
)
# Losses in a row's sparkline (the landing page draws them as an inline SVG).
SPARK_POINTS = 32
PER_PAGE_DEFAULT = 50
PER_PAGE_MAX = 500
MAX_QUERY = 200
# What one ``GET /api/runs`` spends reading idle runs not read yet; the rest answer as unread rows
# and the registry's loop reads them (``Rows.warm``). A root of thousands of finished runs, or a
# loaded host, must not hold the landing page for minutes.
READ_BUDGET_S = 1.0
UNREAD_MESSAGE = "not read yet: the dashboard reads a root's idle runs in the background"


def run_state(
    status: str, counts: Mapping[str, int], stop_state: str | None, live: bool, copied: bool = False
) -> str:
    """The run's state in one word, from ``RunState``'s run status, its verdict counts and the stop's state."""
    if copied:
        return "copied"
    if stop_state in ("requested", "stopping"):
        return "stopping"
    if counts.get("failed") or counts.get("dead") or counts.get("node_lost") or counts.get("corrupt"):
        return "failed"
    if status == "ended":
        if counts.get("exited"):
            return "stopped"
        return "finished" if counts.get("finished") else "failed"
    if counts.get("stalled"):
        return "stalled"
    if status in ("running", "starting") and live:
        return "training"
    return "idle"


def _stop_words(status: Mapping) -> str:
    """How the run's last stop went, for its row: what the console's stop panel says of it.

    ``rearmed`` is the flag's state, not the stop's: the dashboard clears the flag after a
    completed stop, and the row said "rearmed" of a stop every rank had obeyed.
    """
    if not status.get("request"):
        return "completed by an earlier launch"
    state = status.get("state")
    if state == "rearmed":
        return "completed" if status.get("summary") else "cleared before it completed"
    return state or "unknown"


def spike_facts(state) -> dict:
    """The loss-spike facts of a run's row: the open rules, the rollbacks made, a ladder given up."""
    lines = rollbacks.read_lines(state.run_dir)[0] if state.run_dir is not None else []
    last = lines[-1].kind if lines else None
    return {
        "spike_open": state.spike_view()["open"],
        "rollbacks": sum(ln.kind == "relaunched" for ln in lines),
        "spike_stuck": last in ("refused", "exhausted"),
    }


def looks(run_id: str) -> str:
    """What a run id looks like to a reader: NFKC-normalised (P11). ``café`` in NFC and in NFD
    (``e`` and a combining accent) are two directories, and two runs, that look the same."""
    return unicodedata.normalize("NFKC", run_id)


def fold(text: str) -> str:
    """``looks``, case-folded: what ``?q=`` compares, so that either form finds both."""
    return looks(text).casefold()


def with_lookalikes(rows: list[dict], entries) -> list[dict]:
    """Each row with ``lookalike``: None, or the other run ids that look the same (``looks``) and
    this id with every non-ASCII character escaped (``caf\\xe9`` against ``cafe\\u0301``), so that the
    table tells them apart (copies: idle rows are cached)."""
    by_look: dict[str, list[str]] = {}
    for run_id in entries:
        by_look.setdefault(looks(run_id), []).append(run_id)
    out = []
    for row in rows:
        others = sorted(i for i in by_look.get(looks(row["id"]), ()) if i != row["id"])
        escaped = row["id"].encode("ascii", "backslashreplace").decode()
        out.append({**row, "lookalike": {"others": others, "escaped": escaped} if others else None})
    return out


def row_from(
    run_id: str, entry, state, stop, checkpoints, now: float, tick_s: float, disk: DiskUsage | None = None
) -> dict:
    """The row of one run from its engines (``RunState``, ``StopService``, ``CheckpointService``).

    ``disk`` measures the bytes under the run directory (kept across calls for an open run).
    """
    state.refresh(now, tick_s)
    head = state.summary(now)
    summary = head["summary"]
    counts = {k: v for k, v in summary.get("counts", {}).items() if v}
    heartbeats, world = state.heartbeats()
    stop_state = last_stop = None
    if stop is not None and state.run_dir is not None:
        status = stop.status(now)
        stop_state = status.get("state")
        request = status.get("request") or status.get("last_stop")
        if isinstance(request, dict):
            last_stop = {k: request.get(k) for k in ("request_id", "requested_by", "requested_at", "reason")}
            last_stop["state"] = _stop_words(status)
    beats = [hb for hb in heartbeats.values() if hb]
    times = [hb["time"] for hb in beats if isinstance(hb.get("time"), (int, float))]
    newest = None
    if checkpoints is not None:
        cset = checkpoints.index(world).newest_complete
        if cset is not None:
            newest = {"id": cset.id, "global_step": cset.global_step, "mtime": cset.mtime}
    live = bool(entry.live) if entry is not None else head["run"]["status"] == "running"
    copied = bool(head["run"].get("copied"))
    name = run_state(head["run"]["status"], counts, stop_state, live, copied)
    spark = charts.loss_spark(state, SPARK_POINTS)
    spikes = spike_facts(state)
    disk = disk if disk is not None else DiskUsage()
    disk_bytes = disk.measure(state.run_dir, now)
    tried = attempts.answer(state.run_dir, heartbeats, state.job_ended(), state.log_attempts())["attempts"]
    good = state.goodput(tried, now)
    # Under Slurm: a preemption now would kill the job before every rank saved (app/run/slurmstop.py).
    slurm_stop = (
        slurmstop.verdict(str(state.run_dir), tried, heartbeats.values(), stop.estimated_s if stop else None)
        if state.run_dir is not None and slurmstop.kill_wait_of(tried) is not None
        else None
    )
    stop_too_slow = slurm_stop is not None and slurm_stop["fits"] is False and not state.job_ended()
    return {
        "id": run_id,
        "state": name,
        "live": live,
        "last_activity": entry.last_activity if entry is not None else summary.get("last_step_at"),
        "world_size": head["world_size"],
        "global_step": summary.get("global_step"),
        "throughput": summary.get("throughput"),
        # The newest loss of the lowest rank, and up to SPARK_POINTS of its recent ones (oldest first).
        "loss": spark[-1] if spark else None,
        "loss_spark": spark,
        # Bytes of the regular files under the run directory (a lower bound if disk_truncated).
        "disk_bytes": disk_bytes,
        "disk_truncated": disk.truncated,
        "health_counts": counts,
        # A run rankwatch launch gave up on needs a person, though every rank has ended; so does
        # an open loss spike (app/incidents/spikes.py) or a ladder that gave up (refused, exhausted).
        "needs_attention": not copied
        and (
            name in ("failed", "stalled")
            or any(counts.get(v) for v in TROUBLE)
            or bool(spikes["spike_open"])
            or spikes["spike_stuck"]
            or good["gave_up"] is not None
            or stop_too_slow
        ),
        # Said while the job runs: once it has ended there is nothing a preemption could kill.
        "slurm_stop": slurm_stop["text"] if stop_too_slow else None,
        "gave_up": good["gave_up"],
        "spike_open": spikes["spike_open"],
        "rollbacks": spikes["rollbacks"],
        "newest_complete_set": newest,
        "stop_state": stop_state,
        "last_stop": last_stop,
        "hosts": len({hb.get("host") for hb in beats}),
        # A time, not an age: an idle run's row is kept while its files do not change.
        "oldest_heartbeat_at": min(times) if times else None,
        # Launches of the job in this run directory (rankwatch/attempts.jsonl, else msrun's
        # logs starting over; 0 before the first).
        "attempts": len(tried),
        # The share of the run's wall time spent on steps that were kept (app/run/goodput.py), and
        # the launches after the first.
        "goodput": good["goodput"],
        "restarts": good["restarts"],
        "automatic_restarts": good["automatic_restarts"],
        "steps_lost": good["steps_lost"],
        "status_message": head["run"]["message"],
    }


def unread_row(run_id: str, entry) -> dict:
    """An idle run's row before its files are read: the fields of ``row_from``, only what discovery knows."""
    return {
        "id": run_id,
        "state": "idle",
        "live": False,
        "last_activity": entry.last_activity if entry is not None else None,
        "world_size": None,
        "global_step": None,
        "throughput": None,
        "loss": None,
        "loss_spark": [],
        "disk_bytes": None,
        "disk_truncated": False,
        "health_counts": {},
        "needs_attention": False,
        "gave_up": None,
        "slurm_stop": None,
        "newest_complete_set": None,
        "stop_state": None,
        "last_stop": None,
        "hosts": 0,
        "oldest_heartbeat_at": None,
        "attempts": 0,
        "spike_open": [],
        "rollbacks": 0,
        "goodput": None,
        "restarts": 0,
        "automatic_restarts": 0,
        "steps_lost": 0,
        "status_message": UNREAD_MESSAGE,
    }


class Rows:
    """The rows of a registry's runs, the idle ones cached by their discovery signature."""

    def __init__(self, registry, open_run: Callable, config: Mapping[str, Any]):
        """``open_run(path, config)``: an idle run's engines (``functools.partial(app.compose.build, live=False)``)."""
        self.registry = registry
        self._open_run = open_run
        self.config = config
        self._cache: dict[str, tuple[tuple, dict]] = {}
        # Open runs' disk measures, kept between rows (an idle run's row is kept instead).
        self._disk: dict[str, DiskUsage] = {}
        self._lock = threading.Lock()
        # Slurm's view of the runs (RANKWATCH_SLURM): one squeue for the whole table, per SLURM_POLL_S.
        self.slurm = slurmqueue.SlurmQueue(config["SLURM_POLL_S"]) if config.get("SLURM") else None

    def row(self, run_id: str, entry, now: float, deadline: float | None = None) -> dict:
        """The run's row; past ``deadline`` (``time.monotonic()``) an idle run not read yet is ``unread_row``."""
        tick_s = self.config["TICK_S"]
        rw = self.registry.peek(run_id)
        if rw is None and (entry is None or entry.live):
            try:
                rw = self.registry.get(run_id, touch=False)
            except RunNotFound:
                # Its directory was replaced since the scan (registry's pin): nothing is read through it.
                return unread_row(run_id, entry) if entry is not None else {"id": run_id, "state": "idle"}
        if rw is not None:
            with self._lock:
                disk = self._disk.setdefault(run_id, DiskUsage())
                # Its files may change while it is open (a set deleted from its console): read again once closed.
                self._cache.pop(run_id, None)
            return row_from(run_id, entry, rw.state, rw.stop, rw.checkpoints, now, tick_s, disk)
        with self._lock:
            cached = self._cache.get(run_id)
        if cached is not None and cached[0] == entry.signature:
            return cached[1]
        if deadline is not None and time.monotonic() > deadline:
            return unread_row(run_id, entry)
        # The engines for this row only (the audit trail opens a connection per call: nothing to close).
        run = self._open_run(entry.path, {**self.config, "RUN_DIR": entry.path})
        row = row_from(run_id, entry, run.state, run.stop, run.checkpoints, now, tick_s)
        with self._lock:
            self._cache[run_id] = (entry.signature, row)
        return row

    def warm(self, budget_s: float = 2.0) -> int:
        """Read idle runs' rows not kept yet, for at most ``budget_s``; how many were read.

        The registry's loop calls it after each scan, so the first visitor of a
        root of thousands of finished runs does not wait for all of them.
        """
        deadline = time.monotonic() + budget_s
        now, done = time.time(), 0
        for run_id, entry in self.registry.entries().items():
            if time.monotonic() > deadline:
                break
            if entry is None or entry.live:
                continue
            with self._lock:
                cached = self._cache.get(run_id)
            if cached is None or cached[0] != entry.signature:
                self.row(run_id, entry, now)
                done += 1
        return done

    def table(
        self,
        *,
        page: int = 1,
        per_page: int = PER_PAGE_DEFAULT,
        state: str | None = None,
        q: str | None = None,
        sort: str = "attention",
        now: float | None = None,
        budget_s: float | None = READ_BUDGET_S,
    ) -> dict:
        """One page of the rows, filtered and sorted (``GET /api/runs``'s body).

        Idle runs not read yet are read for at most ``budget_s`` (None: all of
        them, as the CLI does); the others are unread rows, counted in ``unread``.
        """
        now = time.time() if now is None else now
        deadline = None if budget_s is None else time.monotonic() + budget_s
        entries = self.registry.entries()
        with self._lock:
            for gone in set(self._cache) - set(entries):
                del self._cache[gone]
            for closed in [i for i in self._disk if self.registry.peek(i) is None]:
                del self._disk[closed]
        wanted = [i for i in entries if not q or fold(q) in fold(i)]
        rows = with_lookalikes([self.row(i, entries[i], now, deadline) for i in wanted], entries)
        if self.slurm is not None:
            rows = self._with_slurm(rows, entries, q)
        unread = sum(1 for r in rows if r["status_message"] is UNREAD_MESSAGE)
        counts = {s: 0 for s in STATES}
        for r in rows:
            counts[r["state"]] += 1
        attention = sum(1 for r in rows if r["needs_attention"])
        if state == "attention":
            rows = [r for r in rows if r["needs_attention"]]
        elif state:
            rows = [r for r in rows if r["state"] == state]
        desc = sort.startswith("-")
        key = sort.lstrip("-")
        if key == "attention":
            rows.sort(key=lambda r: (not r["needs_attention"], not r["live"], r["id"]))
        elif key == "state":
            rows.sort(key=lambda r: (STATES.index(r["state"]), r["id"]), reverse=desc)
        elif key == "id":
            rows.sort(key=lambda r: r["id"], reverse=desc)
        else:
            # None last whichever the direction.
            have = sorted(
                (r for r in rows if r[key] is not None), key=lambda r: (r[key], r["id"]), reverse=desc
            )
            rows = have + sorted((r for r in rows if r[key] is None), key=lambda r: r["id"])
        start = (page - 1) * per_page
        discovery = self.registry.discovery
        return {
            "runs": rows[start : start + per_page],
            "total": len(rows),
            "page": page,
            "per_page": per_page,
            "pages": max(1, -(-len(rows) // per_page)),
            "sort": sort,
            "state": state or None,
            "q": q or None,
            "counts": counts,
            "needs_attention": attention,
            "unread": unread,
            "discovery": discovery.status() if discovery is not None else None,
        }

    def _with_slurm(self, rows: list[dict], entries: dict, q: str | None) -> list[dict]:
        """Each row with its Slurm job (copies: idle rows are cached); a queued run not on disk yet as a row."""
        root = self.registry.discovery.root if self.registry.discovery is not None else None
        jobs = dict(self.slurm.by_run_dir())
        out = []
        for row in rows:
            entry = entries.get(row["id"])
            path = os.path.normpath(entry.path) if entry is not None else None
            out.append({**row, "scheduler": jobs.pop(path, None) if path else None})
        if root is None:
            return out
        for path, job in jobs.items():
            rel = os.path.relpath(path, root)
            if rel.startswith("..") or rel == "." or (q and q.casefold() not in rel.casefold()):
                continue
            # Before its first heartbeat: the queue's word is all there is.
            row = unread_row(rel, None)
            row["status_message"] = f"{job['state'].lower()} in Slurm's queue" + (
                f": {job['reason']}" if job.get("reason") else ""
            )
            out.append({**row, "scheduler": job})
        return out


class RunsQuery(params.Query):
    """``GET /api/runs``'s query parameters (and ``rankwatch runs``' options)."""

    page: Annotated[int, Field(gt=0, le=10**6, description="a positive integer")] = 1
    per_page: Annotated[int, Field(gt=0, description="a positive integer")] = PER_PAGE_DEFAULT
    state: Annotated[
        Literal[(*STATES, "attention")] | None,
        Field(description=f"one of {', '.join((*STATES, 'attention'))}"),
    ] = None
    q: Annotated[str | None, Field(max_length=MAX_QUERY, description=f"at most {MAX_QUERY} characters")] = (
        None
    )
    sort: Annotated[
        str,
        Field(
            pattern="^-?(" + "|".join(SORTS) + ")$",
            description=f"one of {', '.join(SORTS)} (a leading - for descending)",
        ),
    ] = "attention"


def parse_args(args: Mapping[str, str]) -> dict:
    """``page``, ``per_page``, ``state``, ``q`` and ``sort`` from a query string; ``BadRequest`` if bad."""
    query = params.validate(RunsQuery, {k: v for k, v in args.items() if v != ""})
    return query.model_dump() | {"per_page": min(query.per_page, PER_PAGE_MAX)}
