"""Verdict rules: what state a rank is in and why, as pure functions.

Everything here takes heartbeat dicts (README, "Heartbeat", schema 1) and the
current time, and does no I/O and reads no clock, so the rules are tested by
feeding heartbeat sequences. ``app.run.state`` does the reading and the process
probes and hands the results in.

The verdicts, in the order the rules are tried:

* **pending** - the rank has not written a heartbeat yet.
* **failed / finished / exited** - the rank said so in ``state``; these end a
  rank's life, so no later rule overrides them.
* **dead** - the process is gone (a probe on this host says so) or the
  heartbeats stopped for longer than ``dead_after_s`` (the reason says when
  the probe finds the process still running: stuck, or unable to write).
* **stalled** - the process is stopped (a probe on this host says so); or no
  heartbeat for ``stall_min_s`` (the bridge writes one about once a second
  whatever the step time, at most about 2 s apart, so the process is stuck,
  or cannot write);
  or no step for max(``stall_min_s``, ``stall_factor`` x the rank's median
  step time), which is not applied while starting (graph compilation can
  take minutes) or saving a checkpoint. A rank stalled while its
  heartbeats still arrive is likely blocked in a collective: its reason
  names the ranks that are dead, stopped or silent.
* **straggler** - the rank's cost per step is at least ``straggler_ratio`` x
  the median of its peers' (and ``straggler_min_gap_ms`` more in absolute
  terms). The cost is the rank's own *work* per step when every stepping rank
  reports ``step_in_ms`` and ``step_out_ms`` (see ``compare_costs``), else its
  median wall step time. A rank is compared only once its window holds
  ``straggler_min_steps`` step times (start-up steps are noise). A straggler
  stays one until clearly back (``app.run.peers.straggling``: hysteresis).
* **starting** - the rank has reported but not finished its first step yet
  (graph compilation can take minutes): neutral, neither healthy nor a
  problem.
* **healthy** - none of the above.

A rank read from msrun's worker log (``from_log``; see ``app.run.logmode``) has
no heartbeat thread: its log grows only when the script prints. So the
heartbeat-silence rules do not apply to it; it is stalled when its log shows
no step for max(``stall_min_s``, ``stall_factor`` x the median time between
its step lines), and dead only when its process is known to be gone (a probe
on this host, or msrun's own words, which ``app.run.state`` hands in as
``process_gone``); it is never ``node_lost``, for the same reason.

``app.run.judging`` adds two after these rules (``app.run.boardrules``): **node_lost**, for every rank of
a host that went silent as one while other hosts still report (a machine or
network failure, named within ``stall_min_s`` instead of ``dead_after_s``),
and **corrupt**, for a rank whose heartbeat file does not validate against
``trainer_bridge.rundir.schema`` (the reason names the field, and the row keeps the
last valid heartbeat's figures).

Why work and not the wall step time: in synchronous data parallelism every
rank's wall step time is the same, because the fast ranks wait inside the
gradient AllReduce for the slow one. What differs is where the time goes.
A rank's time between steps (``step_out_ms``: data loading, callbacks, host
work) is its own; its time inside a step (``step_in_ms``) is compute plus
waiting for peers, and the slowest rank waits for nobody, so the fastest
in-step time of the job is about the pure compute. ``work = step_out_ms +
min over ranks of step_in_ms`` is then what the rank would cost alone.

The score is nvidia-resiliency-ext's relative performance score with the
peer median as the reference instead of the fastest rank (one unusually fast
rank should not make everyone look slow): ``min(1, peer median / own)``, so
1.0 is "as fast as its peers" and 0.5 "twice as slow".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.run.peers import OTHERS_MEDIAN, median, peer_median, ratio_text, straggling
from app.run.stepcost import StepWindow, compare_costs, number, score
from app.run.verdicts import STEPPING_STATES
from trainer_bridge.rundir.listing import first_of


@dataclass(frozen=True)
class Thresholds:
    """The health settings (see ``app.config.SETTINGS`` for each one's reason)."""

    straggler_ratio: float = 1.5
    straggler_min_gap_ms: float = 5.0
    straggler_window: int = 32
    straggler_min_steps: int = 16
    stall_min_s: float = 5.0
    stall_factor: float = 5.0
    dead_after_s: float = 30.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Thresholds:
        return cls(**{f: config[f.upper()] for f in cls.__dataclass_fields__ if f.upper() in config})


@dataclass(frozen=True)
class Verdict:
    health: str
    reason: str
    score: float | None = None
    # Why a dead or stalled rank is so, as one word, for its peers' reasons:
    # "gone" (process gone), "silent" (no heartbeats), "stopped" (SIGSTOP),
    # "hung" (heartbeats but no steps); None otherwise.
    cause: str | None = None


@dataclass(frozen=True, slots=True)
class RankEvidence:
    """Everything one rank's verdict rests on (``judge``), gathered by its caller.

    ``hb``: the rank's newest valid heartbeat (None: none yet). ``own_ms``:
    its cost per step; ``peer_ms``: the median of its stepping peers' (None
    when there is nothing to compare with). The cost is the median of the
    rank's wall step window, or, when ``work`` is given as
    ``(step_out_ms, fastest step_in_ms)``, the rank's own work per step (their
    sum; see ``compare_costs``). ``wall_ms``: the wall median, for the stall
    limit (default: ``own_ms``). ``process_gone``: a sentence saying why the
    rank's process is known to be gone, from a probe (None: alive or
    unknown); ``process_stopped``: that the probe found it stopped (SIGSTOP,
    a debugger); ``process_alive``: that it found it running. ``warming``:
    the rank has peers but too few steps yet to be compared. ``from_log``:
    ``hb`` was read from the rank's worker log, whose step lines come every
    ``log_pace_ms`` (median; None: not known yet).
    """

    hb: Mapping[str, Any] | None
    own_ms: float | None = None
    peer_ms: float | None = None
    wall_ms: float | None = None
    work: tuple[float, float] | None = None
    process_gone: str | None = None
    process_stopped: str | None = None
    process_alive: bool = False
    warming: bool = False
    from_log: bool = False
    log_pace_ms: float | None = None
    # Its last verdict was straggler, which it stays until clearly back (``app.run.peers.straggling``).
    was_straggler: bool = False


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def where(hb: Mapping[str, Any]) -> str:
    """Where a rank was, for a reason: its global step, or its epoch and step when only those are known."""
    gstep = hb.get("global_step")
    if gstep is not None:
        return f"global step {gstep}"
    return f"epoch {hb.get('epoch')} step {hb.get('step')}"


def judge(ev: RankEvidence, now: float, th: Thresholds) -> Verdict:
    """One rank's verdict at time ``now``, from its evidence (``RankEvidence`` says what each part is)."""
    hb = ev.hb
    if not hb:
        return Verdict("pending", "has not written a heartbeat yet")
    state = hb.get("state")
    at = where(hb)
    rel = score(ev.own_ms, ev.peer_ms)
    if state == "failed":
        error = hb.get("error")
        return Verdict("failed", f"failed: {error}" if error else "failed without an error message")
    if state == "finished":
        return Verdict("finished", f"finished training at {at}", rel)
    if state == "exited":
        stop = hb.get("stop") if isinstance(hb.get("stop"), dict) else {}
        ckpt = stop.get("checkpoint") if isinstance(stop.get("checkpoint"), dict) else {}
        saved = f", checkpoint {ckpt['path']}" if ckpt.get("path") else ""
        return Verdict("exited", f"stopped gracefully at {at}{saved}", rel)

    if ev.process_gone:
        return Verdict("dead", ev.process_gone, cause="gone")
    written = number(hb.get("time"))
    age = now - written if written is not None else math.inf
    if ev.process_stopped:
        return Verdict("stalled", f"{ev.process_stopped} (last: {at})", rel, cause="stopped")
    # Heartbeats come about once a second (at most ~2 s apart) whatever the step time, so
    # STALL_MIN_S without one means the writer is stuck, not a slow step.
    # A worker log has no such beat: its silence is judged by the step rule.
    silent = not ev.from_log and age > th.stall_min_s
    why_silent = (
        f"; its process {hb.get('pid')} still runs, so it is stuck, or training but "
        "unable to write its heartbeat (disk full? read-only run directory?)"
        if ev.process_alive
        else ": the process is gone, stuck or stopped, or cannot write "
        "to the run directory (disk full? read-only?)"
    )
    if not ev.from_log and age > th.dead_after_s:
        return Verdict(
            "dead",
            f"no heartbeat for over {th.dead_after_s:g} s "
            f"(last from {hb.get('host')} pid {hb.get('pid')}){why_silent}",
            cause="silent",
        )
    if silent:
        return Verdict(
            "stalled",
            f"no heartbeat for over {th.stall_min_s:g} s (last: {at}){why_silent}",
            rel,
            cause="silent",
        )

    if state == "starting":
        if ev.from_log:
            return Verdict("starting", "up, no step in its log yet (compiling?)")
        return Verdict("starting", "up, waiting for the first step (compiling)")
    if state == "saving":
        return Verdict("healthy", "saving a checkpoint", rel)

    last_step = number(hb.get("last_step_at"))
    if last_step is None:
        last_step = number(hb.get("started_at"))
    pace_ms = ev.own_ms if ev.wall_ms is None else ev.wall_ms
    if ev.from_log and ev.log_pace_ms is not None:
        pace_ms = max(pace_ms or 0.0, ev.log_pace_ms)  # a log printed every N steps
    limit = max(th.stall_min_s, th.stall_factor * (pace_ms or 0.0) / 1000.0)
    if last_step is not None and now - last_step > limit:
        if ev.from_log:
            alive = (
                f"; its process {hb.get('pid')} still runs (hung, or a step longer than that)"
                if ev.process_alive
                else "; its process cannot be checked from this host (it may be hung or dead)"
            )
            return Verdict(
                "stalled", f"no step in its log for over {limit:.3g} s (last: {at}){alive}", rel, cause="hung"
            )
        return Verdict(
            "stalled",
            f"no step finished for over {limit:.3g} s (last: {at})",
            rel,
            cause="hung",
        )

    if (
        ev.own_ms is not None
        and ev.peer_ms is not None
        and straggling(ev.own_ms, ev.peer_ms, th.straggler_ratio, th.straggler_min_gap_ms, ev.was_straggler)
    ):
        if ev.work is not None:
            out_ms, fastest_ms = ev.work
            return Verdict(
                "straggler",
                f"a step of its own work {_ms(ev.own_ms)} vs {OTHERS_MEDIAN} {_ms(ev.peer_ms)} "
                f"({ratio_text(ev.own_ms, ev.peer_ms)}): {_ms(out_ms)} between steps "
                f"+ {_ms(fastest_ms)} fastest in-step time",
                rel,
            )
        return Verdict(
            "straggler",
            f"median step {_ms(ev.own_ms)} is {ratio_text(ev.own_ms, ev.peer_ms)} {OTHERS_MEDIAN} {_ms(ev.peer_ms)}",
            rel,
        )
    if state == "stopping":
        return Verdict("healthy", "stopping gracefully", rel)
    if ev.warming:
        return Verdict("healthy", "training (too few steps yet to compare with its peers)")
    if ev.peer_ms is None:
        return Verdict("healthy", "training (no peers to compare with)", rel)
    # No numbers here: they move with every heartbeat of every rank, and a
    # changed reason is a changed row to push (1024 of them per tick).
    what = "work per step" if ev.work is not None else ""
    return Verdict(
        "healthy",
        f"training within {th.straggler_ratio:g}x of {OTHERS_MEDIAN}{' ' + what if what else ''}",
        rel,
    )


def judge_all(
    latest: Mapping[int, Mapping[str, Any] | None],
    own_ms: Mapping[int, float | None],
    now: float,
    th: Thresholds,
    process_gone: Mapping[int, str] | None = None,
    split: Mapping[int, tuple[float, float] | None] | None = None,
    *,
    process_stopped: Mapping[int, str] | None = None,
    process_alive: set[int] | frozenset[int] = frozenset(),
    steps: Mapping[int, int] | None = None,
    log_pace: Mapping[int, float | None] | None = None,
    stragglers: set[int] | frozenset[int] = frozenset(),
) -> dict[int, Verdict]:
    """Every rank's verdict: peers are the other ranks that are stepping.

    ``own_ms`` is each rank's median wall step time, ``split`` its
    ``StepWindow.split_ms`` (see ``compare_costs`` for which one is compared).
    ``steps`` is how many step times each rank's window holds: a rank with
    fewer than ``straggler_min_steps`` is neither judged nor a peer yet
    (None: every rank is). The ranks in ``log_pace`` were read from their
    worker logs, with the median ms between their step lines (or None).
    ``stragglers``: the ranks whose last verdict was straggler (the rule's hysteresis).
    O(n log n) for the one sort, then O(log n) per rank.
    """
    log_pace = log_pace or {}
    process_gone = process_gone or {}
    process_stopped = process_stopped or {}
    basis, costs, fastest = compare_costs(latest, own_ms, split)
    stepping = {r for r, hb in latest.items() if hb and hb.get("state") in STEPPING_STATES}
    warming = set()
    if steps is not None:
        warming = {r for r in latest if steps.get(r, 0) < th.straggler_min_steps}
        costs = {r: (None if r in warming else c) for r, c in costs.items()}
        if len(stepping) < 2:
            warming.clear()  # nobody to compare with anyway
    times = sorted(costs[r] for r in stepping if costs.get(r) is not None)
    whole = median(times)
    out = {}
    for r, hb in latest.items():
        own = costs.get(r)
        if own is None:
            peer = whole
        elif r in stepping:
            peer = peer_median(times, own)
        else:
            peer = whole
        work = (split[r][1], fastest) if basis == "work" and own is not None else None
        evidence = RankEvidence(
            hb,
            own_ms=own,
            peer_ms=peer,
            wall_ms=own_ms.get(r),
            work=work,
            process_gone=process_gone.get(r),
            process_stopped=process_stopped.get(r),
            process_alive=r in process_alive,
            warming=r in warming,
            from_log=r in log_pace,
            log_pace_ms=log_pace.get(r),
            was_straggler=r in stragglers,
        )
        out[r] = judge(evidence, now, th)
    return _with_blockers(latest, out)


# How a rank that holds the others up is named in their reasons.
BLOCKER_WORDS = {
    "gone": ("is dead", "are dead"),
    "silent": ("sends no heartbeats", "send no heartbeats"),
    "stopped": ("is stopped", "are stopped"),
}


def _with_blockers(
    latest: Mapping[int, Mapping[str, Any] | None], verdicts: dict[int, Verdict]
) -> dict[int, Verdict]:
    """Name the ranks a hung rank is likely waiting for.

    In synchronous training a rank that dies, stops or hangs leaves its
    peers blocked in the next collective: alive, writing heartbeats, but not
    stepping. Their own reason ("no step for 5 s") does not say why, so each
    hung rank's reason names the ranks that were training and are now dead,
    stopped or silent.
    """
    blockers: dict[str, list[int]] = {}
    for r, v in verdicts.items():
        hb = latest.get(r) or {}
        if v.cause in BLOCKER_WORDS and hb.get("state") in STEPPING_STATES:
            blockers.setdefault(v.cause, []).append(r)
    note = blocker_note(blockers)
    if note is None:
        return verdicts
    return {r: (with_note(v, note) if v.cause == "hung" else v) for r, v in verdicts.items()}


def blocker_note(blockers: Mapping[str, Iterable[int]]) -> str | None:
    """The sentence a hung rank's reason gets, naming ``{cause: ranks}`` that block it; None if none."""
    parts = []
    total = 0
    for cause in BLOCKER_WORDS:
        ranks = sorted(blockers.get(cause, ()))
        total += len(ranks)
        if ranks:
            one, many = BLOCKER_WORDS[cause]
            named = first_of(ranks, 8)
            parts.append(f"rank {named} {one}" if len(ranks) == 1 else f"ranks {named} {many}")
    if not parts:
        return None
    them = "it" if total == 1 else "them"
    return f"; {' and '.join(parts)}: this rank is likely blocked in a collective with {them}"


def with_note(verdict: Verdict, note: str) -> Verdict:
    return Verdict(verdict.health, verdict.reason + note, verdict.score, verdict.cause)


def judge_sequences(
    heartbeats: Mapping[int, Iterable[Mapping[str, Any]]],
    now: float,
    th: Thresholds,
    process_gone: Mapping[int, str] | None = None,
) -> dict[int, Verdict]:
    """Verdicts for ranks given each one's heartbeats in the order they were written.

    The same fold ``app.run.state`` does incrementally, in one call: the way the
    rules are meant to be read and tested.
    """
    latest, own, split, steps = {}, {}, {}, {}
    for r, seq in heartbeats.items():
        window = StepWindow(th.straggler_window)
        hb = None
        for hb in seq:
            window.add(hb)
        latest[r] = hb
        own[r] = window.median_ms
        split[r] = window.split_ms
        steps[r] = window.steps
    return judge_all(latest, own, now, th, process_gone, split, steps=steps)
