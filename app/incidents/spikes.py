"""The loss-spike policy's dashboard side (issue 34): what a detection does, by ``SPIKE_MODE``.

The detector (``app/run/spikes.py``) runs inside ``RunState``'s scan; this
takes its detections once per watcher tick, on the leader only, and:

- every detection: an alert (``loss_spike``, through the alert desk, once),
  an audit row (action ``spike``: the run's incidents) and a mark on the loss
  chart (``GET /api/spikes``, which the chart reads);
- ``observe`` (the default), for a detection ``enforce`` would act on (a
  job-wide NaN or infinite loss, a divergence): an ``observed`` line in
  ``rankwatch/rollbacks.jsonl`` saying what ``enforce`` would do (the
  rollback target: ``target_before``, the supervisor's own choice). Nothing
  is stopped.
- ``enforce``: the rollback request (``rankwatch/rollback.json``), a
  ``requested`` line, then a graceful stop through the stop service with
  who = ``policy`` and the rule as the reason. A rollback asked while a stop
  is pending joins that stop (the service answers "joined"); one already
  requested and not yet consumed by ``rankwatch launch`` is not asked again.
  ``rankwatch launch`` does the rest (``trainer_bridge/rundir/rollbacks.py``).

A spike that comes back, a norm spike, or one rank's lone NaN is alerted and
marked only: never a rollback by itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from app.audit import POLICY, AuditError, AuditLog
from app.checkpoints import finite, target
from app.errors import RankwatchError
from app.incidents.alerts import AlertDesk
from app.run import mfnorms, spikes
from app.run.state import RunState
from app.stop.service import StopService
from trainer_bridge.rundir import rollbacks, spikepolicy
from trainer_bridge.rundir.ckptindex import CheckpointSet, Index

log = logging.getLogger(__name__)

WHO = "policy"
EVENT = "loss_spike"
# How often the run's spikes.json and MindFormers' norm file are looked at again.
REREAD_S = 5.0
MARGIN_STEPS = target.MARGIN_STEPS
KEPT = 50


def target_before(
    index: Index | None, run_dir: str | None, first_step: int, memo: dict | None = None
) -> tuple[CheckpointSet | None, str]:
    """(the set ``rankwatch launch`` would roll back to for a spike from ``first_step``, or None; why in words).

    The supervisor's own choice (``target.rollback_target``, with the margin
    the run's supervisor published, the default without one, and the same
    ``rollbacks.jsonl`` evidence), reading tensors within
    ``target.DASHBOARD_SCAN_BYTES`` (verdicts kept in ``memo``): a set past it is
    named "unverified", since the supervisor may still find it non-finite.
    """
    if index is None or not run_dir:
        return None, "no checkpoint index yet"
    lines, _ = rollbacks.read_lines(run_dir)
    published, _ = rollbacks.read_settings(run_dir)
    margin = published.margin if published else MARGIN_STEPS
    choice = target.rollback_target(
        index,
        run_dir,
        first_step,
        margin,
        lines,
        tensors=finite.Reader(target.DASHBOARD_SCAN_BYTES, memo),
    )
    if choice.set is None:
        why = f"no complete healthy set before step {first_step - margin}"
        return None, why + (f" ({choice.note})" if choice.note else "")
    note = f"newest complete healthy set before step {first_step - margin}"
    if choice.unverified:
        note += f", unverified: {choice.unverified}"
    if choice.passed_over:
        note += f"; passed over: {'; '.join(choice.passed_over[:3])}"
    return choice.set, note


class SpikeWatch:
    """Used from the watcher's incident step only; ``status`` may be read from any thread."""

    def __init__(
        self,
        state: RunState,
        config: dict,
        stop: StopService,
        audit: AuditLog,
        alerts: AlertDesk,
        index: Callable[[], Index | None] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.state = state
        self.config = config
        self.stop = stop
        self.audit = audit
        self.alerts = alerts
        self.index = index
        self.clock = clock
        self.run_dir = str(state.run_dir) if state.run_dir else None
        self.policy = spikepolicy.policy_for(self.run_dir, config)  # raises ValueError for a bad setting
        self._read_at = -1e18
        self._norms_sig: tuple | None = None
        self._finite_memo: dict = {}  # each checkpoint file's tensor verdict, by path, size and mtime
        self.norms_error: str | None = None
        self.recent: deque[dict] = deque(maxlen=KEPT)
        self.version = 0
        self._lock = threading.Lock()
        self._apply()

    def _apply(self) -> None:
        p = self.policy
        self.state.set_spike_params(
            spikes.Params(factor=p.factor, steps=p.steps, recover_steps=p.recover_steps), p.mode != "off"
        )

    # ------------------------------------------------------------------ the tick
    def tick(self, now: float) -> bool:
        """Act on this tick's detections; True when the status changed."""
        if now - self._read_at >= REREAD_S:
            self._read_at = now
            self._reread(now)
        found = self.state.take_spikes()
        if self.policy.mode == "off" or not found:
            return False
        for det in found:
            self._act(det, now)
        with self._lock:
            self.version += 1
        return True

    def _reread(self, now: float) -> None:
        policy = spikepolicy.policy_for(self.run_dir, self.config)
        if policy != self.policy:
            self.policy = policy
            self._apply()
            self.version += 1
        if not self.run_dir or policy.mode == "off":
            return
        sig = []
        for rel in mfnorms.MINDFORMERS_NORMS:
            try:
                st = os.stat(os.path.join(self.run_dir, rel), follow_symlinks=False)
                sig.append((rel, st.st_size, st.st_mtime_ns))
            except OSError:
                continue
        if tuple(sig) == self._norms_sig:
            return
        self._norms_sig = tuple(sig)
        norms, self.norms_error = mfnorms.read_mindformers(self.run_dir)
        if norms:
            self.state.add_mindformers_norms(norms, now)

    def _act(self, det: spikes.Detection, now: float) -> None:
        mode = self.policy.mode
        record: dict[str, Any] = {"detection": det.to_dict(), "mode": mode}
        outcome = "alerted and marked"
        if det.acts and self.run_dir:
            try:
                outcome = self._rollback(det, now, mode, record)
            except OSError as e:
                outcome = f"could not write rankwatch/{rollbacks.LINES_NAME}: {e}"
                log.warning("loss spike: %s", outcome)
        record["outcome"] = outcome
        with self._lock:
            self.recent.append(record)
        try:
            self.audit.record(
                "spike",
                who=WHO,
                reason=det.text[:500],
                outcome=outcome[:500],
                request_id=record.get("request_id"),
                detail=record,
                basis=POLICY,
            )
        except AuditError as e:
            log.warning("loss spike not audited: %s", e)
        self.alerts.once(
            f"spike:{det.rule}:{det.rank}:{det.step}:{det.source}",
            EVENT,
            f"{det.rule} ({mode}): {det.text}; {outcome}",
            rule=det.rule,
            rank=det.rank,
            step=det.step,
            first_step=det.first_step,
            value=det.value,
            level=det.level,
            ranks=det.ranks,
            lone=det.lone,
            mode=mode,
            outcome=outcome,
        )

    def _rollback(self, det: spikes.Detection, now: float, mode: str, record: dict) -> str:
        """The observed line, or (enforce) the request, the requested line and the stop; the outcome."""
        index = None
        if self.index is not None:
            try:
                index = self.index()
            except Exception:  # the index is advice here: a scan failure must not lose the alert
                log.exception("checkpoint index for the rollback target")
        target, why = target_before(index, self.run_dir, det.first_step, self._finite_memo)
        evidence = rollbacks.Evidence(
            rule=det.rule,
            rank=det.rank,
            step=det.step,
            value=det.value,
            level=det.level,
            ranks=min(det.ranks, spikes.MAX_RANK),
            text=det.text[:500],
        )
        line = dict(
            at=now,
            rule=det.rule,
            evidence=evidence,
            first_step=det.first_step,
            target_step=target.global_step if target is not None else None,
            target_set=target.id[:200] if target is not None else None,
            skip_batches=self.policy.skip_batches,
        )
        where = (
            f"roll back to step {target.global_step} ({why}) and skip {self.policy.skip_batches} batches "
            f"past step {det.first_step}"
            if target is not None
            else f"stop: {why}"
        )
        if mode == "observe":
            rollbacks.append(
                self.run_dir, rollbacks.Line(kind="observed", note=f"enforce would {where}", **line)
            )
            return f"observed: enforce would {where}"
        pending, _ = rollbacks.read_request(self.run_dir)
        if pending is not None:
            return f"a rollback for step {pending.first_step} is already requested: joined it"
        rollbacks.write_request(
            self.run_dir,
            rollbacks.Request(
                rule=det.rule,
                evidence=evidence,
                first_step=det.first_step,
                skip_batches=self.policy.skip_batches,
                asked_at=now,
            ),
        )
        rollbacks.append(self.run_dir, rollbacks.Line(kind="requested", note=f"asked to {where}", **line))
        reason = f"loss spike policy: {det.rule}: {det.text}"[:480]
        try:
            request_id, created, _, _ = self.stop.request(reason, WHO, None, basis=POLICY)
        except RankwatchError as e:
            return f"rollback requested, but the stop failed: {e.message}"
        record["request_id"] = request_id
        how = "requested a graceful stop" if created else "joined the pending stop"
        return f"rollback requested ({where}); {how} {request_id}"

    # ------------------------------------------------------------------ the page
    def status(self) -> dict:
        """``GET /api/spikes``: the policy in force, the marks, the recent actions, the rollbacks."""
        view = self.state.spike_view()
        lines, skipped = rollbacks.read_lines(self.run_dir) if self.run_dir else ([], 0)
        published, published_error = rollbacks.read_settings(self.run_dir) if self.run_dir else (None, None)
        with self._lock:
            recent = list(self.recent)
        return {
            "policy": self.policy.to_dict(),
            "marks": view["detections"],
            "open": view["open"],
            "refused": view["refused"],
            "last_refusal": view["last_refusal"],
            "norms_error": self.norms_error,
            "recent": recent,
            "rollbacks": [ln.model_dump(mode="json") for ln in lines],
            "rollbacks_skipped": skipped,
            "supervisor": published.model_dump(mode="json") if published else None,
            "supervisor_error": published_error,
        }
