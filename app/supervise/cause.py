"""Why an attempt ended: a crash as a cause record (``crash_cause``), and any cause in one line (``describe``).

The supervisor (``app.supervise.supervisor``) writes the record into the
attempt's supervised line and says the line; ``rankwatch status`` says it
again from ``attempts.jsonl``. A hang's record and words are ``hang.py``'s,
a rollback's ``rollback.py``'s.
"""

from __future__ import annotations

import os

from app.supervise import procs, rollback
from app.supervise.attempt import Outcome
from app.supervise.hang import hang_words
from trainer_bridge.rundir import schema


def procs_exit(p: procs.Proc | None) -> int | None:
    if p is None or p.status is None or os.WIFSIGNALED(p.status):
        return None
    return os.WEXITSTATUS(p.status)


def describe(cause: dict) -> str:
    """A crash or hang cause in one line: who, how, and the error line (a rollback: ``rollback.describe``)."""
    if cause.get("kind") == "rollback":
        return rollback.describe(cause)
    if cause.get("kind") == "hang":
        return hang_words(cause)
    who = {"worker": f"rank {cause.get('rank')}", "scheduler": "the scheduler", "msrun": "msrun"}.get(
        cause.get("role") or "", "a process"
    )
    how = f"killed by {cause['signal']}" if cause.get("signal") else f"exit status {cause.get('exit_code')}"
    pid = f" (pid {cause['pid']} on {cause.get('host')})" if cause.get("pid") else ""
    error = f": {cause['error']}" if cause.get("error") else ""
    return f"{who}{pid} {how}{error}"


def crash_cause(outcome: Outcome, beats: list[dict], host: str, trained: bool) -> dict:
    """The cause record of an attempt whose first process to end failed (``outcome.first``)."""
    p = outcome.first
    failed = next((hb for hb in beats if p is not None and hb.get("pid") == p.pid), None)
    error = (failed or {}).get("error") or outcome.error
    return {
        "kind": "crash",
        "rank": p.rank if p else None,
        "host": host,
        "pid": p.pid if p else None,
        "role": p.role if p and p.role != "other" else None,
        "exit_code": procs_exit(p),
        "signal": procs.signal_name(p.status) if p and p.status is not None else None,
        "error": error[: schema.MAX_ERROR] if error else None,
        "before_first_step": not trained,
    }
