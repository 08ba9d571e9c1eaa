"""The stop request's life: write the flag, cancel, re-arm, complete it, audit.

Following a stop (each rank's stage, who holds the others up, the status)
is ``StopView``'s, in ``app/stop/status.py``; ``StopService`` holds one
(``follow``), asks it, and acts. Both read the run through ``view`` (``RunState.stop_inputs``): no
caller gathers the heartbeats, the log ranks' facts and the job's end itself.

The flag file is the request's only record the trainers see, so the service
keeps the request's facts in it too (``request_id``, ``requested_at``,
``requested_by``, ``reason``); after a cancel or re-arm the file says
``{"GracefulExit": 0, ...}`` and keeps the served request under
``last_request``. A restarted dashboard therefore rebuilds the whole story
from the flag and the heartbeats.

Stages per rank, in order: ``requested`` (flag written, rank has not seen it)
→ ``seen`` → ``agreed`` (stop step fixed) → ``saving`` → ``saved`` →
``exited``. A rank that stays in one stage longer than ``STOP_DEADLINE_S``
is flagged late; the ranks at the lowest stage are the ones holding the
others up.

A rank shown only from msrun's worker log reports no stages: its stage comes
from what the log shows (``app.run.jobend.log_stage``), so an ``OnRequestExit``
stop completes and re-arms by the same rule. A stop that the job can no
longer obey (every rank ended without exiting for it, msrun gone) ends as
``not_obeyed``: audited so, and re-armed, so that a relaunch trains. Only
process evidence (a probe on this host finds every rank's process gone,
``app.run.endproof``) ends it at once and re-arms it; on the run
directory's word alone it waits ``claims_min_s`` and is never re-armed
automatically (issue 32, P1).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

from app.attempts import served_by
from app.audit import AUTHENTICATED, OBSERVED, SYSTEM, AuditError, AuditLog
from app.errors import CannotWrite, StopRefused
from app.run.jobend import StopInputs
from app.stop.status import (
    COMMITTED,
    NOT_OBEYED,
    StopView,
    active_request,
    ranks_text,
    relaunched_since,
)
from trainer_bridge.rundir import runfiles, safeio

# The lock that orders flag writes between dashboards and ``rankwatch stop``;
# waited for at most LOCK_WAIT_S by an operator's action, never by the watcher.
LOCK_NAME = ".flag.lock"
LOCK_WAIT_S = 1.5

log = logging.getLogger(__name__)


class StopService:
    def __init__(
        self,
        run_dir: str,
        audit: AuditLog,
        *,
        view=None,
        deadline_s: float,
        auto_rearm: bool,
        holding_after_s: float = 10.0,
    ):
        self.run_dir = run_dir
        self.audit = audit
        # The read side: the run it follows is ``view`` (a RunState: stop_inputs()).
        self.follow = StopView(
            run_dir, audit, view=view, deadline_s=deadline_s, holding_after_s=holding_after_s
        )
        self.deadline_s = deadline_s
        self.auto_rearm = auto_rearm
        self._lock = threading.Lock()

    # ------------------------------------------------------- what it shows
    def status(self, now: float, inputs: StopInputs | None = None) -> dict:
        """The body of ``GET /api/exit`` (``StopView.status``)."""
        return self.follow.status(now, inputs)

    def estimate(self, inputs: StopInputs | None = None) -> dict:
        """What the dialog shows before confirming (``StopView.estimate``)."""
        return self.follow.estimate(inputs)

    def estimated_s(self) -> float | None:
        """The estimate's seconds to stop, None before any rank reported (what Slurm's KillWait must cover)."""
        return self.estimate().get("seconds")

    def claims_min_s(self, ranks) -> float:
        return self.follow.claims_min_s(ranks)

    def read_flag(self) -> tuple[dict | None, str | None]:
        return self.follow.read_flag()

    # ------------------------------------------------------------ the flag
    @contextmanager
    def _flag_lock(self, wait_s: float = LOCK_WAIT_S, busy_is_expected: bool = False):
        """Serialise read-modify-write of the flag across threads and processes, for at most ``wait_s``.

        Yields None when the lock is held, else a sentence saying why the
        flag is written without it (``safeio.bounded_flock``: no symlink
        followed, nothing that blocks, ``LOCK_NB`` retried until
        ``wait_s``). A lock someone holds for ever therefore costs a stop
        ``wait_s`` at most; the flag is then written under the in-process
        lock alone, still atomically (a rename), and the audit row says so.
        A stop must never wait on the state of a file.

        ``busy_is_expected``: a lock that is only busy is no news (the
        dashboard and a waiting ``rankwatch stop`` see a stop end at the same
        moment, and one of them holds it): nothing is logged then.
        """
        with (
            self._lock,
            safeio.bounded_flock(self.run_dir, f"{runfiles.STATE_DIR}/{LOCK_NAME}", wait_s) as problem,
        ):
            if problem and not (busy_is_expected and safeio.LOCK_HELD in problem):
                log.warning("stop: %s; the flag is written without it (atomically)", problem)
            yield problem

    def _audit(self, action: str, **fields) -> str | None:
        """Record an audit row; a trail that cannot be written is reported, never fatal.

        The trail lives in the run directory too: a corrupt or locked database
        must not stop the stop. Returns the problem, or None when recorded.
        """
        try:
            self.audit.record(action, **fields)
        except AuditError as e:
            log.error("stop: %s not audited: %s", action, e)
            return str(e)
        return None

    # ------------------------------------------------------------- actions
    def request(
        self,
        reason: str,
        who: str,
        remote_addr: str | None,
        audit_duplicate: bool = True,
        basis: str = AUTHENTICATED,
    ) -> tuple[str, bool, str | None, str | None]:
        """Ask every rank to stop; a second press joins the first.

        Returns (request id, created, why it was not audited or None, why the
        flag was written without the flag lock or None). Nothing
        here reads a heartbeat, and a flag that cannot be parsed is simply
        replaced: a stop depends on writing one file, nothing else. With
        ``audit_duplicate`` False (a client past its write budget), a press
        that joins is not recorded. ``basis`` is the audit rows' (``policy``
        for the stop policy's request: it carried no token).
        """
        with self._flag_lock() as unlocked:
            flag, _ = self.read_flag()
            active = active_request(flag)
            if active is not None:
                rid = active["request_id"] or "native-flag"
                if not audit_duplicate:
                    return (
                        rid,
                        False,
                        "not recorded: too many requests from this address in the last minute",
                        unlocked,
                    )
                problem = self._audit(
                    "request",
                    basis=basis,
                    who=who,
                    remote_addr=remote_addr,
                    reason=reason,
                    request_id=rid,
                    outcome=f"duplicate: joined request {rid}",
                )
                return rid, False, problem, unlocked
            rid = runfiles.new_request_id()
            try:
                runfiles.write_flag(
                    self.run_dir,
                    True,
                    request_id=rid,
                    requested_at=time.time(),
                    requested_by=who,
                    reason=reason,
                )
            except OSError as e:
                self._audit(
                    "request",
                    basis=basis,
                    who=who,
                    remote_addr=remote_addr,
                    reason=reason,
                    request_id=rid,
                    outcome=_unlocked(f"failed: {e.strerror or e}", unlocked),
                )
                raise CannotWrite(f"could not write the stop flag: {e.strerror or e}") from None
            problem = self._audit(
                "request",
                basis=basis,
                who=who,
                remote_addr=remote_addr,
                reason=reason,
                request_id=rid,
                outcome=_unlocked("accepted", unlocked),
            )
            return rid, True, problem, unlocked

    def _pending_or_refuse(
        self, action: str, who: str, remote_addr: str | None, reason: str | None, refusal: str
    ) -> dict:
        """The pending request in the flag; if there is none, audit the refusal and raise ``StopRefused``."""
        active = active_request(self.read_flag()[0])
        if active is None:
            self._audit(
                action, who=who, remote_addr=remote_addr, reason=reason, outcome=f"refused: {refusal}"
            )
            raise StopRefused(refusal)
        return active

    def cancel(
        self, who: str, remote_addr: str | None, reason: str | None, inputs: StopInputs | None = None
    ) -> str:
        inputs = self.follow.inputs(inputs)
        ranks, facts = inputs.ranks, inputs.facts
        with self._flag_lock() as unlocked:
            active = self._pending_or_refuse("cancel", who, remote_addr, reason, "no stop request is pending")
            rid = active["request_id"]
            stages = self.follow.stages(rid, ranks, facts, active["requested_at"])
            committed = sorted(r for r, s in stages.items() if s["stage"] in COMMITTED)
            if committed:
                self._audit(
                    "cancel",
                    who=who,
                    remote_addr=remote_addr,
                    reason=reason,
                    request_id=rid,
                    outcome=f"refused: ranks {committed} already agreed",
                )
                raise StopRefused(
                    f"too late to cancel: rank(s) {ranks_text(committed)} already agreed on the stop step",
                )
            runfiles.write_flag(
                self.run_dir,
                False,
                cancelled=rid,
                cancelled_at=time.time(),
                cancelled_by=who,
                last_request=active,
            )
            self._audit(
                "cancel",
                who=who,
                remote_addr=remote_addr,
                reason=reason,
                request_id=rid,
                outcome=_unlocked("accepted", unlocked),
            )
            return rid

    def rearm(
        self,
        who: str,
        remote_addr: str | None,
        reason: str | None,
        force: bool = False,
        inputs: StopInputs | None = None,
    ) -> str:
        """Return the flag to ``{"GracefulExit": 0}`` after a stop, so a relaunch runs."""
        inputs = self.follow.inputs(inputs)
        ranks, world_size, facts = inputs.ranks, inputs.world_size, inputs.facts
        with self._flag_lock() as unlocked:
            active = self._pending_or_refuse(
                "rearm", who, remote_addr, reason, "nothing to re-arm: the flag does not say stop"
            )
            rid = active["request_id"]
            done = self.follow.completed(rid, ranks, world_size, facts, active["requested_at"]) or (
                facts is not None and facts.job_ended(world_size)
            )
            if not done and not force:
                self._audit(
                    "rearm",
                    who=who,
                    remote_addr=remote_addr,
                    reason=reason,
                    request_id=rid,
                    outcome="refused: the stop has not completed",
                )
                raise StopRefused(
                    "the stop has not completed on every rank; re-arming now lets "
                    "ranks that have not stopped run on (send force: true to do it anyway)",
                )
            self._write_rearmed(active, who)
            self._audit(
                "rearm",
                who=who,
                remote_addr=remote_addr,
                reason=reason,
                request_id=rid,
                outcome=_unlocked("accepted" if done else "accepted (forced before completion)", unlocked),
            )
            return rid

    def _write_rearmed(self, active: dict, who: str, outcome: str | None = None) -> None:
        runfiles.write_flag(
            self.run_dir,
            False,
            rearmed_after=active["request_id"],
            rearmed_at=time.time(),
            rearmed_by=who,
            last_request=active,
            **({"outcome": outcome} if outcome else {}),
        )

    def tick(self, now: float | None = None, inputs: StopInputs | None = None) -> dict:
        """The watcher's (and a waiting ``rankwatch stop``'s) part; returns the status it found.

        Records a completed (or not obeyed) stop once, and re-arms if
        configured. The flag is read once, and the run once; only a tick that
        completes a stop reads the flag again, under its lock and after writing it.
        """
        now = time.time() if now is None else now
        inputs = self.follow.inputs(inputs)
        flag, flag_error = self.read_flag()
        if self._complete(flag, inputs, now):
            flag, flag_error = self.read_flag()
        return self.follow.status_of(flag, flag_error, inputs, now)

    def _complete(self, flag: dict | None, inputs: StopInputs, now: float) -> bool:
        """Record the pending stop's end once, and re-arm if configured; whether the flag was written."""
        ranks, world_size, facts = inputs.ranks, inputs.world_size, inputs.facts
        active = active_request(flag)
        if active is None:
            return False
        rid = active["request_id"]
        if rid is None:
            return False
        done = self.follow.completed(rid, ranks, world_size, facts, active["requested_at"])
        # A dashboard that was not watching when the ranks stopped sees only a later launch:
        # attempts.jsonl says whether an earlier one stopped for this request.
        earlier = (
            served_by(self.run_dir, rid)
            if not done and relaunched_since(ranks, active["requested_at"])
            else None
        )
        done = done or earlier is not None
        verdict = None if done else self.follow.job_over(rid, ranks, world_size, facts, now)
        ignored = verdict is not None
        if not (done or ignored):
            return False
        # The watcher never waits on a lock a rank can hold: one try, and if
        # it is held the completion is recorded anyway (audit.has keeps it once).
        # Held is the usual case when a `rankwatch stop` waits beside a dashboard:
        # both observe the end at once, so it prints no warning.
        with self._flag_lock(wait_s=0.0, busy_is_expected=True):
            current_flag, current_error = self.read_flag()
            current = active_request(current_flag)
            if current is None or current["request_id"] != rid:
                return True  # someone else re-armed or replaced it meanwhile: read it again
            # once=True: a dashboard and a waiting `rankwatch stop` may both see the end at once,
            # and neither may hold the flag lock (wait_s=0): the trail's insert decides.
            if earlier is not None:
                self._audit(
                    "complete",
                    once=True,
                    basis=OBSERVED,
                    who=SYSTEM,
                    request_id=rid,
                    outcome=f"completed: attempt {earlier}, an earlier launch of this run, stopped for it "
                    "(rankwatch/attempts.jsonl)",
                    detail={"attempt": earlier},
                )
            else:
                status = self.follow.status_of(current_flag, current_error, inputs, now)
                self._audit(
                    "complete",
                    once=True,
                    basis=OBSERVED,
                    who=SYSTEM,
                    request_id=rid,
                    outcome=f"{NOT_OBEYED if ignored else 'completed'}: {status['summary']}",
                    detail={
                        "stop_step": status["stop_step"],
                        "save_s": status["save_s"],
                        "bytes": status["bytes"],
                    },
                )
            # On the files' word alone the flag stays: whoever forged "finished" must not
            # disarm a stop the ranks would still obey. The operator re-arms it.
            if self.auto_rearm and verdict != "claims":
                self._write_rearmed(current, SYSTEM, NOT_OBEYED if ignored else None)
                self._audit(
                    "rearm",
                    once=True,  # the automatic re-arm of a request, whoever saw it first
                    basis=OBSERVED,
                    who=SYSTEM,
                    request_id=rid,
                    outcome="accepted (automatic: the job ended without obeying the stop)"
                    if ignored
                    else "accepted (automatic after completion)",
                )
            return True
        return False


def _unlocked(outcome: str, problem: str | None) -> str:
    """An audit outcome that says when the flag was written without the flag lock."""
    return f"{outcome} (written without the flag lock: {problem})" if problem else outcome
