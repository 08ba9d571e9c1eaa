"""What the ``rankwatch`` commands share: the run-directory check, the engines, safe output, formatting.

Imports stay light here (click and the standard library): every command
module imports this one, and ``rankwatch --help`` must stay instant. rich
and the engines are imported when a command runs.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

import click

from app.run.verdicts import VERDICT_GLYPH

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from app.extensions import Rankwatch

VERDICT_STYLE = {
    "starting": "dim cyan",
    "healthy": "green",
    "straggler": "yellow",
    "stalled": "dark_orange",
    "dead": "bold red",
    "node_lost": "bold red",
    "corrupt": "magenta",
    "exited": "blue",
    "finished": "cyan",
    "failed": "bold red",
    "pending": "dim",
}
# Trouble first, as the page's table sorts by verdict.
SEVERITY = (
    "node_lost",
    "dead",
    "failed",
    "stalled",
    "corrupt",
    "straggler",
    "pending",
    "starting",
    "healthy",
    "exited",
    "finished",
)


def existing_run_dir(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """The one check of ``--run-dir`` for the commands that read a run: it must be a directory."""
    if value is None:
        return value
    if not value.exists():
        raise click.BadParameter(
            f"{value} does not exist (the job's run directory, as the trainers' run_dir names it)",
            ctx,
            param,
        )
    if not value.is_dir():
        raise click.BadParameter(f"{value} is not a directory", ctx, param)
    return value


RUN_DIR_HELP = "The job's run directory (the trainers' run_dir), also as RUN; env RANKWATCH_RUN_DIR."


def one_run_dir(run_dir, run_arg, option: str):
    """The run directory of a command given ``--run-dir`` (parameter ``option``) and/or a positional RUN.

    RUN wins over the environment's RANKWATCH_RUN_DIR; RUN with a different
    ``--run-dir`` on the command line is a usage error.
    """
    if run_arg is None:
        return run_dir
    ctx = click.get_current_context()
    given = ctx.get_parameter_source(option) == click.core.ParameterSource.COMMANDLINE
    if given and run_dir is not None and str(run_dir) != str(run_arg):
        raise click.UsageError(f"two run directories: RUN {run_arg} and --run-dir {run_dir}; give one")
    return run_arg


def run_dir_params(
    *,
    required: bool = True,
    envvar: str | None = "RANKWATCH_RUN_DIR",
    type: click.ParamType | None = None,
    callback=existing_run_dir,
    help: str = RUN_DIR_HELP,
    missing: str = "Missing the run directory: give RUN, or --run-dir RUN.",
):
    """``--run-dir RUN`` and, the same, a positional ``RUN``, for every command that takes one.

    `rankwatch status runs/demo` was refused while `rankwatch runs ROOT` was
    accepted: every command now takes both ways. The command gets one
    ``run_dir``; RUN given with a different ``--run-dir`` is a usage error
    (the environment's RANKWATCH_RUN_DIR yields to either).
    """
    kind = type or click.Path(path_type=Path)

    def decorate(f):
        @functools.wraps(f)
        def command(*args, run_dir=None, run_arg=None, **kw):
            run_dir = one_run_dir(run_dir, run_arg, "run_dir")
            if required and run_dir is None:
                raise click.UsageError(missing)
            return f(*args, run_dir=run_dir, **kw)

        command = click.argument("run_arg", metavar="[RUN]", required=False, type=kind, callback=callback)(
            command
        )
        return click.option("--run-dir", envvar=envvar, type=kind, callback=callback, help=help)(command)

    return decorate


# The usual pair: required, an existing directory.
run_dir_option = run_dir_params()


def open_cli_run(run_dir: Path) -> Rankwatch:
    """The dashboard's engines on ``run_dir``, with the dashboard's settings from the environment."""
    from app.compose import build
    from app.config import from_env

    try:
        config = from_env()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    config["RUN_DIR"] = str(run_dir)
    try:
        return build(str(run_dir), config, live=False)
    except ValueError as e:  # a setting checked when its engine starts (RETENTION_MODE)
        raise click.ClickException(str(e)) from None


def console() -> Console:
    from rich.console import Console

    # Wide enough for the reason column when the output goes to a file or a pipe.
    return Console(highlight=False, width=None if os.isatty(1) else 160)


# C0 and C1 controls, DEL, and the bidi and zero-width format characters a
# terminal or a reader may act on; tab and newline are kept.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def plain(text: object) -> str:
    """Rank-written text without the characters a terminal acts on (``?`` instead), for a rich ``Text``."""
    return _UNSAFE.sub("?", str(text))


def untrusted(text: object) -> str:
    """Rank-written text (a reason, a host name, a path), made safe to print as rich markup.

    Every file in the run directory is untrusted: an escape sequence in a
    heartbeat's ``error`` would reach the operator's terminal (clear it,
    retitle it, hide lines), and rich would read ``[link=...]`` as markup.
    Control characters become ``?`` and markup is escaped, so the text
    prints as written. Every command prints untrusted text through this
    (or ``plain``, where rich reads no markup).
    """
    from rich.markup import escape

    return escape(plain(text))


def verdict_text(health: str) -> Text:
    from rich.text import Text

    return Text(f"{VERDICT_GLYPH.get(health, '?')} {health}", style=VERDICT_STYLE.get(health, ""))


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "–"
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.1f} {units[i]}" if i and n < 10 else f"{n:.0f} {units[i]}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "–"
    if s < 10:
        return f"{s:.1f} s"
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def fmt_number(x: float | int | None, digits: int = 1) -> str:
    if x is None:
        return "–"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"
