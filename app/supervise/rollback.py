"""The enforce half of the loss-spike ladder: roll the run back to a healthy set and skip the bad data.

The detector (the dashboard's watcher, or the agent) writes the pending
request (``trainer_bridge/rundir/rollbacks.py``) and asks for a graceful
stop. When the attempt then ends by that stop, ``rankwatch launch`` does not
end the run (``decide``):

1. **The budget**: at most ``max_rollbacks`` rollbacks in the run directory,
   counted from the ``relaunched`` lines of ``rollbacks.jsonl`` (whatever
   supervisor made them, as the restart budget is counted from
   ``attempts.jsonl``). Past it: an ``exhausted`` line, and the run ends
   with ``ROLLBACK_EXHAUSTED`` (needs attention).
2. **The rung**: a spike whose first step falls between the previous
   rollback's target and ``cooldown_steps`` past the data it skipped is the
   same place again: one rung further, twice the batches skipped per rung
   and ``RANKWATCH_LR_SCALE`` = 0.5 per rung past the first (a script opts in
   to read it). Each rung skips further, so it never loops; past the budget
   it stops.
3. **The target**: the newest set that is complete, healthy and older than
   ``first_step - margin`` (``app/checkpoints/target.py``, the page's choice
   too: a ``*_breakpoint.ckpt``, MindFormers' ``health_ckpts.json``, the bridge's NaN-loss flag and
   non-finite tensors all pass a set over), and whose step the detector's
   record does not show abnormal (a span ``first_step`` .. evidence step of
   an earlier ``rollbacks.jsonl`` line). None: a ``refused`` line, and the
   run ends with ``ROLLBACK_REFUSED`` (needs attention).
4. **The relaunch**: pinned to the target (``RANKWATCH_RESUME_STEP``), with
   ``RANKWATCH_SKIP_FROM`` (the first step) and ``RANKWATCH_SKIP_BATCHES``;
   the bridge resumes the weights of the target and the data at global step
   ``first_step - 1 + skip`` (docs/cli.md, "Loss-spike rollbacks"). Just
   before the relaunch the target is looked for again: deleted meanwhile,
   the next one is taken and the note says so. The request is cleared and a
   ``relaunched`` line appended.

A later relaunch after a crash, resumed from a set older than the data the
last rollback skipped, skips it again (``carry``).

A request asked before the attempt started is stale (its attempt is gone):
it is cleared and the stop ends the run as any stop does. A request that
joined an operator's stop (the flag's ``requested_by`` names someone, not
``policy``), and a stop asked by Ctrl-C or SIGTERM to the supervisor, end
the run too: the operator's stop wins.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Container
from dataclasses import dataclass, field

from app.audit import POLICY  # the flag's ``requested_by`` of a stop the policy asked
from app.checkpoints import target
from app.supervise import policy
from trainer_bridge.rundir import ckptindex, rollbacks, runfiles

MAX_ROLLBACKS = 3
MARGIN_STEPS = target.MARGIN_STEPS
COOLDOWN_STEPS = 100
# The LR scale per rung past the first, and the skip's growth per rung.
LR_SCALE_PER_RUNG = 0.5
SKIP_GROWTH = 2
# The rollback's environment: set on its relaunch, dropped from every other.
ENV = (runfiles.RESUME_STEP_ENV, rollbacks.SKIP_BATCHES_ENV, rollbacks.SKIP_FROM_ENV, rollbacks.LR_SCALE_ENV)


@dataclass
class Settings:
    max_rollbacks: int = MAX_ROLLBACKS
    margin: int = MARGIN_STEPS
    cooldown_steps: int = COOLDOWN_STEPS


def publish(run_dir: str, settings: Settings, say: Callable[[str], None]) -> None:
    """Publish ``settings`` for the dashboard (``rollbacks.SupervisorSettings``); a failure is said, not raised."""
    try:
        rollbacks.publish_settings(
            run_dir,
            rollbacks.SupervisorSettings(
                max_rollbacks=settings.max_rollbacks,
                margin=settings.margin,
                cooldown_steps=settings.cooldown_steps,
                supervisor_pid=os.getpid(),
                host=socket.gethostname(),
                since=time.time(),
            ),
        )
    except OSError as e:
        say(
            f"WARNING: cannot write rankwatch/{rollbacks.SETTINGS_NAME} ({e}): the dashboard assumes the "
            f"default rollback margin of {MARGIN_STEPS}"
        )


@dataclass
class Decision:
    """What the supervisor does after a stop asked by the detector."""

    code: int | None  # the exit status when the run ends here; None: relaunch with ``env``
    cause: dict  # the attempt's cause (kind `rollback`)
    said: str  # what the terminal and the supervised line's note say
    env: dict = field(default_factory=dict)  # the rollback's variables, for the relaunch
    resume: dict | None = None
    line: rollbacks.Line | None = None  # appended once the relaunch is certain


def evidence_text(ev: rollbacks.Evidence) -> str:
    if ev.text:
        return ev.text[:500]
    level = "" if ev.level is None else f" against a level of {ev.level:.4g}"
    value = ev.value if isinstance(ev.value, str) else f"{ev.value:.4g}" if ev.value is not None else "?"
    return f"{ev.rule}: rank {ev.rank} at global step {ev.step}: {value}{level}"


def describe(cause: dict) -> str:
    """A rollback cause in one line, as the terminal, ``rankwatch status`` and the page say it."""
    text = f"loss-spike rollback ({cause.get('rule')}): {cause.get('evidence') or '?'}"
    if cause.get("to_step") is not None:
        text += (
            f"; from global step {cause.get('from_step')} back to global step {cause['to_step']} "
            f"(set {cause.get('to_set')}), {cause.get('skip_batches')} batches skipped past it"
        )
    return text


def choose(
    run_dir: str, world: int, req: rollbacks.Request, settings: Settings, exclude: Container[str] = ()
) -> target.Choice:
    """The target, as the page names it (``target.rollback_target``), with the supervisor's tensor check."""
    lines, _ = rollbacks.read_lines(run_dir)
    index = ckptindex.scan(run_dir, world_size=world)
    return target.rollback_target(
        index, run_dir, req.first_step, settings.margin, lines, tensors=policy.tensors(), exclude=exclude
    )


def rung_for(req: rollbacks.Request, lines: list[rollbacks.Line], cooldown: int) -> tuple[int, int]:
    """(rung, batches to skip): one rung past the previous rollback's when the spike is at the same place."""
    prev = next((ln for ln in reversed(lines) if ln.kind == "relaunched"), None)
    rung = req.rung
    if prev is not None:
        start = prev.target_step if prev.target_step is not None else 0
        if start <= req.first_step <= prev.first_step + prev.skip_batches + cooldown:
            rung = max(rung, prev.rung + 1)
    rung = min(rung, 100)
    skip = req.skip_batches * SKIP_GROWTH ** (rung - req.rung)
    return rung, min(skip, 1 << 40)


def pending(
    run_dir: str, since: float, say: Callable[[str], None], stopped_by: str | None = None
) -> rollbacks.Request | None:
    """The request asked during the attempt that began at ``since``; a stale or bad one is cleared.

    ``stopped_by``: the operator asked the supervisor itself to stop (Ctrl-C, SIGTERM): their stop wins.
    """
    req, bad = rollbacks.read_request(run_dir)
    if bad:
        say(f"loss-spike rollback request ignored: {bad}")
    elif req is not None and req.asked_at < since:
        say(f"loss-spike rollback request ignored: asked at {req.asked_at:.0f}, before this attempt began")
        req = None
    elif req is None:
        return None
    elif (who := stopped_by or operator(run_dir)) is not None:
        say(
            f"a loss-spike rollback was pending, but the stop was asked by {who[:100]}, not the policy: "
            "the run ends as asked (the request is cleared)"
        )
        req = None
    if req is None:
        _clear(run_dir, say)
    return req


def operator(run_dir: str) -> str | None:
    """Who asked the stop, when the flag names someone other than the policy (their stop wins)."""
    try:
        flag = runfiles.read_flag(run_dir)
    except (OSError, runfiles.FlagError):
        return None
    who = flag.raw.get("requested_by") if flag is not None and flag.exit else None
    return repr(who) if isinstance(who, str) and who and who != POLICY else None


def decide(
    run_dir: str, world: int, req: rollbacks.Request, settings: Settings, say: Callable[[str], None]
) -> Decision:
    """The budget, the rung and the target for ``req``; writes the ``exhausted`` or ``refused`` line."""
    lines, _ = rollbacks.read_lines(run_dir)
    done = sum(1 for ln in lines if ln.kind == "relaunched")
    rung, skip = rung_for(req, lines, settings.cooldown_steps)
    text = evidence_text(req.evidence)
    cause = {
        "kind": "rollback",
        "rule": req.rule,
        "evidence": text,
        "from_step": req.first_step,
        "skip_batches": skip,
        "rung": rung,
    }
    if done >= settings.max_rollbacks:
        said = (
            f"loss spike at global step {req.first_step} ({text}); the rollback budget is used up "
            f"({done} of {settings.max_rollbacks} in this run directory): ending the run, it needs attention"
        )
        _record(run_dir, req, "exhausted", rung, skip, said, say)
        _clear(run_dir, say)
        return Decision(policy.ROLLBACK_EXHAUSTED, cause, said)
    before = req.first_step - settings.margin
    choice = choose(run_dir, world, req, settings)
    if choice.global_step is None:
        passed = f" ({choice.note})" if choice.note else ""
        said = (
            f"loss spike at global step {req.first_step} ({text}); no complete healthy set older than "
            f"global step {before}{passed}: ending the run, it needs attention"
        )
        _record(run_dir, req, "refused", rung, skip, said, say)
        _clear(run_dir, say)
        return Decision(policy.ROLLBACK_REFUSED, cause, said)
    return _relaunch(run_dir, req, rung, skip, choice, cause, text)


def skip_from(req: rollbacks.Request | rollbacks.Line) -> int:
    """Where the skipped data starts counting: the step the abnormal value was seen at.

    The weights go back before ``first_step`` (the step after the last normal
    sample), but the bad batch may lie anywhere up to the step the detector
    saw the value at: heartbeats sample the loss, and on a loaded host one
    sample can come 15 steps after the last. Counting the skip from
    ``first_step`` then replayed the bad batch, and a second rollback was needed.
    """
    return max(req.first_step, req.evidence.step)


def _relaunch(run_dir, req, rung, skip, choice, cause, text) -> Decision:
    env = {
        runfiles.RESUME_STEP_ENV: str(choice.global_step),
        rollbacks.SKIP_FROM_ENV: str(skip_from(req)),
        rollbacks.SKIP_BATCHES_ENV: str(skip),
    }
    if rung > 1:
        env[rollbacks.LR_SCALE_ENV] = repr(LR_SCALE_PER_RUNG ** (rung - 1))
    resume = {"set": choice.set_id, "global_step": choice.global_step}
    said = (
        f"loss spike at global step {req.first_step} ({text}): rolling back to set {choice.set_id} "
        f"(global step {choice.global_step}), skipping the data up to global step {data_step(env)}"
        f" (rung {rung}{', learning-rate scale ' + env[rollbacks.LR_SCALE_ENV] if rung > 1 else ''})"
    )
    if choice.note:
        said += f"; {choice.note}"
    cause = {**cause, "to_set": choice.set_id, "to_step": choice.global_step}
    line = rollbacks.Line(
        kind="relaunched",
        at=time.time(),
        rule=req.rule,
        evidence=req.evidence,
        first_step=req.first_step,
        target_step=choice.global_step,
        target_set=(choice.set_id or "")[:200] or None,
        skip_batches=skip,
        rung=rung,
        note=said[:1000],
    )
    return Decision(None, cause, said, env, resume, line)


def confirm(
    run_dir: str,
    world: int,
    decision: Decision,
    settings: Settings,
    req: rollbacks.Request,
    say: Callable[[str], None],
) -> str | None:
    """Just before the relaunch: is the target still there? If not, take the next one; return the note.

    Returns None when nothing changed. When no target is left, the decision
    turns into a refusal (its ``code`` set, a ``refused`` line written).
    """
    target = decision.resume["set"]
    index = ckptindex.scan(run_dir, world_size=world)
    if any(s.id == target and s.complete for s in index.sets):
        return None
    gone = [target]
    while True:
        choice = choose(run_dir, world, req, settings, exclude=gone)
        if choice.global_step is None:
            said = f"the rollback target set {target} was deleted during the rollback, and no other is left"
            decision.code = policy.ROLLBACK_REFUSED
            decision.said = f"{said}: ending the run, it needs attention"
            _record(
                run_dir, req, "refused", decision.cause["rung"], decision.cause["skip_batches"], said, say
            )
            _clear(run_dir, say)
            return decision.said
        if any(s.id == choice.set_id and s.complete for s in ckptindex.scan(run_dir, world_size=world).sets):
            break
        gone.append(choice.set_id)
    note = (
        f"the rollback target set {target} was deleted during the rollback; taking the next one: set "
        f"{choice.set_id} (global step {choice.global_step})"
    )
    decision.env[runfiles.RESUME_STEP_ENV] = str(choice.global_step)
    decision.resume = {"set": choice.set_id, "global_step": choice.global_step}
    decision.cause.update(to_set=choice.set_id, to_step=choice.global_step)
    decision.said = f"{decision.said}; {note}"
    if decision.line is not None:
        decision.line = decision.line.model_copy(
            update={
                "target_step": choice.global_step,
                "target_set": choice.set_id[:200],
                "note": decision.said[:1000],
            }
        )
    return note


def committed(run_dir: str, decision: Decision, attempt: int, say: Callable[[str], None]) -> None:
    """The relaunch is made: the ``relaunched`` line, and the request cleared."""
    if decision.line is not None:
        try:
            rollbacks.append(run_dir, decision.line.model_copy(update={"attempt": attempt}))
        except OSError as e:
            say(f"WARNING: rollbacks.jsonl not written ({e}): the rollback budget cannot count this one")
    _clear(run_dir, say)


def restart(
    run_dir: str,
    world: int,
    settings: Settings,
    attempt: int,
    say: Callable[[str], None],
    decide_pending: bool = True,
) -> tuple[int | None, dict]:
    """Where a supervisor started again on a run with attempts goes on from: (exit status or None, env).

    A rollback request still pending was asked while no supervisor could act on it (the last one
    was killed after the stop, before its relaunch): it is decided now, as at the stop. Else the
    newest healthy set, with the last rollback's skip carried (``carry``). ``decide_pending`` False
    (one node of several: each would decide, and write, on its own): the request is left as it is.
    """
    req = pending(run_dir, 0.0, say) if decide_pending else None
    if req is not None:
        say("a loss-spike rollback was left undecided by an earlier supervisor: deciding it now")
        d = decide(run_dir, world, req, settings, say)
        if d.code is None:
            confirm(run_dir, world, d, settings, req, say)
        say(d.said)
        if d.code is not None:
            return d.code, {}
        committed(run_dir, d, attempt, say)
        return None, dict(d.env)
    choice = policy.choose_resume(run_dir, world)
    env = {}
    if choice.global_step is not None:
        env[runfiles.RESUME_STEP_ENV] = str(choice.global_step)
        env.update(carry(run_dir, choice.global_step))
        say(f"resuming from set {choice.set_id} (global step {choice.global_step})")
    if choice.note:
        say(choice.note)
    return None, env


def data_step(env: dict) -> int:
    """The global step the relaunched job's data (and step count) resumes at, by the bridge's rule."""
    resumed = env.get(runfiles.RESUME_STEP_ENV, "")
    return rollbacks.data_step(int(resumed) if resumed.isdigit() else 0, env)


def carry(run_dir: str, resumed: int) -> dict:
    """The last rollback's skip, for any later resume from a set older than the data it skipped.

    A crash after a rollback may leave no newer healthy set than the target:
    resumed there without the skip, the job would train the bad batches again.
    """
    lines, _ = rollbacks.read_lines(run_dir)
    last = next((ln for ln in reversed(lines) if ln.kind == "relaunched"), None)
    if last is None or last.target_step is None or not last.target_step <= resumed:
        return {}
    env = {rollbacks.SKIP_FROM_ENV: str(skip_from(last)), rollbacks.SKIP_BATCHES_ENV: str(last.skip_batches)}
    if rollbacks.data_step(resumed, env) <= resumed:
        return {}
    if last.rung > 1:
        env[rollbacks.LR_SCALE_ENV] = repr(LR_SCALE_PER_RUNG ** (last.rung - 1))
    return env


def environment(base: dict, decision: Decision | None) -> dict:
    """``base`` without any rollback variable, plus this rollback's."""
    env = {k: v for k, v in base.items() if k not in ENV}
    if decision is not None:
        env.update(decision.env)
    return env


def _record(run_dir, req, kind, rung, skip, said, say) -> None:
    try:
        rollbacks.append(
            run_dir,
            rollbacks.Line(
                kind=kind,
                at=time.time(),
                rule=req.rule,
                evidence=req.evidence,
                first_step=req.first_step,
                skip_batches=skip,
                rung=rung,
                note=said[:1000],
            ),
        )
    except OSError as e:
        say(f"WARNING: rollbacks.jsonl not written: {e}")


def _clear(run_dir: str, say: Callable[[str], None]) -> None:
    try:
        rollbacks.clear_request(run_dir)
    except OSError as e:
        say(f"WARNING: the rollback request could not be cleared: {e}")
