"""Verdicts kept up to date at a cost that follows what changed, not the size of the job.

``health.judge_all`` judges every rank from scratch: a few microseconds of
Python per rank, so at 4096 ranks and two ticks a second it alone takes a
tenth of a core whether anything happened or not. Yet between two ticks a
rank's verdict can change for only a handful of reasons: its heartbeat
changed, a process probe answered differently, time carried its heartbeat
age or its last step across a threshold, or its peers moved the median it is
compared with. ``VerdictBoard`` keeps every figure those depend on in numpy
arrays indexed by rank, recomputes the threshold tests for all ranks with
vector operations (microseconds in C), and calls ``health.judge`` only for
the ranks where a test came out differently, or whose heartbeat changed.
Stragglers are always re-judged: their reasons quote numbers.

The rules stay in ``app.run.health`` (pure, tested on heartbeat sequences); this
module only decides whom to ask, and ``tests/ranks/test_judging.py`` checks on
random job histories that the board's verdicts equal ``judge_all``'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from app.run import peers
from app.run.boardrules import lost_nodes, with_file_problem
from app.run.health import BLOCKER_WORDS, RankEvidence, Thresholds, Verdict, blocker_note, judge, with_note
from app.run.stepcost import RankReport
from app.run.verdicts import STEPPING_STATES, TERMINAL_STATES, VERDICTS

ALIVE = ("healthy", "straggler", "stalled")
_NAN = math.nan
_NO_VERDICT = Verdict("pending", "")


def _f(value: float | None) -> float:
    return _NAN if value is None else value


def _opt(value: float) -> float | None:
    return None if math.isnan(value) else float(value)


def _median(ordered: np.ndarray) -> float:
    """``health.median`` of a sorted array (NaN for none), computed the same way."""
    k = len(ordered)
    if k == 0:
        return _NAN
    return float(ordered[k // 2]) if k % 2 else float((ordered[k // 2 - 1] + ordered[k // 2]) / 2)


def _differ(new: np.ndarray, old: np.ndarray, tolerance: float) -> np.ndarray:
    """Element-wise: the values differ by more than ``tolerance``, or only one is NaN."""
    nan_new, nan_old = np.isnan(new), np.isnan(old)
    with np.errstate(invalid="ignore"):
        far = np.abs(new - old) > tolerance
    return (nan_new != nan_old) | (~nan_new & ~nan_old & far)


class VerdictBoard:
    """Every rank's verdict, updated incrementally. Not thread-safe: ``RunState`` holds the lock."""

    def __init__(self, thresholds: Thresholds):
        self.th = thresholds
        # Ranks to re-judge at the next update whatever the tests say.
        self._changed: set[int] = set()
        # Ranks whose final verdict must be rebuilt (their file problem changed).
        self._refinal: set[int] = set()
        # rank -> (error, has a valid heartbeat, clock skew): see file_problem().
        self._problems: dict[int, tuple[str | None, float | None]] = {}
        self.latest: dict[int, Mapping | None] = {}
        self.verdicts: dict[int, Verdict] = {}
        self._base: dict[int, Verdict] = {}  # before the blocker note
        self._probes: dict[int, tuple[str | None, str | None, bool]] = {}
        self._blockers: dict[str, set[int]] = {c: set() for c in BLOCKER_WORDS}
        self._hung: set[int] = set()
        self._note: str | None = None
        self._cap = 0
        self._cost = self._peer = np.empty(0)  # of the last update (summary_figures)
        self._alloc(64)
        self.basis = "step"
        self.fastest: float | None = None
        self.counts = dict.fromkeys(VERDICTS, 0)
        self._host_ids: dict[str, int] = {}
        self._host_names: list[str] = []
        # rank -> the node-lost reason, for ranks of a host judged lost (see _lost_nodes).
        self._lost: dict[int, str] = {}

    # ------------------------------------------------------------------ arrays
    def _alloc(self, cap: int) -> None:
        old = self._cap
        fields = {
            "present": (np.bool_, False),
            "has_hb": (np.bool_, False),
            "stepping": (np.bool_, False),
            "terminal": (np.bool_, False),
            "time": (np.float64, _NAN),
            "last_step": (np.float64, _NAN),  # last_step_at, else started_at (the stall clock)
            "last_step_at": (np.float64, _NAN),
            "wall": (np.float64, _NAN),  # median wall step time (window)
            "split_in": (np.float64, _NAN),
            "split_out": (np.float64, _NAN),
            "steps": (np.int64, 0),
            "samples": (np.float64, _NAN),
            "gstep": (np.float64, _NAN),
            "local": (np.bool_, False),  # on the dashboard's host, with a pid: psutil can probe it
            "from_log": (np.bool_, False),  # read from msrun's worker log (app.run.logmode)
            "log_pace": (np.float64, _NAN),  # ...and the median ms between its step lines
            "host": (np.int32, -1),  # index into self._host_names
            "alive": (np.bool_, False),  # verdict in ALIVE
            "straggler": (np.bool_, False),  # verdict straggler (the rule's hysteresis: app.run.peers)
            # The last tick's test results, to see which ones changed.
            "sig_age": (np.int8, -1),
            "sig_nostep": (np.bool_, False),
            "sig_strag": (np.bool_, False),
            "sig_score": (np.float64, _NAN),  # the score's rounding bucket
            "sig_edge": (np.bool_, False),  # ...and whether it was within a hair of an edge
            "sig_warm": (np.bool_, False),
            "sig_peer": (np.bool_, False),
            "sig_own": (np.bool_, False),
        }
        for name, (dtype, fill) in fields.items():
            arr = np.full(cap, fill, dtype=dtype)
            if old:
                arr[:old] = getattr(self, "_" + name)
            setattr(self, "_" + name, arr)
        self._cap = cap

    def _ensure(self, rank: int) -> None:
        if rank >= self._cap:
            cap = self._cap
            while cap <= rank:
                cap *= 2
            self._alloc(cap)

    # ------------------------------------------------------------------ input
    def set_view(self, ranks: set[int]) -> None:
        """The ranks of the job (0..world-1 and any that wrote a heartbeat)."""
        for r in set(self.latest) - ranks:
            self._forget(r)
        for r in ranks - set(self.latest):
            self._ensure(r)
            self.latest[r] = None
            self._present[r] = True
            self._changed.add(r)

    def observe(self, rank: int, report: RankReport) -> None:
        """What rank ``rank``'s source says at this scan (``RankReport``)."""
        hb = report.hb
        self._ensure(rank)
        self.latest[rank] = hb
        self._present[rank] = True
        self._changed.add(rank)
        if hb is None:
            self._has_hb[rank] = self._stepping[rank] = self._terminal[rank] = False
            for name in ("time", "last_step", "last_step_at", "samples", "gstep"):
                getattr(self, "_" + name)[rank] = _NAN
        else:
            state = hb.get("state")
            self._has_hb[rank] = True
            self._stepping[rank] = state in STEPPING_STATES
            self._terminal[rank] = state in TERMINAL_STATES
            self._time[rank] = _f(hb.get("time"))
            last = hb.get("last_step_at")
            self._last_step_at[rank] = _f(last)
            self._last_step[rank] = _f(last if last is not None else hb.get("started_at"))
            self._samples[rank] = _f(hb.get("samples_per_s"))
            self._gstep[rank] = _f(hb.get("global_step"))
            host = hb.get("host")
            if host is None:
                self._host[rank] = -1
            else:
                if host not in self._host_ids:
                    self._host_ids[host] = len(self._host_names)
                    self._host_names.append(host)
                self._host[rank] = self._host_ids[host]
        self._wall[rank] = _f(report.wall_ms)
        split = report.split_ms
        self._split_in[rank], self._split_out[rank] = split if split is not None else (_NAN, _NAN)
        self._steps[rank] = report.steps
        self._local[rank] = report.local and hb is not None
        self._from_log[rank] = report.from_log and hb is not None
        self._log_pace[rank] = _f(report.log_pace_ms) if report.from_log else _NAN

    def set_probe(self, rank: int, gone: str | None, stopped: str | None, alive: bool) -> None:
        """What a process probe said about ``rank`` (see ``app.run.ending.RankEnds.probe_late``)."""
        if self._probes.get(rank, (None, None, False)) != (gone, stopped, alive):
            self._changed.add(rank)
        if gone or stopped or alive:
            self._probes[rank] = (gone, stopped, alive)
        else:
            self._probes.pop(rank, None)

    def gone(self, rank: int) -> str | None:
        """Why a probe (or msrun's words) says ``rank``'s process is gone, or None."""
        return self._probes.get(rank, (None, None, False))[0]

    def _forget(self, rank: int) -> None:
        self.latest.pop(rank, None)
        self._probes.pop(rank, None)
        self._problems.pop(rank, None)
        old = self.verdicts.pop(rank, None)
        self._base.pop(rank, None)
        if old is not None:
            self.counts[old.health] -= 1
        for ranks in self._blockers.values():
            ranks.discard(rank)
        self._hung.discard(rank)
        self._present[rank] = self._has_hb[rank] = self._stepping[rank] = False
        self._alive[rank] = self._local[rank] = self._from_log[rank] = self._straggler[rank] = False
        self._log_pace[rank] = _NAN
        self._host[rank] = -1
        self._lost.pop(rank, None)
        self._changed.discard(rank)
        self._refinal.discard(rank)

    def file_problem(self, rank: int, error: str | None, skew_s: float | None) -> None:
        """What is wrong with the rank's heartbeat file: invalid (``error``), or from a clock ahead."""
        problem = (error, skew_s)
        if self._problems.get(rank, (None, None)) != problem:
            self._refinal.add(rank)
        if error is None and skew_s is None:
            self._problems.pop(rank, None)
        else:
            self._problems[rank] = problem

    # ------------------------------------------------------------------ judging
    def update(self, now: float) -> set[int]:
        """Re-judge what may have changed at time ``now``; returns the ranks whose verdict changed."""
        th = self.th
        n = self._cap
        present = self._present[:n]
        stepping = present & self._has_hb & self._stepping
        has_split = ~np.isnan(self._split_in) & ~np.isnan(self._split_out)

        # The cost each rank is compared by (stepcost.compare_costs).
        if stepping.any() and has_split[stepping].all():
            basis = "work"
            fastest = float(self._split_in[stepping].min())
            cost = np.where(has_split, self._split_out + fastest, _NAN)
        else:
            basis, fastest = "step", None
            cost = self._wall.copy()
        warming_cost = present & (self._steps < th.straggler_min_steps)
        cost[warming_cost] = _NAN
        warming = warming_cost if int(stepping.sum()) >= 2 else np.zeros(n, np.bool_)
        # A healthy rank's reason says which cost it is compared by: a new
        # basis is a new reason for every rank.
        rebasis = basis != self.basis
        self.basis, self.fastest = basis, fastest

        # The peer median: for a stepping rank the median of the others' costs
        # (health.peer_median, exactly), else the median of all.
        with_cost = stepping & ~np.isnan(cost)
        times = np.sort(cost[with_cost])
        k = len(times)
        peer = np.full(n, _median(times))
        if k >= 2:
            skip = np.searchsorted(times, cost[with_cost], side="left")
            m = k - 1  # the peers: all but one copy of the rank's own cost
            mid = m // 2

            def at(i: int) -> np.ndarray:
                return np.where(i < skip, times[i], times[i + 1])

            peer[with_cost] = at(mid) if m % 2 else (at(mid - 1) + at(mid)) / 2
        elif k == 1:
            peer[with_cost] = _NAN
        # The summary's slowest rank is found, and quoted, by the figures its row was judged by.
        self._cost, self._peer = cost, peer

        # The tests through which time and peers change a verdict.
        age = now - self._time
        age_band = np.where(age > th.dead_after_s, 2, np.where(age > th.stall_min_s, 1, 0)).astype(np.int8)
        age_band[self._from_log] = 0  # a worker log has no heartbeat to miss (health.judge)
        pace = np.where(np.isnan(self._wall), np.nan_to_num(cost, nan=0.0), self._wall)
        log_paced = self._from_log & ~np.isnan(self._log_pace)
        pace[log_paced] = np.fmax(pace[log_paced], self._log_pace[log_paced])
        limit = np.maximum(th.stall_min_s, th.stall_factor * pace / 1000.0)
        nostep = ~np.isnan(self._last_step) & (now - self._last_step > limit)
        has_own, has_peer = ~np.isnan(cost), ~np.isnan(peer)
        both = has_own & has_peer
        with np.errstate(invalid="ignore", divide="ignore"):
            # peers.straggling, element-wise and in its order of operations.
            hold = np.where(self._straggler[:n], peers.STRAGGLER_HOLD, 1.0)
            strag = (
                both
                & (cost >= th.straggler_ratio * hold * peer)
                & (cost - peer >= th.straggler_min_gap_ms * hold)
            )
            ratio = np.where(both & (cost > 0), np.minimum(1.0, peer / cost), np.where(both, 1.0, _NAN))
        # The score is the ratio rounded to two decimals (in Python, by judge);
        # it can only change when the ratio crosses a rounding edge, an odd
        # multiple of 0.005. The bucket between edges says which side; a ratio within a
        # hair of an edge, now or at the last tick, is always re-judged, since
        # float noise there could put it on either side.
        scaled = ratio * 200.0  # the edges (x.xx5) are the odd integers of this scale
        bucket = np.floor((scaled + 1.0) / 2.0)
        nearest = np.rint(scaled)
        near_edge = (np.abs(scaled - nearest) < 1e-6) & (np.fmod(nearest, 2.0) == 1.0)

        moved = (
            (age_band != self._sig_age)
            | (nostep != self._sig_nostep)
            | (strag != self._sig_strag)
            | (warming != self._sig_warm)
            | (has_peer != self._sig_peer)
            | (has_own != self._sig_own)
            | _differ(bucket, self._sig_score, 0.0)
            | near_edge
            | self._sig_edge
            | strag
            | self._sig_strag
        ) & present
        if rebasis:
            moved = present.copy()
        candidates = set(np.flatnonzero(moved).tolist()) | self._changed
        self._changed = set()
        self._sig_age, self._sig_nostep, self._sig_strag = age_band, nostep, strag
        self._sig_warm, self._sig_peer, self._sig_own = warming, has_peer, has_own
        self._sig_score, self._sig_edge = bucket, near_edge

        changed_base = set()
        for r in candidates:
            if r not in self.latest:
                continue
            gone, stopped, alive = self._probes.get(r, (None, None, False))
            own_r = _opt(cost[r])
            work = (float(self._split_out[r]), fastest) if basis == "work" and own_r is not None else None
            evidence = RankEvidence(
                self.latest[r],
                own_ms=own_r,
                peer_ms=_opt(peer[r]),
                wall_ms=_opt(self._wall[r]),
                work=work,
                process_gone=gone,
                process_stopped=stopped,
                process_alive=alive,
                warming=bool(warming[r]),
                from_log=bool(self._from_log[r]),
                log_pace_ms=_opt(self._log_pace[r]),
                was_straggler=bool(self._straggler[r]),
            )
            verdict = judge(evidence, now, th)
            if self._base.get(r) != verdict or r not in self.verdicts:
                self._base[r] = verdict
                changed_base.add(r)
        changed_base |= self._lost_nodes(now, age) | (self._refinal & set(self.latest))
        self._refinal = set()
        return self._apply_blockers(changed_base, candidates & set(self.latest))

    def _lost_nodes(self, now: float, age: np.ndarray) -> set[int]:
        """Judge the hosts (``boardrules.lost_nodes``); the ranks whose node-lost verdict changed."""
        lost = lost_nodes(
            self.th,
            self._host_names,
            age,
            present=self._present,
            has_hb=self._has_hb,
            terminal=self._terminal,
            host=self._host,
            from_log=self._from_log,
            local=self._local,
            time=self._time,
        )
        moved = {r for r in lost.keys() | self._lost.keys() if lost.get(r) != self._lost.get(r)}
        self._lost = lost
        return moved & set(self.latest)

    def _apply_blockers(self, changed_base: set[int], judged: set[int]) -> set[int]:
        """Final verdicts: hung ranks' reasons name the ranks blocking them (``health._with_blockers``).

        A rank blocks when its verdict's cause is in ``BLOCKER_WORDS`` and its
        heartbeat says it was stepping, so membership is re-checked for every
        rank judged (its heartbeat may have changed while its verdict did not).
        """
        for r in changed_base | judged:
            base = self._base[r]
            hb = self.latest.get(r) or {}
            for cause, ranks in self._blockers.items():
                if base.cause == cause and hb.get("state") in STEPPING_STATES:
                    ranks.add(r)
                else:
                    ranks.discard(r)
            if base.cause == "hung":
                self._hung.add(r)
            else:
                self._hung.discard(r)
        note = blocker_note(self._blockers)
        renote = self._hung if note != self._note else self._hung & changed_base
        self._note = note
        changed = set()
        for r in changed_base | renote:
            base = self._base[r]
            final = with_note(base, note) if note is not None and base.cause == "hung" else base
            if r in self._lost:
                final = Verdict("node_lost", self._lost[r], cause="node")
            if r in self._problems:
                final = with_file_problem(final, *self._problems[r], has_hb=self.latest.get(r) is not None)
            old = self.verdicts.get(r)
            if old != final:
                if old is not None:
                    self.counts[old.health] -= 1
                self.counts[final.health] += 1
                self.verdicts[r] = final
                self._alive[r] = final.health in ALIVE
                self._straggler[r] = final.health == "straggler"
                changed.add(r)
        return changed

    # ------------------------------------------------------------------ summary
    def summary_figures(self) -> dict:
        """The summary strip's job-wide figures, by vector operations over the arrays.

        ``slowest`` compares the same cost as the straggler rule among ranks
        alive and stepping, with its peer median as its row does (``app.run.peers``);
        ``throughput`` sums their samples per second.
        """
        n = self._cap
        present = self._present[:n]
        alive_stepping = present & self._alive & self._has_hb & self._stepping
        if len(self._cost) == n:
            cost = self._cost
        elif self.basis == "work" and self.fastest is not None:
            cost = np.where(~np.isnan(self._split_out), self._split_out + self.fastest, _NAN)
        else:
            cost = self._wall
        idx = np.flatnonzero(alive_stepping & ~np.isnan(cost))
        slowest = peers.slowest_rank(
            idx,
            cost[idx],
            self.basis,
            straggler=lambda r: self.verdicts.get(r, _NO_VERDICT).health == "straggler",
            threshold_ratio=self.th.straggler_ratio,
            peer=(lambda r: _opt(self._peer[r])) if len(self._peer) == n else None,
        )
        rates = self._samples[alive_stepping]
        has = present & self._has_hb
        last_steps = self._last_step_at[has]
        gsteps = self._gstep[has]
        last_steps = last_steps[~np.isnan(last_steps)]
        gsteps = gsteps[~np.isnan(gsteps)]
        return {
            "counts": dict(self.counts),
            "reported": int(has.sum()),
            "slowest": slowest,
            # Unknown, not 0, when no rank reports a rate (a log rank's never does).
            "throughput": round(float(np.nansum(rates)), 1) if (~np.isnan(rates)).any() else None,
            "last_step_at": float(last_steps.max()) if len(last_steps) else None,
            "global_step": int(gsteps.max()) if len(gsteps) else None,
        }

    def late(self, now: float, after_s: float, local_only: bool = False) -> list[int]:
        """Ranks whose heartbeat is ``after_s`` old or more and whose state is not terminal."""
        with np.errstate(invalid="ignore"):
            mask = self._present & self._has_hb & ~self._terminal & (now - self._time >= after_s)
        if local_only:
            mask &= self._local
        return np.flatnonzero(mask).tolist()

    def missing(self) -> list[int]:
        """Ranks of the job that have no valid heartbeat yet, in order."""
        return np.flatnonzero(self._present & ~self._has_hb).tolist()

    def all_terminal(self) -> bool:
        """Every rank has reported, and reported an end (exited, finished, failed)."""
        return bool(self._present.any()) and not (self._present & ~(self._has_hb & self._terminal)).any()
