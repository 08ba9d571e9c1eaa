"""``rankwatch launch --run-dir RUN [--max-restarts N] [--backoff-s S] -- msrun ...``: supervise a job.

A thin front end over ``app.supervise``; the graceful stop it asks for on
Ctrl-C or SIGTERM is ``rankwatch stop``'s own (``StopService.request``:
the same flag write, the same audit row).
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path

import click


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option(
    "--run-dir",
    required=True,
    envvar="RANKWATCH_RUN_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="The job's run directory (made if absent); env RANKWATCH_RUN_DIR.",
)
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Relaunches allowed in this run directory, counted across supervisors (attempts.jsonl).",
)
@click.option(
    "--backoff-s",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="Wait before the first relaunch; doubled for each relaunch in a row without progress (max 300 s).",
)
@click.option(
    "--grace-s",
    type=click.FloatRange(min=0),
    default=10.0,
    show_default=True,
    help="Between SIGTERM and SIGKILL when ending an attempt.",
)
@click.option(
    "--no-progress",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="End the run after this many attempts in a row that did not train past the furthest step (exit 93).",
)
@click.option(
    "--gasp-s",
    type=click.FloatRange(min=0),
    default=5.0,
    show_default=True,
    help="After a rank dies or hangs, wait at most this long for another rank to save its replica "
    "(the dying gasp) before ending the attempt; 0: off.",
)
@click.option(
    "--hang-restart-s",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="The hang rule: a rank stalled (the dashboard's verdict) this long ends the attempt with cause "
    "hang; 0: off. See --hang-mode.",
)
@click.option(
    "--hang-mode",
    type=click.Choice(["dry-run", "restart"]),
    default="dry-run",
    show_default=True,
    help="dry-run: only say what the hang rule would do; restart: end the attempt and relaunch it.",
)
@click.option(
    "--max-rollbacks",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Loss-spike rollbacks allowed in this run directory (rollbacks.jsonl); past it exit 7.",
)
@click.option(
    "--rollback-margin",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="A rollback target is older than the spike's first step minus this many steps.",
)
@click.option(
    "--rollback-cooldown-steps",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="A spike within this many steps past a rollback's skipped data is the same place: the next rung.",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(
    run_dir: Path,
    max_restarts: int,
    backoff_s: float,
    grace_s: float,
    no_progress: int,
    gasp_s: float,
    hang_restart_s: float,
    hang_mode: str,
    max_rollbacks: int,
    rollback_margin: int,
    rollback_cooldown_steps: int,
    command: tuple,
) -> None:
    """Run an msrun job and relaunch it from the newest healthy checkpoint set when it fails.

    Put the msrun command after `--`. The supervisor owns every process of the
    job (msrun, its scheduler, the workers): when a worker exits non-zero or
    is killed, it ends the rest (SIGTERM, then SIGKILL after --grace-s) and
    starts the same command again, resumed from the newest complete and
    healthy set. Ctrl-C or SIGTERM asks for a graceful stop and waits for it;
    a second Ctrl-C ends the job at once. A stop is never relaunched.

    Exit status: 0 finished or stopped; 1 failed and not relaunched (a stop
    was asked, or MindIO TTP/MindCluster own recovery); 2 usage; 3 refused
    (another supervisor, or a live job, in the run directory); 4 restart
    budget used up; 5 the same failure twice before the first step; 6 a
    loss-spike rollback found no healthy set; 7 the rollback budget is used
    up; 93 no progress; 130 ended at once by a second Ctrl-C.
    """
    from app.supervise.command import NotMsrun, parse
    from app.supervise.nodes import Nodes
    from app.supervise.rollback import Settings
    from app.supervise.supervisor import Options, Supervisor

    try:
        cmd = parse(list(command))
        Nodes.of(cmd, str(run_dir))  # several nodes: this one's --node_rank must be usable
    except NotMsrun as e:
        raise click.BadParameter(str(e), param_hint="COMMAND") from None
    run_dir.mkdir(parents=True, exist_ok=True)

    def request_stop() -> str:
        from app.cli.common import open_cli_run
        from app.cli.stop import shell_origin
        from app.supervise import slurm

        # Under Slurm a SIGTERM is Slurm's (scontrol requeue, preemption, the end of the time limit).
        try:
            note = slurm.note_signal(str(run_dir), "SIGTERM")
        except OSError:
            note = None  # the stop matters more than its record
        reason = slurm.reason(note) if note else "Ctrl-C or SIGTERM to rankwatch launch"
        run = open_cli_run(run_dir)
        rid, created, _, _ = run.stop.request(reason, getpass.getuser(), shell_origin())
        return f"graceful stop {'requested' if created else 'already pending; joined'}: {rid}"

    opts = Options(
        run_dir=str(run_dir),
        command=cmd,
        max_restarts=max_restarts,
        backoff_s=backoff_s,
        grace_s=grace_s,
        no_progress=no_progress,
        gasp_s=gasp_s,
        hang_restart_s=hang_restart_s,
        hang_mode=hang_mode,
        rollback=Settings(max_rollbacks, rollback_margin, rollback_cooldown_steps),
    )
    if os.environ.get("SLURM_JOB_ID") and os.environ.get("SLURM_RESTART_COUNT", "0") not in ("", "0"):
        served_preemption(run_dir)
    raise SystemExit(Supervisor(opts, request_stop).run())


def served_preemption(run_dir: Path) -> None:
    """Re-arm the stop of an earlier run's preemption that Slurm requeued by itself (``slurm.stale_preemption``)."""
    from app.cli.common import open_cli_run
    from app.cli.stop import shell_origin
    from app.errors import RankwatchError
    from app.stop.status import active_request
    from app.supervise import slurm

    run = open_cli_run(run_dir)
    flag, _ = run.stop.read_flag()
    why = slurm.stale_preemption(str(run_dir), active_request(flag))
    if why is None:
        return
    try:
        run.stop.rearm(getpass.getuser(), shell_origin(), f"served: {why}"[:480], force=True)
    except (RankwatchError, OSError) as e:
        click.echo(
            f"rankwatch launch: the served stop was not re-armed ({e}); the job may stop at once", err=True
        )
        return
    click.echo(f"rankwatch launch: re-armed the flag: {why}", err=True)
