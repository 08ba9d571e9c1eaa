"""``rankwatch``: the console script (click), a thin front end over the dashboard's engines.

* ``serve`` and ``demo`` hand their arguments to ``python -m app`` and
  ``python -m trainer_bridge.demo`` (one parser each, shared);
* ``status``, ``stop`` and ``checkpoints`` read and write the run directory
  through ``app.services.open_run``, the same ``RunState``, ``StopService``
  (and audit trail) and ``CheckpointService`` the dashboard uses, so they
  work with or without a dashboard running.

Settings (thresholds, ``AUDIT_DB``, ...) come from the same ``RANKWATCH_*``
environment variables as the dashboard's (``app.config.SETTINGS``).
"""

from __future__ import annotations

import importlib.util
import sys

import click

from app.cli.checkpoints import checkpoints
from app.cli.status import status
from app.cli.stop import stop

PASSTHROUGH = {"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []}


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rankwatch")
def main() -> None:
    """Rankwatch: watch, stop and resume a MindSpore msrun job.

    Every command takes --help. The dashboard is `rankwatch serve --run-dir RUN`;
    from a shell, `status`, `stop` and `checkpoints` work on the same run
    directory, with or without the dashboard running.
    """


@main.command(context_settings=PASSTHROUGH, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve(args: tuple[str, ...]) -> None:
    """Serve the dashboard: --run-dir RUN [--host H] [--port P], and a flag per setting (see --help)."""
    from app.__main__ import main as serve_main

    serve_main(list(args), prog="rankwatch serve")


@main.command(context_settings=PASSTHROUGH, add_help_option=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> None:
    """Train a real 2-rank msrun CPU job with the dashboard (--no-dashboard without it; see --help)."""
    if importlib.util.find_spec("mindspore") is None:
        raise click.ClickException(
            "the demo trains with MindSpore, which is not installed here: pip install 'rankwatch[trainer]'"
        )
    from trainer_bridge.demo.__main__ import main as demo_main

    args = list(args)
    if "--no-dashboard" in args:
        args.remove("--no-dashboard")
    elif "--dashboard" not in args:
        args.append("--dashboard")
    sys.exit(demo_main(args, prog="rankwatch demo"))


main.add_command(status)
main.add_command(stop)
main.add_command(checkpoints)
