"""Which set a run goes back to: one engine for ``rankwatch launch`` and for the page (issue 34).

The supervisor's relaunch and rollback (``app/supervise/policy.py``,
``rollback.py``) and the loss-spike policy's ``observed`` / ``requested``
lines (``app/incidents/spikes.py``) all call ``newest_healthy``, so for the
same index and the same evidence they name the same set: the page says what
the supervisor will do. Only the tensor check differs in cost, and it is
handed in (``finite.Reader``): the supervisor reads up to 8 GiB per choice,
the watcher's tick far less. A set the check did not read is taken
*unverified*, and the choice says so (``Choice.unverified``) rather than
vouching for it.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

from trainer_bridge.rundir import ckpthealth, rollbacks
from trainer_bridge.rundir.ckptindex import CheckpointSet, Index
from trainer_bridge.rundir.ckptpaths import ORIGIN_BRIDGE

# The target is older than the spike's first abnormal step by at least this many steps: the set
# saved at the step itself may already hold the bad update (``rankwatch launch --rollback-margin``).
MARGIN_STEPS = 1
# The tensors the dashboard reads for one choice (the watcher's tick, retention's plan); the
# supervisor reads up to 8 GiB (``app/supervise/policy.py``). Past it a set is named unverified.
DASHBOARD_SCAN_BYTES = 256 << 20
# (why a tensor is not finite, why the tensors were not read) for one set; (None, None): finite.
Tensors = Callable[[CheckpointSet], tuple[str | None, str | None]]
UNREAD = "its tensors were not read"


@dataclass
class Choice:
    set: CheckpointSet | None
    passed_over: list[str] = field(default_factory=list)
    unverified: str | None = None  # why the chosen set's tensors were not read

    @property
    def set_id(self) -> str | None:
        return self.set.id if self.set is not None else None

    @property
    def global_step(self) -> int | None:
        return self.set.global_step if self.set is not None else None

    @property
    def note(self) -> str | None:
        """The sets passed over and why, and an unverified choice; None when there is nothing to say."""
        parts = []
        if self.passed_over:
            parts.append("passed over: " + "; ".join(self.passed_over))
        if self.set is not None and self.unverified:
            parts.append(f"set {self.set.id} taken unverified: {self.unverified}")
        return "; ".join(parts) or None


def newest_healthy(
    index: Index,
    unhealthy: Mapping[str, str],
    *,
    before_step: int | None = None,
    exclude: Container[str] = (),
    tensors: Tensors | None = None,
    max_named: int = 5,
) -> Choice:
    """The newest set complete across the index's ranks and healthy, of any origin, older than ``before_step``.

    Newer sets that are corrupt, incomplete, in ``unhealthy`` (``{id: why}``),
    without a global step (it could not be pinned: ``RANKWATCH_RESUME_STEP``)
    or with a non-finite tensor (``tensors``) are passed over and the first
    ``max_named`` named. At one global step the bridge's own set comes first,
    as the bridge itself picks it. ``tensors`` None: nothing is read and the
    choice is unverified.
    """
    passed: list[str] = []
    ordered = sorted(
        index.sets, key=lambda s: (s.global_step is None, -(s.global_step or 0), s.origin != ORIGIN_BRIDGE)
    )
    if before_step is not None:
        ordered = [s for s in ordered if s.global_step is not None and s.global_step < before_step]
    for s in ordered:
        if s.id in exclude:
            continue
        why = unread = None
        if s.ranks_corrupt:
            why = f"corrupt on rank(s) {', '.join(map(str, s.ranks_corrupt[:8]))}"
        elif not s.complete:
            why = f"incomplete: rank(s) {', '.join(map(str, s.ranks_missing[:8]))} missing"
        elif s.id in unhealthy:
            why = f"unhealthy: {unhealthy[s.id]}"
        elif s.global_step is None:
            why = "its files name no global step"
        elif tensors is None:
            unread = UNREAD
        else:
            bad, unread = tensors(s)
            why = f"not finite: {bad}" if bad else None
        if why is None:
            return Choice(s, passed, unread)
        if len(passed) < max_named:
            passed.append(f"set {s.id}: {why}")
    return Choice(None, passed)


def abnormal_spans(lines: list[rollbacks.Line]) -> list[tuple[int, int]]:
    """The global steps the detector's record shows abnormal: each line's first step to its evidence's."""
    spans = set()
    for line in lines:
        if line.kind in ("observed", "requested"):
            spans.add((line.first_step, max(line.first_step, line.evidence.step)))
    return sorted(spans)


def recorded_abnormal(index: Index, spans: list[tuple[int, int]]) -> dict[str, str]:
    """``{set id: why}`` for the sets at a step the detector's record shows abnormal."""
    out = {}
    for s in index.sets if spans else ():
        g = s.global_step
        hit = next(((a, b) for a, b in spans if g is not None and a <= g <= b), None)
        if hit is not None:
            out[s.id] = f"its step {g} is in a spike the detector recorded (global steps {hit[0]}-{hit[1]})"
    return out


def left_behind(index: Index, lines: list[rollbacks.Line]) -> dict[str, str]:
    """``{set id: why}`` for the sets a rollback went back past: the run's abandoned branch.

    A ``relaunched`` line took the run back to its target step; every set newer than that step
    saved before the line was written (the stop's own set among them) holds the weights of the
    branch the spike was in. A crash or a restarted supervisor must not resume from one: that
    would undo the rollback. The files' times and the line's come from the clocks of the hosts
    that wrote them; the stop's set is written seconds before the line (MindSpore's exit lies
    between), and the new branch's sets a MindSpore start after it.
    """
    out = {}
    for line in lines:
        if line.kind != "relaunched" or line.target_step is None:
            continue
        for s in index.sets:
            if s.global_step is not None and s.global_step > line.target_step and s.mtime <= line.at:
                out.setdefault(
                    s.id,
                    f"left behind by the rollback from the spike at global step {line.first_step} "
                    f"to global step {line.target_step}",
                )
    return out


def rollback_target(
    index: Index,
    run_dir: str,
    first_step: int,
    margin: int,
    lines: list[rollbacks.Line],
    *,
    tensors: Tensors | None,
    exclude: Container[str] = (),
) -> Choice:
    """A loss-spike rollback's target: the newest healthy set older than ``first_step - margin``.

    Healthy adds to the health evidence (``ckpthealth``: a MindSpore
    ``*_breakpoint.ckpt``, a save after a NaN loss, MindFormers' health file)
    the sets saved at a step an earlier ``rollbacks.jsonl`` line shows abnormal, and those an earlier
    rollback left behind (``left_behind``).
    """
    unhealthy = {
        **ckpthealth.unhealthy(run_dir, index),
        **recorded_abnormal(index, abnormal_spans(lines)),
        **left_behind(index, lines),
    }
    return newest_healthy(index, unhealthy, before_step=first_step - margin, exclude=exclude, tensors=tensors)
