"""What the ``rankwatch`` commands share: the run-directory option, the engines, formatting."""

from __future__ import annotations

import os
from pathlib import Path

import click
from rich.console import Console
from rich.text import Text

from app.config import from_env
from app.health import VERDICT_GLYPH
from app.services import Run, open_run

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

run_dir_option = click.option(
    "--run-dir",
    required=True,
    envvar="RANKWATCH_RUN_DIR",
    type=click.Path(file_okay=False, path_type=Path),
    help="The job's run directory (the trainers' run_dir); env RANKWATCH_RUN_DIR.",
)


def open_cli_run(run_dir: Path) -> Run:
    """The dashboard's engines on ``run_dir``, with the dashboard's settings from the environment."""
    try:
        config = from_env()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    config["RUN_DIR"] = str(run_dir)
    return open_run(str(run_dir), config)


def console() -> Console:
    # Wide enough for the reason column when the output goes to a file or a pipe.
    return Console(highlight=False, width=None if os.isatty(1) else 160)


def verdict_text(health: str) -> Text:
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
