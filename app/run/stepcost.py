"""A rank's cost per step, as the straggler rule compares it: its step window, the score, the basis.

``StepWindow`` keeps a rank's newest step times (and the time inside and
between steps); ``compare_costs`` says whether ranks are compared on their
own work or on their wall step time (``app.run.health``'s docstring says
why work); ``score`` is the relative performance score; ``RankReport`` is
what a source hands the board of one rank: its heartbeat and its window's
figures. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.run.peers import median
from app.run.verdicts import STEPPING_STATES


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None: heartbeats come from other processes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class StepWindow:
    """A rank's most recent step times and their median.

    Heartbeats carry each step's time since the previous heartbeat
    (``step_times_ms``); the window keeps the newest ``size`` of them. A
    heartbeat seen twice (same ``seq``) is counted once.

    It also keeps the per-heartbeat means of the time inside and between
    steps (``step_in_ms``, ``step_out_ms``) of the heartbeats that cover the
    newest ``size`` steps; ``split_ms`` is their medians, or None when the
    newest heartbeat with steps lacks either figure.
    """

    __slots__ = ("_times", "_seq", "median_ms", "_size", "_split", "split_ms")

    @property
    def steps(self) -> int:
        """How many step times the window holds (at most its size)."""
        return len(self._times)

    def __init__(self, size: int):
        self._times: deque[float] = deque(maxlen=size)
        self._seq: Any = None
        self.median_ms: float | None = None
        self._size = size
        # (steps, in ms, out ms) per heartbeat that saw steps, oldest first.
        self._split: deque[tuple[int, float, float]] = deque()
        self.split_ms: tuple[float, float] | None = None

    def add(self, hb: Mapping[str, Any], trusted: bool = False) -> None:
        """Take in one heartbeat. ``trusted``: validated by ``trainer_bridge.rundir.schema``
        (finite, non-negative step times), so they need no check, which matters
        at thousands of heartbeats a second."""
        seq = hb.get("seq")
        if seq is not None and seq == self._seq:
            return
        self._seq = seq
        times = hb.get("step_times_ms")
        if trusted and times:
            fresh = times
        elif isinstance(times, list) and times:
            fresh = [t for t in map(number, times) if t is not None and t >= 0]
        else:
            last = number(hb.get("step_time_ms"))
            fresh = [last] if last is not None and last >= 0 else []
        if fresh:
            self._times.extend(fresh)
            self.median_ms = median(sorted(self._times))
            steps = len(times) if isinstance(times, list) and times else len(fresh)
            self._add_split(steps, number(hb.get("step_in_ms")), number(hb.get("step_out_ms")))

    def _add_split(self, steps: int, in_ms: float | None, out_ms: float | None) -> None:
        if in_ms is None or out_ms is None or in_ms < 0 or out_ms < 0:
            # One heartbeat without the figures (an older bridge, a simulator):
            # the rank falls back to wall step times until it reports them again.
            self._split.clear()
            self.split_ms = None
            return
        self._split.append((steps, in_ms, out_ms))
        covered = sum(n for n, _, _ in self._split)
        while len(self._split) > 1 and covered - self._split[0][0] >= self._size:
            covered -= self._split.popleft()[0]
        self.split_ms = (
            median(sorted(i for _, i, _ in self._split)),
            median(sorted(o for _, _, o in self._split)),
        )


def score(own_ms: float | None, peer_ms: float | None) -> float | None:
    """Relative performance score in [0, 1]: peer median / own, capped at 1."""
    if own_ms is None or peer_ms is None:
        return None
    if own_ms <= 0:
        return 1.0
    return round(min(1.0, peer_ms / own_ms), 2)


def compare_costs(
    latest: Mapping[int, Mapping[str, Any] | None],
    own_ms: Mapping[int, float | None],
    split: Mapping[int, tuple[float, float] | None] | None = None,
) -> tuple[str, dict[int, float | None], float | None]:
    """What straggler detection compares: ``(basis, cost per rank, fastest in-step ms)``.

    ``basis`` is ``"work"`` when every stepping rank has ``split`` figures
    (``(step_in_ms, step_out_ms)`` medians, from ``StepWindow.split_ms``);
    then a rank's cost is ``step_out_ms + min over stepping ranks of
    step_in_ms`` (the module docstring says why). Otherwise it is ``"step"``
    and the cost is the median wall step time ``own_ms``.
    """
    split = split or {}
    stepping = [r for r, hb in latest.items() if hb and hb.get("state") in STEPPING_STATES]
    if stepping and all(split.get(r) is not None for r in stepping):
        fastest = min(split[r][0] for r in stepping)
        costs = {r: (split[r][1] + fastest if split.get(r) is not None else None) for r in latest}
        return "work", costs, fastest
    return "step", {r: own_ms.get(r) for r in latest}, None


@dataclass(frozen=True, slots=True)
class RankReport:
    """What a source says of one rank at a scan: its newest valid heartbeat and its step window.

    ``hb`` None: none yet. ``wall_ms``, ``split_ms`` and ``steps`` are the
    window's median, split and size (``StepWindow``). ``local``: the
    rank runs on the dashboard's host and names its pid. ``from_log``: the
    heartbeat was read from its worker log, whose step lines come every
    ``log_pace_ms`` (see ``health.RankEvidence``).
    """

    hb: Mapping | None
    wall_ms: float | None = None
    split_ms: tuple[float, float] | None = None
    steps: int = 0
    local: bool = False
    from_log: bool = False
    log_pace_ms: float | None = None

    @classmethod
    def of(cls, hb: Mapping | None, window: StepWindow, **kw) -> RankReport:
        return cls(hb, window.median_ms, window.split_ms, window.steps, **kw)
