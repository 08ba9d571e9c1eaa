"""``rankwatch launch`` under Slurm: the signal that preempts a job, and what the attempt says of it.

Slurm ends a job (preemption, ``scontrol requeue``, the time limit) with
SIGTERM, then SIGKILL ``KillWait`` seconds later; ``--signal=B:TERM@N`` sends
the batch shell SIGTERM N seconds before the time limit. Either way the
graceful stop is the answer: the flag, one agreed step, a checkpoint on every
rank, exit. What this module adds is the record: the signal note
(``trainer_bridge.rundir.slurm``) says Slurm asked, so the attempt the stop
ends is ``preempted`` (with the signal and the time left), not ``stop``, and
the batch script (``slurmscript.py``) requeues the job only then.
"""

from __future__ import annotations

import os
import re
import subprocess
import time

from trainer_bridge.rundir import attempts, launchguard
from trainer_bridge.rundir import slurm as rundir_slurm

SQUEUE_TIMEOUT_S = 5.0
# squeue's %L: [days-]hours:minutes:seconds, minutes:seconds, or UNLIMITED / NOT_SET / INVALID.
_TIME = re.compile(r"^(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)$")


def parse_duration(text: str) -> float | None:
    """Slurm's time left (``squeue -o %L``) in seconds; None for UNLIMITED and anything unparsable."""
    m = _TIME.match(text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g) if g else 0 for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def time_left_s(job_id: str) -> float | None:
    """What Slurm says the job has left, or None (no limit, no squeue, no answer within a few seconds)."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%L"],
            capture_output=True,
            text=True,
            timeout=SQUEUE_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_duration(out.stdout.splitlines()[0]) if out.returncode == 0 and out.stdout.strip() else None


def note_signal(run_dir: str, signal: str, env=None, at: float | None = None) -> dict | None:
    """Write the signal note for this Slurm job (``at``: when the signal came, default now); None outside Slurm."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    name = signal.upper()
    name = name if name.startswith("SIG") else f"SIG{name}"
    now = time.time()
    # A time from the caller's clock, not later than now (a future note would outlive its attempt).
    at = now if at is None or at > now else at
    return rundir_slurm.write_note(run_dir, name, at, time_left_s(job_id), job_id)


def preempted(cause: dict, run_dir: str, spawned_at: float) -> dict:
    """``cause`` as ``preempted`` when the graceful stop that ended the attempt followed Slurm's signal."""
    if cause.get("kind") != "stop":
        return cause
    note = rundir_slurm.read_note(run_dir, since=spawned_at)
    if note is None:
        return cause
    return {
        **cause,
        "kind": "preempted",
        "signal": note["signal"],
        "signalled_at": note["at"],
        "time_left_s": note["time_left_s"],
    }


def reason(note: dict) -> str:
    """The stop request's reason for a Slurm signal (the audit trail and the page show it)."""
    left = note.get("time_left_s")
    told = f"; {left:g} s left" if left is not None else ""
    return (
        f"Slurm sent {note['signal']} to job {note.get('job_id')} (preemption, requeue or time limit){told}"
    )


def status_text(rows: list[dict]) -> str | None:
    """``rankwatch status``'s Slurm line: the job of the newest attempt that ran under Slurm, and its preemptions."""
    scheds = [(r, (r.get("supervisor") or {}).get("scheduler")) for r in rows]
    scheds = [(r, s) for r, s in scheds if isinstance(s, dict) and s.get("kind") == "slurm"]
    if not scheds:
        return None
    _, s = scheds[-1]
    task = f"_{s['array_task_id']}" if s.get("array_task_id") else ""
    text = f"Slurm job {s.get('job_id')}{task}, restart {s.get('restart_count', 0)}"
    if s.get("partition"):
        text += f", partition {s['partition']}"
    if s.get("nodelist"):
        text += f", on {s['nodelist']}"
    preempted = [r for r in rows if (r.get("cause") or {}).get("kind") == "preempted"]
    if preempted:
        c = preempted[-1]["cause"]
        left = f", {c['time_left_s']:g} s left" if c.get("time_left_s") is not None else ""
        text += f"; attempt {preempted[-1]['attempt']} preempted by {c.get('signal')}{left}"
        if len(preempted) > 1:
            text += f" ({len(preempted)} preemptions)"
    return text


_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.M)


def kill_wait_s() -> int | None:
    """Slurm's ``KillWait`` (``scontrol show config``): seconds between its SIGTERM and its SIGKILL."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT_S
        )
    except (OSError, subprocess.SubprocessError):
        return None
    m = _KILL_WAIT.search(out.stdout) if out.returncode == 0 else None
    return int(m.group(1)) if m else None


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


def measured_stop_s(run_dir: str) -> float | None:
    """The last stop's time on this run, measured.

    After a preemption: from Slurm's signal to the last process of the attempt gone, as ``rankwatch
    launch`` recorded them (``cause.signalled_at``, ``ended_at``): what KillWait must cover. Else from
    the first rank seeing the flag to the last rank's exit stamp (the heartbeats' ``stop.at``), which
    leaves out the processes' own teardown after it.
    """
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
    seen, exited = [], []
    for _, hb in launchguard.read_heartbeats(run_dir):
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
