"""``rankwatch slurm``: the batch script for running under Slurm, and the two steps it calls.

A thin front end over ``app.supervise.slurm`` and ``app.supervise.slurmscript``;
docs/slurm.md is the manual.
"""

from __future__ import annotations

import getpass
import sys
from pathlib import Path

import click

RUN_DIR = click.option(
    "--run-dir",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The job's run directory (the batch script's RUN_DIR).",
)


@click.group()
def slurm() -> None:
    """Run a MindSpore job under Slurm with rankwatch launch (docs/slurm.md)."""


@slurm.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--job-name", default="rankwatch", show_default=True, help="#SBATCH --job-name; names RUN_DIR.")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="#SBATCH --nodes.")
@click.option(
    "--workers-per-node",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="msrun's --local_worker_num (devices per node); --worker_num is this times the nodes.",
)
@click.option(
    "--cpus-per-task",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="#SBATCH --cpus-per-task.",
)
@click.option(
    "--signal-s",
    type=click.IntRange(min=1, max=65535),
    default=120,
    show_default=True,
    help="#SBATCH --signal=B:TERM@N: seconds before the time limit (docs/slurm.md says how to choose it).",
)
@click.option("--master-port", type=click.IntRange(1, 65535), default=8118, show_default=True)
@click.option(
    "--run-dir", default=None, help="A fixed run directory; default $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_NAME."
)
@click.option("--time", "time_limit", default=None, help="#SBATCH --time (Slurm's format, e.g. 04:00:00).")
@click.option("--max-restarts", type=click.IntRange(min=0), default=None, help="rankwatch launch's.")
@click.argument("train", nargs=-1, type=click.UNPROCESSED, required=True)
def template(
    job_name,
    nodes,
    workers_per_node,
    cpus_per_task,
    signal_s,
    master_port,
    run_dir,
    time_limit,
    max_restarts,
    train,
) -> None:
    """Print a batch script that runs TRAIN (the script and its arguments, after --) under rankwatch launch.

    Save it, read it, then `sbatch` it. Options not given keep their defaults.
    """
    from app.supervise.slurmscript import render

    click.echo(
        render(
            list(train),
            job_name=job_name,
            nodes=nodes,
            workers=workers_per_node,
            cpus=cpus_per_task,
            signal_s=signal_s,
            master_port=master_port,
            run_dir=run_dir,
            time_limit=time_limit,
            launch_args=[] if max_restarts is None else ["--max-restarts", str(max_restarts)],
            argv=sys.argv[3:] if sys.argv[1:3] == ["slurm", "template"] else None,
        ),
        nl=False,
    )


@slurm.command()
@RUN_DIR
@click.option("--signal", "signal_name", default="TERM", show_default=True, help="The signal Slurm sent.")
@click.option(
    "--at", "at", type=click.FloatRange(min=0), default=None, help="When it came (Unix time); default now."
)
def signalled(run_dir: Path, signal_name: str, at: float | None) -> None:
    """Slurm signalled the job: note it and ask for the graceful stop (the batch script's trap calls this)."""
    from app.cli.common import open_cli_run
    from app.cli.stop import shell_origin
    from app.supervise import slurm as supervise_slurm

    try:
        note = supervise_slurm.note_signal(str(run_dir), signal_name, at=at)
    except OSError as e:
        note = None
        click.echo(f"rankwatch slurm: the signal note was not written ({e})", err=True)
    reason = supervise_slurm.reason(note) if note else f"SIG{signal_name} from Slurm"
    run = open_cli_run(run_dir)
    rid, created, _, _ = run.stop.request(reason, getpass.getuser(), shell_origin())
    click.echo(
        f"rankwatch slurm: {reason}: graceful stop {'requested' if created else 'already pending'}: {rid}"
    )


@slurm.command()
@RUN_DIR
@click.option("--launch-exit", type=int, required=True, help="rankwatch launch's exit status (srun's).")
def ended(run_dir: Path, launch_exit: int) -> None:
    """Requeue the job if its attempt was preempted; exit with the batch script's status."""
    import os

    from app.supervise.slurmscript import after_launch, requeue

    code, again, told = after_launch(str(run_dir), launch_exit, dict(os.environ))
    click.echo(f"rankwatch slurm: {told}")
    if again and os.environ.get("SLURM_JOB_ID"):
        from app.cli.common import open_cli_run
        from app.cli.stop import shell_origin
        from app.errors import RankwatchError

        # The stop is served: the requeued job must not read it as a new one and stop at once.
        try:
            open_cli_run(run_dir).stop.rearm(
                getpass.getuser(), shell_origin(), "requeued after Slurm's preemption", force=True
            )
        except (RankwatchError, OSError) as e:
            click.echo(f"rankwatch slurm: the flag was not re-armed: {e}", err=True)
        failed = requeue(os.environ["SLURM_JOB_ID"])
        if failed and "pending execution" in failed:
            # scontrol requeue or PreemptMode=REQUEUE: Slurm requeued the job itself.
            click.echo("rankwatch slurm: Slurm has requeued the job already")
        elif failed:
            click.echo(f"rankwatch slurm: scontrol requeue failed: {failed}", err=True)
    raise SystemExit(code)


@slurm.command()
@RUN_DIR
def check(run_dir: Path) -> None:
    """Say whether the run's graceful stop fits in Slurm's KillWait (exit 1 when it does not).

    The stop's time is the one measured at the run's last stop (from Slurm's signal, or from the
    first rank seeing the flag, to the last rank's exit, in the heartbeats); before any stop, the
    stop dialog's estimate (the flag poll and the steps to the next agreement).
    """
    from app.cli.common import open_cli_run
    from app.run import slurmstop
    from app.supervise import slurm as supervise_slurm

    needs = slurmstop.measured_stop_s(str(run_dir))
    if needs is None:
        import time

        run = open_cli_run(run_dir)
        run.state.scan(time.time())
        needs = run.stop.estimate().get("seconds")
    ok, told = slurmstop.fits(needs, supervise_slurm.kill_wait_s())
    click.echo(f"rankwatch slurm: {told}")
    raise SystemExit(1 if ok is False else 0)
