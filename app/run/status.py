"""The run's status line: whether the job is there at all, and what to tell the operator if not.

``run_status`` is a pure function of ``StatusFacts``, which ``RunState``
gathers under its lock once per scan (the heartbeat reader's errors, the
log reader's problems, the verdict board's counts, the world size).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.listing import first_of

# How many missing ranks a status message names before it summarises.
NAMED_RANKS = 8


@dataclass(frozen=True)
class StatusFacts:
    """What the status line is made from.

    ``redis``: the Redis heartbeat source (None: files only), with
    ``redis_error`` while it is unreachable. ``read_error``/``job_error``: why
    the state directory or job.json could not be read; ``job``: job.json as
    validated. ``from_log``: how many reported ranks are shown from their
    worker logs in ``log_path``, and ``beats_expected`` whether their bridge
    may still report. ``conflict``: two launches writing at once (a
    sentence). ``missing``: ranks that have not reported. ``ended_states``:
    every rank's final state once all have one (else None). ``job_over``: why
    the job is over though not every rank said so (else None). ``end_proven``:
    a probe here backs every rank's end (``app.run.endproof``);
    ``still_running``: ranks said to have ended whose process a probe finds running.
    ``copied``: why the run directory is a copy of the one its job wrote
    (``trainer_bridge.rundir.copies``), else None.
    """

    run_dir: Path | None
    world: int
    reported: int
    redis: Any
    redis_error: str | None
    read_error: str | None
    job: dict | None
    job_error: str | None
    log_path: Path | None
    log_problems: list[str]
    from_log: int
    beats_expected: bool
    conflict: str | None
    missing: list[int]
    ended_states: list[str] | None
    job_over: str | None
    end_proven: bool = False
    still_running: list[int] = ()
    copied: str | None = None


def run_status(f: StatusFacts) -> dict:
    """Whether the job is there at all, and what to tell the operator if not."""

    def status(kind: str, message: str) -> dict:
        transport = "files" if f.redis is None else "redis" if not f.redis_error else "files"
        if f.redis_error:
            message += (
                f" Redis is unreachable ({f.redis_error}): heartbeats are read from the run "
                "directory's files until it is back."
            )
        refused = getattr(f.redis, "refused", 0)
        if refused:
            message += (
                f" Redis: {refused} heartbeat(s) refused as unsigned or badly signed (REDIS_KEY), "
                f"the last {f.redis.refused_last}: is something else writing to Redis?"
            )
        if f.log_problems:
            message += f" Worker logs: {'; '.join(f.log_problems)}."
        return {"status": kind, "message": message, "run_dir": str(f.run_dir or ""), "transport": transport}

    if f.run_dir is None:
        return status(
            "missing",
            "No run directory was given: start the dashboard with --run-dir RUN (or RANKWATCH_RUN_DIR).",
        )
    if not f.run_dir.is_dir():
        return status(
            "missing",
            f"The run directory {f.run_dir} does not exist (yet). "
            "The dashboard keeps watching and fills in when the job "
            "starts; check the path if this persists.",
        )
    sdir = runfiles.state_dir(f.run_dir)
    reported = f.reported
    if f.read_error:
        shown = (
            f" The table shows what was read last ({reported} rank"
            f"{'' if reported == 1 else 's'}); their heartbeats age until it is readable."
            if reported
            else ""
        )
        return status(
            "unreadable",
            f"Cannot read {sdir}: {f.read_error}. The ranks write "
            "their heartbeats there, so they cannot report either; check "
            "that it is a directory this user can read (and that the disk "
            f"is healthy).{shown}",
        )
    if not reported and not f.job and f.job_error:
        return status(
            "waiting",
            f"{runfiles.job_path(f.run_dir)} is unreadable "
            f"({f.job_error}) and no rank has written a heartbeat "
            "yet: the job has not started, or another tool wrote that "
            "file. The dashboard picks the job up when rank 0 rewrites "
            "it at start.",
        )
    if not reported and not f.job:
        return status(
            "waiting",
            f"The job has not started: {sdir} holds no job.json and no "
            "heartbeats yet. Rank 0 writes job.json when the bridge "
            "starts; each rank then writes rank_N.json about once a "
            "second. A script without the bridge is shown from msrun's worker logs, and "
            f"{f.log_path or 'the log directory'} has none yet.",
        )
    note = (
        ""
        if f.job
        else f" (job.json is unreadable: {f.job_error}; the world size comes from the heartbeats)"
        if f.job_error
        else " (job.json is missing, so the world size comes from the heartbeats)"
    )
    if f.from_log:
        note = (
            f" (from msrun's worker logs in {f.log_path} until the bridge's first heartbeats)"
            if f.beats_expected
            else f" (from msrun's worker logs in {f.log_path}: no rank writes Rankwatch heartbeats "
            "(yet), so CPU, memory, device and stop stages are not shown)"
            if f.from_log == reported
            else f"{note} ({f.from_log} of them from their worker logs only: no heartbeats from them yet)"
        )
    if f.copied and reported:
        # Archived, not failed: nothing of this directory runs, and the pids it names are another's.
        return {
            **status(
                "ended",
                f"{f.copied[:1].upper()}{f.copied[1:]}. It is shown as it was when copied, and none of those processes is "
                "probed; a launch into this directory makes it a live run again.",
            ),
            "proven": True,
            "copied": True,
        }
    if f.conflict:
        return status("conflict", f.conflict)
    missing = f.missing
    if not reported:
        return status(
            "starting",
            f"The job has started (world size {f.world}) but no rank "
            "has written a heartbeat yet. Ranks report once the bridge "
            "is running, usually after graph compilation.",
        )
    if missing:
        named = first_of(missing, NAMED_RANKS)
        return status(
            "starting",
            f"{reported} of {f.world} ranks have reported; "
            f"waiting for rank{'s' if len(missing) > 1 else ''} "
            f"{named}.{note}",
        )
    if f.ended_states is not None:
        counts: dict[str, int] = {}
        for state in f.ended_states:
            counts[state] = counts.get(state, 0) + 1
        told = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        return _ended(f, status, f"The job has ended: {told}.")
    if f.job_over:
        # Ranks killed or crashed without saying so: their processes and msrun are gone.
        return _ended(f, status, f"The job has ended: {f.job_over}.")
    return status("running", f"{f.world} ranks reporting.{note}")


def _ended(f: StatusFacts, status, message: str) -> dict:
    """``ended``, with ``proven``: whether a probe here backs it (app.run.endproof).

    Stop stays usable while only the files say so: anything that writes the run
    directory can write "finished" (issue 32, P1).
    """
    if f.still_running:
        ranks = f.still_running
        message += (
            f" But the process of rank{'s' if len(ranks) > 1 else ''} {first_of(ranks, 8)}"
            " still runs on this host: Stop stays usable."
        )
    elif not f.end_proven:
        message += " Only the run directory says so (no probe here can confirm it): Stop stays usable."
    return {**status("ended", message), "proven": f.end_proven}
