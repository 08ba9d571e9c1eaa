"""``rankwatch stop --run-dir RUN --reason "..."``: the graceful stop, from a shell.

It goes through the dashboard's own ``StopService``: the same flag write
(under the same lock, so a button pressed at the same moment joins this
request), the same audit rows, the same stage tracking. While waiting it
also does the watcher's part (``StopService.tick``): the completion is
audited and the flag re-armed even with no dashboard running; with one
running, whichever comes first records it, once (the tick re-checks under
the flag lock).

Who may: whoever can write the run directory, which is who could write
``graceful_exit.json`` by hand anyway; no token is asked (README, "Stopping
from a shell").
"""

from __future__ import annotations

import getpass
import socket
import time
from pathlib import Path

import click

from app.cli.common import console, fmt_bytes, open_cli_run, plain, run_dir_option, untrusted
from trainer_bridge.rundir import runfiles

# Above this many ranks, stage changes are told as counts, not rank by rank.
RANKS_TOLD_ONE_BY_ONE = 32
POLL_S = 0.2


def shell_origin() -> str:
    """The audit row's origin for a stop from a shell (the button's is the HTTP peer's address)."""
    return f"shell {getpass.getuser()}@{socket.gethostname()}"


def reached(row: dict) -> list[str]:
    """The stages a rank has reached, in order (one poll may skip several: heartbeats are ~1 Hz)."""
    from app.stop.status import STAGES

    last = STAGES.index(row["stage"])
    return [s for s in STAGES[: last + 1] if s == "requested" or s in row["at"] or s == row["stage"]]


def stage_line(row: dict, stage: str, requested_at: float) -> str:
    at = row["at"].get(stage)
    when = f"+{at - requested_at:.1f} s" if isinstance(at, (int, float)) else ""
    detail = ""
    if stage == "seen" and row["seen_step"] is not None:
        detail = f"at step {row['seen_step']}"
    elif stage in ("agreed", "saving") and row["stop_step"] is not None:
        detail = f"stop step {row['stop_step']}"
    elif stage in ("saved", "exited") and row["checkpoint"]:
        ck = row["checkpoint"]
        detail = f"{untrusted(ck.get('path'))} ({fmt_bytes(ck.get('bytes'))})"
    return f"rank {row['rank']:>4}  {stage:<8} {detail:<48} {when}".rstrip()


@click.command()
@run_dir_option
@click.option("--reason", required=True, help="Why (kept in the audit trail, shown on the page).")
@click.option(
    "--who",
    default=getpass.getuser,
    show_default="your user name",
    help="The name the audit trail records.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Give up waiting after this many seconds (default: STOP_DEADLINE_S). The stop goes on.",
)
@click.option("--no-wait", is_flag=True, help="Write the request and return.")
def stop(run_dir: Path, reason: str, who: str, timeout: float | None, no_wait: bool) -> None:
    """Stop the job gracefully: every rank saves at the same step, then exits.

    Waits and prints each rank's stage (requested, seen, agreed, saving, saved,
    exited). Exit status 0 once every rank exited, 1 if the stop was refused
    (the job has ended), cancelled or not obeyed (the job ended without stopping), 2 if waiting timed out (the stop goes on). Ctrl-C stops
    waiting, not the stop.
    """
    reason, who = reason.strip(), who.strip() or getpass.getuser()
    if not reason:
        raise click.BadParameter("must not be empty", param_hint="--reason")
    from app.errors import RankwatchError

    run = open_cli_run(run_dir)
    out = console()
    now = time.time()
    run.state.scan(now)
    snapshot = run.state.snapshot(now)
    if snapshot["run"]["status"] == "ended":
        if snapshot["run"].get("proven"):
            # The page's Stop button is disabled for the same reason.
            raise click.ClickException(f"nothing to stop: {plain(snapshot['run']['message'])}")
        # Only the run directory's files say so, and any rank can write them (issue 32, P1).
        out.print(f"warning: {plain(snapshot['run']['message'])}")
    try:
        rid, created, unaudited, unlocked = run.stop.request(reason, who, shell_origin())
    except RankwatchError as e:
        raise click.ClickException(plain(e.message)) from None
    audited = f"not audited: {unaudited}" if unaudited else f"audited in {run.audit.path}"
    if unlocked:
        audited += f"; {unlocked}: the flag was written atomically without it"
    out.print(
        untrusted(
            f"Stop {'requested' if created else 'already pending; joined'}: {rid} (by {who}: {reason!r}), {audited}"
        )
    )
    logs = run.state.log_stop_facts()
    if logs:
        from rich.text import Text

        # The note quotes a worker log's line: untrusted, printed as plain text.
        out.print(Text(plain(logs["note"]), style="yellow"))
    if no_wait:
        return
    deadline = time.monotonic() + (run.stop.deadline_s if timeout is None else timeout)
    try:
        code = follow(run, rid, deadline, out)
    except KeyboardInterrupt:
        out.print("Stopped waiting; the stop goes on (rankwatch status, or the page, follows it).")
        code = 130
    raise SystemExit(code)


def follow(run, rid: str, deadline: float, out) -> int:
    """Print stage changes until every rank exited; returns the exit status."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from app.stop.status import STAGES

    told: dict[int, int] = {}  # rank -> how many of its stages were printed
    counts_told: tuple | None = None
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=out,
        transient=True,
    ) as progress:
        task = progress.add_task("exited", total=None)
        while True:
            now = time.time()
            run.state.scan(now)
            status = run.stop.tick(now)  # the watcher's part: audit the completion, re-arm
            world = run.state.world_size()
            request = status["request"] or {}
            if request.get("request_id") != rid:
                out.print(untrusted(f"The flag no longer holds request {rid}: {status['state']}."))
                return 1
            if status["state"] == "cancelled":
                out.print(f"Request {rid} was cancelled.")
                return 1
            if status["state"] == "not_obeyed":
                progress.stop()
                armed = runfiles.flag_from_obj(status["flag"] or {}).exit
                out.print(
                    untrusted(
                        f"The stop was {status['summary']}."
                        + (" The flag still says stop." if armed else " The flag is re-armed.")
                    )
                )
                return 1
            if not status["bridge_seen"] and not status["logs"]:
                out.print(
                    "No rank reports through the bridge and no worker log shows the job, so the stop "
                    "cannot be followed from here: a script with OnRequestExit(config_file="
                    "RUN/graceful_exit.json) and MS_ENABLE_GRACEFUL_EXIT=1 stops at its next step, "
                    "any other trains on."
                )
                return 0
            rows = status["ranks"]
            requested_at = request.get("requested_at") or now
            if len(rows) <= RANKS_TOLD_ONE_BY_ONE:
                for row in rows:
                    for stage in reached(row)[told.get(row["rank"], 0) :]:
                        progress.console.print(stage_line(row, stage, requested_at))
                    told[row["rank"]] = len(reached(row))
            else:
                counts = tuple(sum(r["stage"] == s for r in rows) for s in STAGES)
                if counts != counts_told:
                    counts_told = counts
                    progress.console.print(
                        "  ".join(f"{s} {n}" for s, n in zip(STAGES, counts, strict=True) if n)
                    )
            exited = sum(r["stage"] == "exited" for r in rows)
            progress.update(task, total=max(world, len(rows)) or None, completed=exited)
            if status["summary"]:
                progress.stop()
                out.print(untrusted(status["summary"]))
                return 0
            if time.monotonic() > deadline:
                progress.stop()
                held = ", ".join(map(str, status["holding_up"][:10])) or "?"
                out.print(f"Timed out waiting; the stop goes on. Holding it up: rank(s) {held}.")
                return 2
            time.sleep(POLL_S)
