"""The dashboard's view of a run, rebuilt from the run directory alone.

``RunState.scan`` is called once per watcher tick (and by HTTP requests when
the view is older than a tick). Its cost follows what changed, not the size
of the job:

* ``app.run.heartbeats`` stats every heartbeat file and reads only the changed ones;
* ``app.run.judging`` re-judges only the ranks whose verdict can have changed
  (a vector pass over all ranks finds them) and keeps the summary's
  figures in arrays;
* a rank's process is probed (psutil) only when its heartbeat is late;
* rows are rebuilt only for ranks whose heartbeat or verdict changed, and
  ``take_delta`` sends only the fields that changed since the last push.

A restarted dashboard rebuilds the same view: the rows from the heartbeat
files, the charts from the ``rank_{r}.history.jsonl`` tails.

Ranks without the bridge are read from msrun's worker logs (``app.run.logmode``),
which yields the same validated heartbeats; a rank's own heartbeat file,
when there is one, wins over its log.

A source other than the run directory (the agents' hub) replaces that read
when given as ``source``: ``app/run/sources.py`` says what it provides.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from app.attempts import LaunchWatch, launches
from app.run import goodput, logmode, spikes
from app.run.ending import RankEnds
from app.run.health import Thresholds
from app.run.heartbeats import ProcessProbe, RankSlot, RunReader, probe_process
from app.run.history import RunHistory
from app.run.jobend import JobFacts, StopInputs
from app.run.judging import VerdictBoard
from app.run.logmode.kept import KeptLink
from app.run.rows import make_row, with_age
from app.run.sources import RowTable, ViewSource
from app.run.status import StatusFacts, run_status
from app.run.stepcost import RankReport
from app.run.verdicts import TERMINAL_STATES, WORST_FIRST
from trainer_bridge.rundir import copies, safedirs

_SEVERITY = {v: i for i, v in enumerate(WORST_FIRST)}


class RunState:
    """The live view of one run directory; thread-safe (the watcher scans, requests read)."""

    def __init__(
        self,
        run_dir: str | os.PathLike | None,
        config: Mapping[str, Any],
        *,
        probe: ProcessProbe = probe_process,
        hostname: str | None = None,
        redis=None,
        source: ViewSource | None = None,
    ):
        self.run_dir = Path(run_dir) if run_dir else None
        # A run under --runs is its descriptor (app/runs/pinned.py): held open while this reads by it.
        self._pinned = run_dir
        # What the status line names (under --runs, the run's path as found, not its descriptor's).
        self.shown_dir = Path(safedirs.shown(run_dir)) if run_dir else None
        self.thresholds = Thresholds.from_config(config)
        self.points = int(config["HISTORY_POINTS"])
        self.bucket_s = float(config["CHART_BUCKET_S"])
        self.check_after_s = float(config["PROCESS_CHECK_AFTER_S"])
        self.bridge_grace_s = float(config["BRIDGE_GRACE_S"])
        self.run_points = int(config["RUN_HISTORY_POINTS"])
        self._probe = probe
        self._hostname = hostname or socket.gethostname()
        self._lock = threading.Lock()
        self.scanned_at: float | None = None
        self._reader = RunReader(self.run_dir, self.thresholds.straggler_window, self.points, redis=redis)
        log_dir = logmode.resolve_dir(self.run_dir, str(config.get("LOG_DIR", "")))
        self._logs = (
            logmode.LogView(
                log_dir, self._hostname, lambda: RankSlot(self.thresholds.straggler_window, self.points)
            )
            if log_dir is not None
            else None
        )
        self._kept: KeptLink | None = None  # where the log-mode attempts are kept (keep_log_attempts)
        # The loss-spike detector's thresholds, and whether it runs (SPIKE_MODE; app/incidents/spikes.py sets them).
        self._spike_params = spikes.Params()
        self.spikes_on = True
        self._table = RowTable()  # the rows and what was pushed of them (take_delta)
        self._clear()
        # Nobody has seen anything yet, and each client gets a snapshot when it
        # connects: the first tick's changes can go out as a plain delta.
        self._pushed.needs_snapshot = False
        # Where the rows come from instead of the run directory (app/run/sources.py), or None.
        self.source = source
        if source is not None:
            source.attach(self._lock, self._table)

    def _clear(self) -> None:
        self._reader.clear()
        self._board = VerdictBoard(self.thresholds)
        self._world = 0
        self._from_log: set[int] = set()  # ranks shown from their worker log
        self._beats_expected = False  # ...while the bridge may still report (LogView.heartbeats_expected)
        # Which ranks have ended and whether msrun has, from their files and this host's probes.
        self._ends = RankEnds(self._hostname, self._probe, self.check_after_s)
        self._table.reset()
        self._rows, self._pushed = self._table.rows, self._table.pushes  # its parts, named as they are used
        self._summary: dict = {}
        self._run: dict = {}
        self._launches = LaunchWatch()  # two launches writing at once (app/attempts.py)
        self._run_history = RunHistory(self.run_points)  # the whole-run charts (app/run/history.py)
        self._spikes = spikes.Detector(self._spike_params)

    @property
    def _slots(self) -> dict[int, RankSlot]:
        return self._reader.slots

    def _log_slots(self) -> dict[int, RankSlot]:
        return self._logs.slots if self._logs is not None else {}

    def _slot(self, rank: int) -> RankSlot | None:
        """The slot a rank is shown from: its heartbeat file's, else its worker log's."""
        return self._slots.get(rank) or self._log_slots().get(rank)

    def _world_size(self) -> int:
        """The reader's (job.json's, else the heartbeats'); without job.json, the logs' too."""
        world = self._reader.world_size()
        if self._reader.job is None and self._logs is not None:
            world = max(world, self._logs.world_size, max(self._logs.slots, default=-1) + 1)
        return world

    # -- reading the run directory -------------------------------------------------

    def scan(self, now: float) -> None:
        """Bring the view up to date with the run directory at time ``now``."""
        if self._kept is not None:
            self._kept.restore()
        with self._lock:
            self._scan(now)
        if self._kept is not None:
            self._kept.save()

    def refresh(self, now: float, max_age: float) -> None:
        """Scan unless the view is younger than ``max_age`` (HTTP reads call this)."""
        if self._kept is not None:
            self._kept.restore()
        with self._lock:
            if self.scanned_at is None or now - self.scanned_at >= max_age:
                self._scan(now)
        if self._kept is not None:
            self._kept.save()

    def keep_log_attempts(self, store) -> None:
        """Keep the attempts inferred from msrun's logs in ``store`` (``app.run.logmode.kept.KeptLink``)."""
        if self._logs is not None:
            self._kept = KeptLink(store, self._logs.dir.attempts, self._lock)

    def _scan(self, now: float) -> None:
        self.scanned_at = now
        if self.source is not None:
            self._world, self._summary, self._run = self.source.scan(now)
            return
        changed = self._reader.read(now)
        if self._logs is not None:
            changed |= self._logs.read(now)
        world = self._world_size()
        shown = set(self._slots) | set(self._log_slots())
        if (set(self._rows) - shown) and not set(self._rows) <= set(range(world)) | shown:
            # Ranks vanished (a smaller job reuses the directory): start over.
            self._clear()
            changed = self._reader.read(now) | set(self._slots) | set(self._log_slots())
            world = self._world_size()
            shown = set(self._slots) | set(self._log_slots())
        self._world = world
        copied = self._reader.copied
        # A copy is judged as it was when copied (its newest heartbeat), not as silent since: its
        # ranks' processes are not its own, so their silence says nothing (trainer_bridge.rundir.copies).
        judged_at = min(now, self._reader.newest_beat(now)) if copied else now
        self._feed_run_history(changed)
        if self.spikes_on:
            self._feed_spikes(changed, now)
        board = self._board
        view = set(range(world)) | shown
        board.set_view(view)
        for r in changed & view:
            slot = self._slot(r)
            from_log = slot is not None and r not in self._slots
            if from_log:
                self._from_log.add(r)
            else:
                self._from_log.discard(r)
            self._launches.observe(r, slot.hb if slot is not None and not from_log else None, now)
            self._ends.proof.observe(r, slot.hb if slot is not None else None)
            if slot is None:
                board.observe(r, RankReport(None))
            else:
                local = slot.hb is not None and slot.hb.get("host") == self._hostname
                board.observe(
                    r,
                    RankReport.of(
                        slot.hb,
                        slot.window,
                        local=local and not copied and slot.hb.get("pid") is not None,
                        from_log=from_log,
                        log_pace_ms=self._logs.pace_ms(r) if from_log else None,
                    ),
                )
            board.file_problem(r, slot.error if slot else None, slot.skew_s if slot else None)
        self._from_log &= view
        self._ends.copied = copied
        self._ends.probe_late(board, self._logs, self._from_log, now)
        self._ends.note(board, self._logs, self._from_log, view, now)
        for r in board.update(judged_at) | (changed & view):
            slot = self._slot(r)
            self._rows[r] = make_row(
                r,
                board.latest.get(r),
                board.verdicts[r],
                source="log" if r in self._from_log else "bridge",
                skew_s=slot.skew_s if slot else None,
            )
            if copied and self._rows[r]["state"] not in TERMINAL_STATES:
                row = self._rows[r]
                row["reason"] = f"{copies.COPIED_WORDS}; as last written: {row['reason']}"
            elif (
                r in self._from_log
                and r in self._ends.ended
                and self._rows[r]["state"] not in TERMINAL_STATES
            ):
                # A log only says "training" until its last line: its process has ended without a word.
                self._rows[r]["state"] = "failed"
            self._pushed.dirty.add(r)
        self._beats_expected = bool(self._from_log) and self._logs.heartbeats_expected(
            self._reader.job, now, self.bridge_grace_s, self._ends.rank0_alive
        )
        self._summary = self._make_summary()
        self._run = run_status(self._status_facts())

    def _feed_run_history(self, changed: set[int]) -> None:
        """Give the whole-run series the changed ranks' new points; seeded from the tails once."""
        hist = self._run_history
        if not hist.seeded and self._slots and self.run_dir is not None:
            hist.seed_from_files(
                self.run_dir, {r: s.hb for r, s in self._slots.items()}, launches(self.run_dir)
            )
        for r in changed:
            slot = self._slot(r)
            if slot is not None and slot.history:
                hist.feed_new(r, slot.history, slot.hb.get("launch") if slot.hb else None)

    def _feed_spikes(self, changed: set[int], now: float) -> None:
        """The ranks that wrote this tick, to the loss-spike detector: O(changed), not O(world)."""
        det = self._spikes
        det.world = self._world
        for r in changed:
            slot = self._slot(r)
            if slot is not None and slot.hb is not None:
                det.observe(r, slot.hb, now)

    def set_spike_params(self, params: spikes.Params, on: bool) -> None:
        with self._lock:
            self.spikes_on = on
            if params != self._spike_params:
                self._spike_params = self._spikes.params = params

    def take_spikes(self) -> list[spikes.Detection]:
        """The detections since the last call (the watcher's incident step acts on them)."""
        with self._lock:
            return self._spikes.take()

    def spike_view(self) -> dict:
        """The detections kept (the loss chart's marks), the open rules and the refused input."""
        with self._lock:
            return self._spikes.view()

    def add_mindformers_norms(self, norms: dict[int, float], now: float) -> None:
        with self._lock:
            self._spikes.mindformers(norms, now)

    def _status_facts(self) -> StatusFacts:
        """What the status line is made from (``app.run.status``), read under the lock."""
        reader, logs, latest = self._reader, self._logs, self._board.latest
        shown = set(range(self._world)) | set(latest)
        return StatusFacts(
            run_dir=self.shown_dir,
            world=self._world,
            reported=self._summary.get("reported", 0),
            redis=reader.redis,
            redis_error=reader.redis_error,
            read_error=reader.read_error,
            job=reader.job,
            job_error=reader.job_error,
            log_path=logs.path if logs is not None else None,
            log_problems=logs.problems() if logs is not None else [],
            from_log=len(self._from_log & {r for r, hb in latest.items() if hb is not None}),
            beats_expected=self._beats_expected,
            conflict=self._launches.conflict(latest, self._ends.ended, self.scanned_at),
            missing=self._board.missing(),
            ended_states=[hb["state"] for hb in latest.values()] if self._board.all_terminal() else None,
            job_over=None if self._board.all_terminal() else self._job_over(),
            end_proven=bool(shown) and shown <= self._ends.proof.proven,
            still_running=sorted(self._ends.proof.running),
            copied=self._reader.copied,
        )

    def job_ended(self) -> str | None:
        """Why the job is over (every rank ended, msrun not running), or None while it may run."""
        with self._lock:
            return self._job_over()

    def _job_over(self) -> str | None:
        return self._ends.job_over(self._world, self._logs, self._from_log)

    def stop_inputs(self) -> StopInputs:
        """Everything the stop service reads of the run (``app.stop.service.StopService``'s ``view``)."""
        ranks, world = self.heartbeats()
        return StopInputs(ranks, world, self.log_stop_facts(), self.job_facts())

    def job_facts(self) -> JobFacts:
        """What the stop service needs beyond the heartbeats (see ``app.run.jobend``)."""
        with self._lock:
            return self._ends.facts(self._logs, self._from_log)

    # -- derived views --------------------------------------------------------------

    def _make_summary(self) -> dict:
        return {"world_size": self._world, **self._board.summary_figures()}

    # -- what clients get ---------------------------------------------------------------

    def snapshot(self, now: float, health: Iterable[str] | None = None) -> dict:
        """The whole view (the ``ranks_snapshot`` event, ``rankwatch status``)."""
        with self._lock:
            return self._snapshot(now, set(health) if health else None)

    def page(
        self, now: float, health: Iterable[str] | None, start: int, count: int, order: str = "rank"
    ) -> tuple[dict, int]:
        """(the view with only the selected rows ``start`` to ``start + count``, how many were selected).

        ``/api/ranks`` and the page's window (``app/ranks/window.py``) page
        here: only the page's rows are copied (with their age), so a large
        job's answer costs a page, not the world size. ``order`` is ``rank``
        or ``worst`` (``WORST_FIRST``, by rank within a verdict).
        """
        wanted = set(health) if health else None
        with self._lock:
            chosen = [r for r in sorted(self._rows) if wanted is None or self._rows[r]["health"] in wanted]
            if order == "worst":
                rows, last = self._rows, len(WORST_FIRST)
                chosen.sort(key=lambda r: _SEVERITY.get(rows[r]["health"], last))  # stable: by rank within
            rows = [with_age(self._rows[r], now) for r in chosen[start : start + count]]
            body = {**self._head(now), "ranks": rows}
            if self.source is not None:
                body.update(self.source.page_extras(rows, now))
            return body, len(chosen)

    def rows(self) -> list[dict]:
        """Every rank's row by rank, without the heartbeat age (``/metrics``); rows are replaced, never
        changed in place, so the caller may read them after the lock is released."""
        with self._lock:
            return [self._rows[r] for r in sorted(self._rows)]

    def summary(self, now: float) -> dict:
        """The summary strip and the run status (``/api/summary``)."""
        with self._lock:
            return self._head(now)

    def _head(self, now: float) -> dict:
        return {"now": now, "world_size": self._world, "run": self._run, "summary": self._summary}

    def _snapshot(self, now: float, wanted: set[str] | None = None) -> dict:
        rows = [
            with_age(self._rows[r], now)
            for r in sorted(self._rows)
            if wanted is None or self._rows[r]["health"] in wanted
        ]
        return {**self._head(now), "ranks": rows}

    def heartbeats(self) -> tuple[dict[int, dict | None], int]:
        """(each rank's newest bridge heartbeat, or None if it has not reported; the world size).

        A rank shown from its worker log is None here: no bridge reports its stop stages.
        """
        with self._lock:
            if self.source is not None:
                return self.source.heartbeats(), self._world
            logs = self._from_log
            return {r: (None if r in logs else hb) for r, hb in self._board.latest.items()}, self._world

    def started_at(self, rank: int) -> float | None:
        """When rank ``rank``'s process started, by its newest heartbeat, from its bridge or its log."""
        with self._lock:
            if self.source is not None:
                return self.source.started_at(rank)
            hb = self._board.latest.get(rank)
            return hb.get("started_at") if hb else None

    def log_attempts(self) -> list[dict]:
        """The attempts inferred from msrun's worker logs (``app/run/logmode/attempts.py``); [] without logs."""
        with self._lock:
            return self._logs.dir.attempts.rows() if self._logs is not None else []

    def log_stop_facts(self) -> dict | None:
        """What the stop panel says about ranks shown only from their worker logs (None: there are none)."""
        with self._lock:
            facts = self._logs.stop_facts(self._slots) if self._logs is not None else None
            if facts is not None:
                facts["heartbeats_expected"] = self._beats_expected
            return facts

    def world_size(self) -> int:
        with self._lock:
            return self._world

    # -- the charts' reads (app/ranks/charts.py shapes them) ----------------------------

    def chart_points(
        self, start: int = 0, count: int | None = None, lowest_only: bool = False
    ) -> tuple[list[int], dict[int, list[tuple]], int]:
        """(the shown ranks ``start`` to ``start + count`` in rank order, each one's recent chart points
        ``(t, global_step, loss, step_time_ms)`` copied, how many ranks are shown in all).

        ``lowest_only``: the points of just the lowest rank that has any (the landing page's sparkline).
        """
        with self._lock:
            everyone = sorted(self._rows)
            ranks = everyone[start : None if count is None else start + count]
            out = {}
            for r in ranks:
                slot = self._slot(r)
                if slot is not None and slot.history:
                    out[r] = list(slot.history)
                    if lowest_only:
                        break
            return ranks, out, len(everyone)

    def run_history(self, attempts: list[dict], after: float | None, generation: int | None) -> dict:
        """The whole-run chart series (``/api/history/run``; ``RunHistory.answer``)."""
        with self._lock:
            return self._run_history.answer(attempts, after, generation)

    def goodput(self, attempts: list[dict], now: float) -> dict:
        """The run's goodput (``app.run.goodput.measure``) from ``/api/attempts``' rows and the whole-run series."""
        with self._lock:
            times = self._run_history.step_times()
            running = self._job_over() is None
        return goodput.measure(attempts, times, now, running)

    def job(self) -> dict | None:
        """job.json as last read and validated (None: missing or invalid)."""
        with self._lock:
            return dict(self._reader.job) if self._reader.job else None

    def node(self, host: str, now: float) -> dict | None:
        """The rows of the ranks on ``host`` (``GET /api/hosts/<host>/ranks``), or None if none runs there."""
        if self.source is not None:
            return self.source.node(host, now)  # it may wait (an agent's answer): it takes the lock itself
        with self._lock:
            rows = [with_age(row, now) for r, row in sorted(self._rows.items()) if row["host"] == host]
        return {"now": now, "host": host, "ranks": rows} if rows else None

    def rank(self, rank: int, now: float) -> dict | None:
        if self.source is not None:
            return self.source.rank(rank, now)  # it may wait (an agent's answer): it takes the lock itself
        with self._lock:
            row = self._rows.get(rank)
            if row is None:
                return None
            slot = self._slot(rank)
            points = list(slot.history) if slot else []
        return {
            "now": now,
            "rank": with_age(row, now),
            "history": [
                dict(zip(("t", "global_step", "loss", "step_time_ms"), p, strict=True)) for p in points
            ],
        }

    def resend(self) -> None:
        """Make the next ``take_delta`` a whole snapshot (a dashboard that just became leader)."""
        with self._lock:
            self._pushed.needs_snapshot = True

    def take_delta(self, now: float) -> tuple[str, dict] | None:
        """What to push since the last call (``app.push.RankPushes.take``): a delta, a snapshot, or None."""
        with self._lock:
            return self._pushed.take(
                now, self._world, self._rows, self._summary, self._run, lambda: self._snapshot(now)
            )
