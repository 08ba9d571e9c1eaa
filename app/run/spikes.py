"""The loss-spike detector (issue 34): pure, fed each rank's newest heartbeat, out of band.

It runs in the dashboard from the heartbeats it already reads (never a
collective in the training loop). ``RunState`` feeds it the ranks whose
heartbeat changed this tick, so a quiet tick costs nothing and a tick costs
O(ranks that wrote), not O(world).

What it sees is a *sample*: the bridge converts the loss about once a
heartbeat (every step would cost a device sync), so a sample is the loss
of one step in each heartbeat, at that heartbeat's global step.

The rules, each naming its evidence (rank, step, value, level):

- ``nonfinite``: a NaN or infinite loss. In data parallel every rank's loss
  turns at once (the gradient AllReduce spreads one rank's NaN to every
  weight), so one rank's NaN while another rank reports a finite loss at
  the same step or later is evidence of that rank only: it is reported
  (``lone``), but never asks for a rollback. It is confirmed job-wide when
  a second rank reports a non-finite loss, or at once in a one-rank job.
- ``spike``: the loss above ``factor`` x the rank's level, and above the
  level by ``NOISE_K`` x its window's upper spread (below), for ``steps``
  global steps in a row and ``min(steps, MIN_SAMPLES)`` samples: one odd
  sample (a loss of 1e308 in a forged file) is never a spike.
- ``grad_norm``: the same, on the global norm the script reports
  (``bridge.report(grad_norm=...)``), or a step MindFormers wrote to its
  ``abnormal_global_norm.json``. A lone infinite norm is a loss-scale
  overflow (the step is skipped by the optimizer), so it counts as one
  abnormal sample, not as ``nonfinite``.
- ``divergence``: after a spike, the loss not back under its pre-spike
  level (with ``RECOVER_SLACK`` for noise) within ``recover_steps`` global
  steps of its first abnormal step.

The level, the noise term and the run of abnormal samples of one rank's
loss (or norm) are ``app/run/spikewindow.py``'s.

``nonfinite`` and ``divergence`` are what ``enforce`` acts on (``acts``);
a spike that comes back, or a norm spike, is a warning: alerted, marked,
never a rollback by itself. At most one episode per rule is open at a time:
a thousand ranks turning NaN at once is one detection whose ``ranks`` counts
them. A rank whose global step goes backwards or whose launch changes (a
resume, a rollback) starts over.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.run.spikewindow import Series

MODES = ("off", "observe", "enforce")
RECOVER_SLACK = 1.25  # "back under the pre-spike level" allows this much noise
ACTS = ("nonfinite", "divergence")
MAX_NORMS_STEPS = 1000  # MindFormers' abnormal steps taken in at most
MAX_RANK = 1 << 17
MAX_STEP = 2**53
DETECTIONS_KEPT = 200


@dataclass(frozen=True)
class Params:
    """The detector's thresholds (settings ``SPIKE_*``, or the run's ``rankwatch/spikes.json``)."""

    factor: float = 3.0
    steps: int = 3
    recover_steps: int = 100


@dataclass
class Detection:
    """One rule tripped: what the page marks, the alert says and ``rollbacks.jsonl`` records."""

    rule: str
    rank: int
    step: int
    value: float | str | None  # the loss or norm; "nan", "inf", "-inf" when not finite
    level: float | None
    # The earliest step that may be abnormal (K): the step after the rank's last normal
    # sample, since the loss is sampled about once a heartbeat, not every step.
    first_step: int
    at: float
    ranks: int = 1
    lone: bool = False  # one rank's non-finite loss while another's is finite
    text: str = ""
    source: str = "heartbeat"  # or "mindformers"

    @property
    def acts(self) -> bool:
        """Whether ``enforce`` rolls back for it."""
        return self.rule in ACTS and not self.lone

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "rank": self.rank,
            "step": self.step,
            "value": self.value,
            "level": self.level,
            "first_step": self.first_step,
            "at": self.at,
            "ranks": self.ranks,
            "lone": self.lone,
            "acts": self.acts,
            "text": self.text,
            "source": self.source,
        }


def nonfinite_name(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _number(value: Any) -> float | None:
    """A real number (not a bool, not a string, not a 400-digit int), NaN and inf included; else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


class _Rank:
    __slots__ = ("launch", "step", "loss", "norm")

    def __init__(self, launch: Any) -> None:
        self.launch = launch
        self.step = -1
        self.loss = Series()
        self.norm = Series()


@dataclass
class _Episode:
    detection: Detection
    ranks: set[int] = field(default_factory=set)
    levels: dict[int, float] = field(default_factory=dict)  # a spike's ranks: their pre-spike levels
    diverged: bool = False


class Detector:
    """Feed it ``observe(rank, heartbeat, now)``; ``take()`` the new detections."""

    def __init__(self, params: Params | None = None, world: int = 1):
        self.params = params or Params()
        self.world = world
        self._ranks: dict[int, _Rank] = {}
        self._open: dict[str, _Episode] = {}  # rule -> the open episode
        # Not taken on a follower dashboard (only the leader acts): bounded all the same.
        self._new: deque[Detection] = deque(maxlen=DETECTIONS_KEPT)
        self.detections: deque[Detection] = deque(maxlen=DETECTIONS_KEPT)
        self.refused = 0
        self.last_refusal: str | None = None
        self._norm_steps: set[int] = set()
        self._lone: set[int] = set()  # ranks reported lone, until their loss is finite again
        # rank -> (the earliest step that may be abnormal, the NaN sample's step, its name): the
        # ranks whose NaN is not yet confirmed or refuted. Kept apart so that a sample costs
        # O(pending), usually nothing, and never O(world).
        self._pending: dict[int, tuple[int, int, str]] = {}

    # ------------------------------------------------------------------ input
    def observe(self, rank: int, hb: Mapping[str, Any] | None, now: float) -> None:
        """Rank ``rank``'s newest heartbeat (a validated ``Heartbeat.to_dict()``, or anything: refused)."""
        if hb is None:
            return
        step = hb.get("global_step")
        if step is None:
            return  # a row read from a worker log before the log tells its step
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
            return self._refuse(f"rank {rank}: global_step {step!r} is not a step")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
            return self._refuse(f"rank {rank!r} is not a rank")
        launch = hb.get("launch")
        st = self._ranks.get(rank)
        if st is None or st.launch != launch or step < st.step:
            st = self._ranks[rank] = _Rank(launch)  # a new launch, a resume, a rollback: start over
            self._forget(rank)
        # The step whose loss it is (the bridge's loss_step), else the heartbeat's.
        taken = hb.get("loss_step")
        if isinstance(taken, int) and not isinstance(taken, bool) and 0 <= taken <= step:
            step = taken
        if step == st.step:
            return  # no new loss since the last heartbeat: the same sample again
        st.step = step
        loss = self._value(hb, "loss", rank)
        if loss is not None:
            self._loss(rank, st, step, loss, now)
        norm = self._value(hb, "grad_norm", rank)
        if norm is not None:
            self._norm(rank, st, step, norm, now)
        self._confirm(rank, step, loss, now)

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self.last_refusal = why[:300]

    def _value(self, hb: Mapping[str, Any], name: str, rank: int) -> float | None:
        flag = hb.get(f"{name}_nonfinite")
        if flag in ("nan", "inf", "-inf"):
            return float(flag)
        raw = hb.get(name)
        if raw is None:
            return None
        value = _number(raw)
        if value is None:
            text = repr(raw)
            self._refuse(f"rank {rank}: {name} {text[:40]} is not a number")
        return value

    def _forget(self, rank: int) -> None:
        """Rank ``rank`` started over (a resume, a rollback): its episodes end with it."""
        self._pending.pop(rank, None)
        for rule, ep in list(self._open.items()):
            ep.ranks.discard(rank)
            ep.levels.pop(rank, None)
            if not ep.ranks and not ep.levels:
                del self._open[rule]

    # ------------------------------------------------------------------ the rules
    def _loss(self, rank: int, st: _Rank, step: int, loss: float, now: float) -> None:
        if not math.isfinite(loss):
            name = nonfinite_name(loss)
            ep = self._open.get("nonfinite")
            if ep is not None:
                self._join(ep, rank)
                return
            ok = st.loss.ok_step
            if rank not in self._pending:  # a rank's first NaN sample is its evidence
                self._pending[rank] = (step if ok is None else ok + 1, step, name)
            seen = [(v, r) for r, v in self._pending.items()]
            if self.world <= 1 or len(seen) > 1:
                # The evidence: the rank that may have turned first (then the lowest).
                (first, at, first_name), first_rank = min(seen)
                self._nonfinite(first_rank, at, first_name, now, len(seen), first=first)
            return
        self._pending.pop(rank, None)
        self._lone.discard(rank)
        series = st.loss
        trips, level = series.judge(step, loss, self.params.factor, self.params.steps)
        ep = self._open.get("nonfinite")
        if ep is not None and rank in ep.ranks:
            ep.ranks.discard(rank)  # finite again
            if not ep.ranks:
                del self._open["nonfinite"]
        ep = self._open.get("spike")
        if ep is not None and rank in ep.levels:
            self._follow_spike(ep, rank, step, loss, now)
        if trips:
            if ep is None:
                det = Detection(
                    "spike",
                    rank,
                    step,
                    loss,
                    level,
                    series.first,
                    now,
                    text=f"rank {rank}: loss {loss:.5g} at step {step}, above {self.params.factor:g} x "
                    f"its level {level:.5g} since step {series.above_since} (normal at step "
                    f"{series.first - 1 if series.ok_step is not None else '?'})",
                )
                ep = self._open["spike"] = _Episode(det)
                self._emit(det)
            if rank not in ep.levels:
                ep.levels[rank] = series.level_before
                self._join(ep, rank)

    def _follow_spike(self, ep: _Episode, rank: int, step: int, loss: float, now: float) -> None:
        """A spiking rank's next sample: recovered, still high, or diverged."""
        before = ep.levels[rank]
        if loss <= before * RECOVER_SLACK:
            del ep.levels[rank]
            if not ep.levels:
                del self._open["spike"]  # every rank came back: the spike is over
            return
        first = ep.detection.first_step
        if not ep.diverged and step - first >= self.params.recover_steps:
            ep.diverged = True
            self._emit(
                Detection(
                    "divergence",
                    rank,
                    step,
                    loss,
                    before,
                    first,
                    now,
                    ranks=len(ep.levels),
                    text=f"rank {rank}: loss {loss:.5g} at step {step}, not back under its pre-spike level "
                    f"{before:.5g} within {self.params.recover_steps} steps of step {first}",
                )
            )

    def _norm(self, rank: int, st: _Rank, step: int, norm: float, now: float) -> None:
        series = st.norm
        if not math.isfinite(norm):
            trips, level = False, series.level()
            if series.above_since is None:
                series.start(step, level)
            series.above_n += 1
            trips = step - series.above_since + 1 >= self.params.steps and series.above_n >= 2
        else:
            trips, level = series.judge(step, norm, self.params.factor, self.params.steps)
        if trips and "grad_norm" not in self._open:
            shown = norm if math.isfinite(norm) else nonfinite_name(norm)
            det = Detection(
                "grad_norm",
                rank,
                step,
                shown,
                level,
                series.first,
                now,
                text=f"rank {rank}: global norm {shown if isinstance(shown, str) else f'{shown:.5g}'} at step "
                f"{step}, above {self.params.factor:g} x its level "
                f"{'?' if level is None else f'{level:.5g}'} since step {series.above_since}",
            )
            self._open["grad_norm"] = _Episode(det, {rank})
            self._emit(det)
        elif not trips and series.above_since is None and "grad_norm" in self._open:
            ep = self._open["grad_norm"]
            ep.ranks.discard(rank)
            if not ep.ranks:
                del self._open["grad_norm"]

    def _nonfinite(
        self,
        rank: int,
        step: int,
        name: str,
        now: float,
        ranks: int,
        lone: bool = False,
        first: int | None = None,
    ) -> None:
        if lone:
            text = (
                f"rank {rank}: loss {name} at step {step}, while another rank's loss is finite at that "
                "step or later: evidence of that rank only (in data parallel every rank's loss turns at once)"
            )
        else:
            more = f" (and {ranks - 1} more rank{'s' if ranks > 2 else ''})" if ranks > 1 else ""
            text = f"rank {rank}: loss {name} at step {step}{more}"
        first = step if first is None else first
        if first < step:
            text += f" (finite at step {first - 1})"
        det = Detection("nonfinite", rank, step, name, None, first, now, ranks=ranks, lone=lone, text=text)
        if not lone:
            ep = self._open["nonfinite"] = _Episode(det)
            ep.ranks.update(self._pending)
        self._emit(det)

    def _confirm(self, rank: int, step: int, loss: float | None, now: float) -> None:
        """Another rank's sample at ``step`` settles a pending lone NaN: refuted if finite."""
        if not self._pending or loss is None or not math.isfinite(loss):
            return
        for r, (first, at, name) in list(self._pending.items()):
            if r != rank and at <= step:
                del self._pending[r]
                if "nonfinite" not in self._open and r not in self._lone:
                    self._lone.add(r)
                    self._nonfinite(r, at, name, now, 1, lone=True, first=first)

    def _join(self, ep: _Episode, rank: int) -> None:
        if rank not in ep.ranks:
            ep.ranks.add(rank)
            ep.detection.ranks = max(ep.detection.ranks, len(ep.ranks))

    def _emit(self, det: Detection) -> None:
        self._new.append(det)
        self.detections.append(det)

    # ------------------------------------------------------------------ MindFormers
    def mindformers(self, norms: Mapping[int, float], now: float) -> None:
        """Steps from MindFormers' ``abnormal_global_norm.json`` (``read_mindformers``); each once."""
        for step in sorted(norms):
            if step in self._norm_steps or len(self._norm_steps) >= MAX_NORMS_STEPS:
                continue
            self._norm_steps.add(step)
            value = norms[step]
            shown = value if math.isfinite(value) else nonfinite_name(value)
            self._emit(
                Detection(
                    "grad_norm",
                    0,
                    step,
                    shown,
                    None,
                    step,
                    now,
                    text=f"MindFormers recorded global norm {shown} at step {step} in abnormal_global_norm.json",
                    source="mindformers",
                )
            )

    # ------------------------------------------------------------------ output
    def take(self) -> list[Detection]:
        """The detections since the last call, oldest first."""
        new = list(self._new)
        self._new.clear()
        return new

    def open_rules(self) -> list[str]:
        """The rules whose episode is still open (an unresolved spike or NaN)."""
        return sorted(self._open)

    def view(self) -> dict:
        """The detections kept (the loss chart's marks), the open rules and the refused input."""
        return {
            "detections": self.marks(),
            "open": self.open_rules(),
            "refused": self.refused,
            "last_refusal": self.last_refusal,
        }

    def marks(self, since_step: int | None = None) -> list[dict]:
        """The kept detections as the loss chart's marks, oldest first."""
        return [d.to_dict() for d in self.detections if since_step is None or d.step >= since_step]


def ranks_of(detections: Iterable[Detection]) -> list[int]:
    return sorted({d.rank for d in detections})
