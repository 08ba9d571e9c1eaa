"""Whether a Slurm job's graceful stop fits in ``KillWait``: one engine for the page, its alert and the CLI.

Slurm sends SIGTERM, then SIGKILL ``KillWait`` seconds later. A preemption
saves only if every rank's graceful stop ends inside that window. The stop's
time is the one measured at the run's last stop (from Slurm's signal, or from
the first rank seeing the flag, to the last exit); before any stop, the stop
dialog's estimate. ``KillWait`` is what ``rankwatch launch`` recorded in the
attempt's scheduler record (``kill_wait_s``) or what ``scontrol`` says
(``rankwatch slurm check``). The run page (``/api/attempts``' ``slurm_stop``),
the run's ``slurm_kill_wait`` alert (``app/incidents/killwait.py``) and
``rankwatch slurm check`` all say it in this module's words.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from trainer_bridge.rundir import attempts, launchguard
from trainer_bridge.rundir import slurm as rundir_slurm


def fits(needs_s: float | None, kill_wait: int | None) -> tuple[bool | None, str]:
    """Whether the graceful stop fits in ``KillWait``, and the sentence that says so."""
    if kill_wait is None:
        return None, "Slurm's KillWait is unknown here (scontrol show config did not answer)"
    if needs_s is None:
        return None, f"Slurm gives a stop {kill_wait} s (KillWait); this job's stop time is not known yet"
    if needs_s > kill_wait:
        return False, (
            f"this job needs about {needs_s:.0f} s to stop; Slurm gives it {kill_wait} (KillWait): a preemption "
            "would kill it before every rank saved"
        )
    return True, f"this job needs about {needs_s:.0f} s to stop; Slurm gives it {kill_wait} (KillWait)"


def measured_stop_s(
    run_dir: str, rows: Sequence[Mapping] | None = None, beats: Iterable[Mapping | None] | None = None
) -> float | None:
    """The last stop's time on this run, measured.

    After a preemption: from Slurm's signal to the last process of the attempt gone, as ``rankwatch
    launch`` recorded them (``cause.signalled_at``, ``ended_at``): what KillWait must cover. Else from
    the first rank seeing the flag to the last rank's exit stamp (the heartbeats' ``stop.at``), which
    leaves out the processes' own teardown after it. ``rows`` (the attempts, folded) and ``beats``
    (the newest heartbeats) are read from the run directory unless given: a dashboard has both.
    """
    if rows is None:
        try:
            rows = attempts.fold(attempts.read_lines(run_dir)[0])
        except OSError:
            rows = []
    for row in reversed(rows):
        cause, sup = row.get("cause") or {}, row.get("supervisor") or {}
        if cause.get("kind") == "preempted":
            at, ended = cause.get("signalled_at"), sup.get("ended_at")
            if rundir_slurm.finite(at) and rundir_slurm.finite(ended) and ended >= at:
                return float(ended - at)
            break
    if beats is None:
        beats = (hb for _, hb in launchguard.read_heartbeats(run_dir))
    seen, exited = [], []
    for hb in beats:
        if not isinstance(hb, Mapping):
            continue
        at = (hb.get("stop") or {}).get("at") if isinstance(hb.get("stop"), dict) else None
        if not isinstance(at, dict):
            continue
        if rundir_slurm.finite(at.get("seen")):
            seen.append(float(at["seen"]))
        if rundir_slurm.finite(at.get("exited")):
            exited.append(float(at["exited"]))
    if not exited:
        return None
    note = rundir_slurm.read_note(run_dir)
    if note is not None and note["at"] <= max(exited):
        return max(exited) - note["at"]
    return max(exited) - min(seen) if seen else None


def kill_wait_of(rows: Sequence[dict]) -> tuple[int, dict] | None:
    """The newest attempt's recorded ``KillWait`` and its scheduler record, or None (not under Slurm, not known)."""
    for row in reversed(rows):
        sched = (row.get("supervisor") or {}).get("scheduler") or {}
        kw = sched.get("kill_wait_s")
        if isinstance(kw, int) and not isinstance(kw, bool):
            return kw, sched
        if sched:
            return None  # the newest Slurm attempt did not record it: an older record may be stale
    return None


def verdict(
    run_dir: str,
    rows: Sequence[dict],
    beats: Iterable[Mapping | None] | None = None,
    estimate: Callable[[], float | None] | None = None,
) -> dict | None:
    """``{"fits", "needs_s", "kill_wait_s", "job_id", "text"}`` for a run under Slurm with ``KillWait`` known.

    None otherwise. ``estimate``: the stop dialog's estimate, asked only when no stop was measured.
    """
    known = kill_wait_of(rows)
    if known is None:
        return None
    kill_wait, sched = known
    needs = measured_stop_s(run_dir, rows, beats)
    if needs is None and estimate is not None:
        needs = estimate()
    ok, text = fits(needs, kill_wait)
    return {
        "fits": ok,
        "needs_s": None if needs is None else round(float(needs), 1),
        "kill_wait_s": kill_wait,
        "job_id": sched.get("job_id"),
        "text": text,
    }
