"""The whole run's chart series: one point per (attempt, global step), bounded by a cap.

The page's step-time and loss charts show the whole run, as TensorBoard and
W&B do, rather than the last ``HISTORY_POINTS`` seconds. ``RunState`` feeds
this from the heartbeats it already ingests (``feed``) and seeds it once
from the ranks' history tails (``seed``). A point holds, for one global step
of one attempt: the wall time the step was first reported, the loss
averaged over the ranks that reported that step, and the median and the
maximum of their step times.

**Attempts.** Points are keyed by the launch id the heartbeat names (a tail
line names none: it takes the launch of the attempt that had started by its
time, from ``attempts.jsonl``). A relaunch pinned to an older set re-runs
steps an earlier attempt already ran; both are kept, each under its own
launch, so the replay is a branch, never an overwrite (W&B drops such steps,
TensorBoard purges them). Without launch ids (ranks read from msrun's logs,
or an old bridge) every point is one series, and a replayed step is ignored.

**Bounds.** A step stays open while its ranks report it (``OPEN_S`` of data
time); then it is sealed into five ``array('d')`` columns: one point costs
40 bytes, so the cap (``RUN_HISTORY_POINTS``, 10,000) bounds a run at about
400 kB, plus the open steps (one float per reporting rank for the median).
Sealed points are thinned by age, measured back from the run's newest point
(a finished run keeps its last hour whole too):

* every point of the last ``KEEP_WHOLE_S`` (an hour: the window an operator
  zooms into while a job trains; at 1 Hz it is 3,600 points, a third of the
  cap) is kept;
* older points are one per ``THIN_S`` (a minute): the bin's mean loss and
  mean median step time, its largest step time (so a spike survives), at its
  last step and time;
* while the cap is still exceeded, the oldest of the finest thinned ranges
  has its interval doubled, so the history coarsens evenly from the start
  rather than one range growing ever coarser; if the last hour alone holds
  more than half the cap (many steps a second), only the newest half-cap of
  points stays whole.

Each thinned range is recorded (``thinned``) so the page can say "before
10:32, one point a minute". Thinning rewrites points, so it bumps
``generation``: a client that asks for the points after a time with an older
generation gets everything again.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from app.run.heartbeats import read_history_tail

KEEP_WHOLE_S = 3600.0
THIN_S = 60.0
# A step is sealed once the run's newest report is this much later than its first:
# the ranks of a synchronous job report a step within a heartbeat or two of each other.
OPEN_S = 10.0
# Sealing passes run at most this often (of data time).
SEAL_EVERY_S = 2.0
# Open steps beyond this are sealed early, oldest first (thousands of ranks each
# reporting a different step of a fast job).
MAX_OPEN = 4096
# Aged points are thinned in batches (one pass over the series per this much data
# time), not on every point.
THIN_EVERY_S = 300.0
# After a pass forced by the cap, the series is brought this far under it, so the
# next pass is many points away.
LOW_WATER = 0.9
# Ranks whose history tails seed the series when the dashboard starts on a running
# job: enough for a faithful mean, and a bounded read (two 256 kB segments each).
SEED_RANKS = 16
SEED_LINES = 4096
NAN = math.nan


def _num(v: Any) -> float | None:
    """A finite float, or None: the run directory is untrusted, the tuples come from its files."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


class _Series:
    """One attempt's sealed points, by global step, as five float columns (40 bytes a point)."""

    __slots__ = ("t", "step", "loss", "med", "max")

    def __init__(self):
        self.t, self.step, self.loss, self.med, self.max = (array("d") for _ in range(5))

    def __len__(self) -> int:
        return len(self.step)

    def columns(self) -> tuple[array, ...]:
        return self.t, self.step, self.loss, self.med, self.max

    def put(self, point: Sequence[float]) -> bool:
        """Insert in step order; a step already sealed is kept as it is (False)."""
        step = point[1]
        i = len(self.step)
        if i and self.step[-1] >= step:
            i = bisect.bisect_left(self.step, step)
            if i < len(self.step) and self.step[i] == step:
                return False
        for col, v in zip(self.columns(), point, strict=True):
            col.insert(i, v)
        return True

    def has(self, step: float) -> bool:
        i = bisect.bisect_left(self.step, step)
        return i < len(self.step) and self.step[i] == step


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _nanmean(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return sum(vals) / len(vals) if vals else NAN


def _nanmax(values: Iterable[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else NAN


def _out(v: float, digits: int | None = None) -> float | None:
    if math.isnan(v):
        return None
    return round(v, digits) if digits is not None else v


class RunHistory:
    """The whole-run series of one run; not thread-safe (``RunState`` holds its lock around it)."""

    def __init__(self, cap: int, keep_whole_s: float = KEEP_WHOLE_S):
        self.cap = max(16, int(cap))
        self.keep_whole_s = float(keep_whole_s)
        self._series: dict[str | None, _Series] = {}
        # (launch, step) -> [first t, loss sum, loss count, step times]
        self._open: dict[tuple[str | None, float], list] = {}
        self._fed: dict[int, float] = {}  # rank -> the newest point time taken from it
        self._newest: float | None = None
        self._sealed_at = -math.inf  # data time of the last sealing pass
        # [from t, to t, one point every s], oldest first, adjacent, covering the thinned past.
        self.thinned: list[list[float]] = []
        self._thinned_until: float | None = None
        self._binned_until = -math.inf  # points before this are one a bin already: a pass skips them
        self.generation = 0
        self.seeded = False

    # -- taking points -----------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(s) for s in self._series.values())

    def seed(
        self,
        tails: Mapping[int, Sequence[tuple]],
        launches: Sequence[tuple[float, str]],
        current: Mapping[int, tuple[float, str]] | None = None,
    ) -> None:
        """Take the ranks' history tails (``read_history_tail`` points, oldest first) at start.

        A tail line names no launch. One written since the rank's process started
        (``current``: rank -> (its heartbeat's started_at, launch)) is that launch's;
        an older one takes the attempt that had started by its time (``launches``:
        (started_at, launch id) of each attempt, oldest first, from attempts.jsonl).
        """
        starts = [s for s, _ in launches]
        current = current or {}
        for rank in sorted(tails):
            began, mine = current.get(rank, (math.inf, None))
            for point in tails[rank]:
                t = _num(point[0]) if point else None
                if t is None:
                    continue
                i = bisect.bisect_right(starts, t) - 1
                launch = mine if t >= began else launches[i][1] if i >= 0 else None
                self.feed(rank, point, launch, seal=False)
        self.seeded = True
        self._seal()

    def seed_from_files(
        self, run_dir: Path, beats: Mapping[int, dict | None], launches: Sequence[tuple[float, str]]
    ) -> None:
        """``seed`` from the history files of the first ``SEED_RANKS`` ranks with a heartbeat (``beats``)."""
        ranks = sorted(beats)[:SEED_RANKS]
        current = {
            r: (hb["started_at"], hb["launch"])
            for r in ranks
            if (hb := beats[r]) is not None and hb.get("launch") and hb.get("started_at") is not None
        }
        self.seed({r: read_history_tail(run_dir, r, SEED_LINES) for r in ranks}, launches, current)

    def feed_new(self, rank: int, points: Sequence[tuple], launch: str | None) -> None:
        """Feed the points of ``points`` (a rank's chart points, oldest first) newer than those taken."""
        fed = self._fed.get(rank, -math.inf)
        i = len(points)
        while i > 0 and isinstance(points[i - 1][0], (int, float)) and points[i - 1][0] > fed:
            i -= 1
        for j in range(i, len(points)):
            self.feed(rank, points[j], launch)

    def feed(self, rank: int, point: Sequence, launch: str | None, *, seal: bool = True) -> None:
        """One rank's chart point (t, global step, loss, step ms), taken once (older times are ignored).

        A point without a global step, or with neither a loss nor a step time, adds nothing.
        """
        if len(point) < 4:
            return
        t, step = _num(point[0]), _num(point[1])
        if t is None or step is None or step < 0 or t <= self._fed.get(rank, -math.inf):
            return
        self._fed[rank] = t
        loss, ms = _num(point[2]), _num(point[3])
        if loss is None and (ms is None or ms < 0):
            return
        launch = launch if isinstance(launch, str) else None
        key = (launch, step)
        series = self._series.get(launch)
        if key not in self._open and series is not None and series.has(step):
            return  # reported after its step was sealed (a rank very late), or a replay without launch ids
        acc = self._open.get(key)
        if acc is None:
            acc = self._open[key] = [t, 0.0, 0, []]
        acc[0] = min(acc[0], t)
        if loss is not None:
            acc[1] += loss
            acc[2] += 1
        if ms is not None and ms >= 0:
            acc[3].append(ms)
        if self._newest is None or t > self._newest:
            self._newest = t
        if seal and (self._newest - self._sealed_at >= SEAL_EVERY_S or len(self._open) > MAX_OPEN):
            self._seal()

    @staticmethod
    def _point(step: float, acc: list) -> tuple[float, ...]:
        t, loss_sum, loss_n, times = acc
        return (
            t,
            step,
            loss_sum / loss_n if loss_n else NAN,
            _median(times) if times else NAN,
            max(times) if times else NAN,
        )

    def _seal(self, everything: bool = False) -> None:
        if self._newest is None:
            return
        self._sealed_at = self._newest
        edge = math.inf if everything else self._newest - OPEN_S
        due = [k for k, acc in self._open.items() if acc[0] < edge]
        if len(self._open) - len(due) > MAX_OPEN:
            rest = sorted(
                (k for k, acc in self._open.items() if acc[0] >= edge), key=lambda k: self._open[k][0]
            )
            # Down to the low-water mark, so that the next such pass is many points away.
            due += rest[: len(self._open) - len(due) - int(MAX_OPEN * LOW_WATER)]
        for key in sorted(due, key=lambda k: (k[0] or "", k[1])):
            acc = self._open.pop(key)
            launch, step = key
            self._series.setdefault(launch, _Series()).put(self._point(step, acc))
        since = self._thinned_until if self._thinned_until is not None else self._oldest()
        aged = self._newest - self.keep_whole_s - since
        if len(self) > self.cap or aged >= THIN_EVERY_S:
            self._thin()

    def _oldest(self) -> float:
        return min((s.t[0] for s in self._series.values() if len(s)), default=self._newest or 0.0)

    # -- thinning ----------------------------------------------------------------------

    def _thin(self) -> None:
        newest = self._newest
        edge = newest - self.keep_whole_s
        whole = sorted(t for s in self._series.values() for t in s.t if t >= edge)
        if len(whole) > self.cap // 2:
            edge = whole[-(self.cap // 2)]
        start = self._thinned_until if self._thinned_until is not None else self._oldest()
        before = len(self)
        if edge > start:
            self._add_range(start, edge, THIN_S)
            self._thinned_until = edge
        self._rebin()
        while len(self) > self.cap * LOW_WATER and self.thinned:
            finest = min(r[2] for r in self.thinned)
            oldest = next(r for r in self.thinned if r[2] == finest)
            oldest[2] *= 2
            self._binned_until = min(self._binned_until, oldest[0])
            self._merge_ranges()
            was = len(self)
            self._rebin()
            if len(self) >= was:
                break  # the thinned ranges hold no more than a point a bin: only the whole part is left
        if len(self) != before:
            self.generation += 1  # points were rewritten: a client's copy is stale

    def _add_range(self, start: float, end: float, every: float) -> None:
        self.thinned.append([start, end, every])
        self._merge_ranges()

    def _merge_ranges(self) -> None:
        merged: list[list[float]] = []
        for r in self.thinned:
            if merged and merged[-1][2] == r[2] and merged[-1][1] >= r[0]:
                merged[-1][1] = max(merged[-1][1], r[1])
            else:
                merged.append(r)
        self.thinned = merged

    def _interval(self, t: float) -> tuple[int, float] | None:
        """(the thinned range holding ``t``, its interval), or None: ``t`` is kept whole."""
        if self._thinned_until is None or t >= self._thinned_until:
            return None
        for i, (_, end, every) in enumerate(self.thinned):
            if t < end:
                return i, every
        return None

    def _rebin(self) -> None:
        """One point per bin of each range's interval, for points before ``_thinned_until``.

        Only the points between ``_binned_until`` and ``_thinned_until`` are
        walked (a bin of one point is copied as it is); the rest is copied by slices.
        """
        until = self._thinned_until
        if until is None:
            return
        for launch, s in list(self._series.items()):
            if not len(s) or s.t[0] >= until:
                continue
            # Steps of an attempt are trained in time order, so its times are sorted.
            split = bisect.bisect_left(s.t, until)
            # From the last point already binned: the new points may share its bin.
            i = max(0, bisect.bisect_left(s.t, self._binned_until) - 1)
            out = _Series()
            for col, src in zip(out.columns(), s.columns(), strict=True):
                col.extend(src[:i])
            while i < split:
                key = self._bin(s.t[i])
                j = i + 1
                while key is not None and j < split and self._bin(s.t[j]) == key:
                    j += 1
                if j == i + 1:
                    for col, src in zip(out.columns(), s.columns(), strict=True):
                        col.append(src[i])
                else:
                    self._emit(s, range(i, j), out)
                i = j
            for col, src in zip(out.columns(), s.columns(), strict=True):
                col.extend(src[split:])
            self._series[launch] = out
        self._binned_until = until

    def _bin(self, t: float) -> tuple[int, int] | None:
        where = self._interval(t)
        return None if where is None else (where[0], math.floor(t / where[1]))

    @staticmethod
    def _emit(s: _Series, group: range, out: _Series) -> None:
        last = group[-1]
        out.t.append(s.t[last])
        out.step.append(s.step[last])
        out.loss.append(_nanmean(s.loss[i] for i in group))
        out.med.append(_nanmean(s.med[i] for i in group))
        out.max.append(_nanmax(s.max[i] for i in group))

    def step_times(self) -> dict[str | None, list[tuple[float, float]]]:
        """Launch id -> (global step, median step seconds) of its points, sealed and open (goodput's input)."""
        out: dict[str | None, list[tuple[float, float]]] = {}
        for launch, s in self._series.items():
            out[launch] = [(s.step[j], s.med[j] / 1000.0) for j in range(len(s)) if s.med[j] == s.med[j]]
        for (launch, step), acc in self._open.items():
            med = self._point(step, acc)[3]
            if med == med:
                out.setdefault(launch, []).append((step, med / 1000.0))
        return out

    # -- answering ---------------------------------------------------------------------

    def answer(
        self,
        attempts: Sequence[Mapping[str, Any]],
        after: float | None = None,
        generation: int | None = None,
    ) -> dict:
        """``/api/history/run``: each attempt's points, oldest attempt first, and the thinned ranges.

        ``attempts``: ``/api/attempts``' rows (their number, start, resume and end
        name each series). With ``after`` and the current ``generation``, only
        points first reported after ``after - OPEN_S`` (a step still open may have
        changed since) are sent, and ``partial`` is true.
        """
        partial = after is not None and generation == self.generation
        since = after - OPEN_S if partial else -math.inf
        points: dict[str | None, list] = {}
        for launch, s in self._series.items():
            points[launch] = [
                (s.step[j], s.t[j], s.loss[j], s.med[j], s.max[j]) for j in range(len(s)) if s.t[j] > since
            ]
        for (launch, step), acc in self._open.items():
            if acc[0] > since:
                p = self._point(step, acc)
                points.setdefault(launch, []).append((p[1], p[0], p[2], p[3], p[4]))
        known = {a.get("launch") for a in attempts}
        rows = [dict(a) for a in attempts]
        extra = [k for k in self._series if k not in known] + [
            k for k, _ in self._open if k not in known and k not in self._series
        ]
        for launch in dict.fromkeys(extra):
            rows.append({"attempt": None, "launch": launch})
        out = []
        for row in rows:
            pts = sorted(points.get(row.get("launch"), ()))
            out.append(
                {
                    **{k: row.get(k) for k in ATTEMPT_FIELDS},
                    "points": [
                        [int(st), round(t, 3), _out(loss), _out(med, 2), _out(mx, 2)]
                        for st, t, loss, med, mx in pts
                    ],
                }
            )
        return {
            "attempts": out,
            "thinned": [
                {"from": round(a, 3), "to": round(b, 3), "every_s": every} for a, b, every in self.thinned
            ],
            "cap": self.cap,
            "count": len(self),
            "keep_whole_s": self.keep_whole_s,
            "generation": self.generation,
            "partial": partial,
        }


# What each series says of its attempt (``/api/attempts``' rows): enough to mark it and
# to say in a hover which attempt it was and how it ended.
ATTEMPT_FIELDS = (
    "attempt",
    "launch",
    "started_at",
    "first_step",
    "last_step",
    "resumed_from",
    "replayed",
    "end",
    "stop_by",
    "requested_by",
    "request_id",
    "error",
)
