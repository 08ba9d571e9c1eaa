"""The supervised lines of ``attempts.jsonl`` (``rankwatch launch``), folded into the attempts' rows.

``attempts.fold`` hands each supervised line here: it joins its attempt's
row (by number, and by launch id when the bridge wrote a start line), or
makes the row itself for an attempt whose processes died before the bridge
started. ``downtime`` splits a restart's downtime into its parts.
"""

from __future__ import annotations

from collections.abc import Callable

# rankwatch launch's exit statuses when it gives up on a failing run (docs/cli.md, "launch"), and what
# each means: the run then needs a person (the landing page's attention, an alert).
BUDGET = 4
STARTUP = 5
NO_PROGRESS = 93  # as nvidia-resiliency-ext: do not requeue
ROLLBACK_REFUSED = 6  # a loss-spike rollback found no healthy set to go back to
ROLLBACK_EXHAUSTED = 7  # MAX_ROLLBACKS loss-spike rollbacks spent in this run
GAVE_UP = {
    BUDGET: "the restart budget is used up",
    STARTUP: "the same failure twice in a row before the first step",
    NO_PROGRESS: "no progress",
    ROLLBACK_REFUSED: "a loss-spike rollback found no healthy set to go back to",
    ROLLBACK_EXHAUSTED: "the loss-spike rollback budget is used up",
}

# What a supervised line tells about an attempt with no start line of its own, as an end line would.
END_OF_CAUSE = {"crash": "failed", "stop": "graceful_stop", "finished": "finished"}


def merge(rows: dict[int, dict], rec: dict, blank: Callable[[dict], dict]) -> None:
    """Merge a supervised line into its attempt's row (made from it when the bridge wrote none)."""
    n = rec["attempt"]
    row = rows.get(n)
    if row is None:
        cause = rec["cause"]
        row = rows[n] = blank(
            {
                "attempt": n,
                "launch": None,
                "started_at": rec["spawned_at"],
                "world_size": rec["world_size"],
                "hosts": [rec["host"]],
                "host_count": None,
                "pid": None,
                "resumed_from": None,
                "first_step": rec["first_step"] if rec["first_step"] is not None else 1,
                "previous_last_step": None,
                "replayed": None,
            }
        )
        row["end"] = END_OF_CAUSE.get(cause["kind"], "unknown")
        row["error"] = cause.get("error") if cause["kind"] == "crash" else None
        row["ended_at"] = rec["ended_at"]
    elif rec["launch"] is not None and row["launch"] != rec["launch"]:
        return
    told = row["supervisor"] or {}
    row["supervisor"] = {
        **told,
        **{k: v for k, v in rec.items() if k not in ("kind", "attempt", "launch") and v is not None},
    }
    row["cause"] = rec["cause"]
    row["restarted_by"] = rec["restarted_by"] or row["restarted_by"]


def downtime(row: dict) -> dict | None:
    """The parts of a supervised restart's downtime, in seconds (None where a time is missing)."""
    sup = row.get("supervisor")
    if not sup or sup.get("cause", {}).get("kind") != "crash":
        return None

    def gap(a: str, b: str) -> float | None:
        x, y = sup.get(a), sup.get(b)
        return round(y - x, 3) if x is not None and y is not None else None

    return {
        "fault_to_detected_s": gap("fault_at", "detected_at"),
        "detected_to_ended_s": gap("detected_at", "ended_at"),
        "ended_to_relaunched_s": gap("ended_at", "relaunched_at"),
        "total_s": gap("fault_at", "relaunched_at"),
    }


def gave_up(row: dict) -> str | None:
    """Why ``rankwatch launch`` ended the run after this attempt (budget, startup, no progress), or None."""
    sup = row.get("supervisor") or {}
    code = sup.get("exit_code")
    if sup.get("action") != "end" or code not in GAVE_UP:
        return None
    note = sup.get("note")
    return f"rankwatch launch ended the run (exit {code}): {note or GAVE_UP[code]}"
