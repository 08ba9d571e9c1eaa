"""``rankwatch runs ROOT [--json]`` and ``rankwatch status --runs ROOT``: the runs table in a shell.

The rows are ``GET /api/runs``'s, built by the same ``app.runs.rows.Rows``
over the same engines (``app.compose.build``), with the dashboard's settings from the
``RANKWATCH_*`` variables: the same states, in the same order.
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import click

from app.cli.common import console, fmt_bytes, fmt_seconds, plain, untrusted, verdict_text


def runs_table(root: Path, **query) -> dict:
    """The runs table of ``root`` (``GET /api/runs``'s body, without the rows' ``url``)."""
    from app.compose import build
    from app.config import from_env
    from app.runs.registry import Registry
    from app.runs.rows import Rows

    try:
        config = from_env()
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    config.update(RUNS_ROOT=str(root), RUN_DIR="")
    registry = Registry(config, lambda path, run_id: build(path, config, live=False))
    return Rows(registry, functools.partial(build, live=False), config).table(
        **query, budget_s=None
    )  # a script waits for every row


def print_table(body: dict) -> None:
    from rich.table import Table
    from rich.text import Text

    now = time.time()
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (
        ("run", "left"),
        ("state", "left"),
        ("world", "right"),
        ("global step", "right"),
        ("loss", "right"),
        ("verdicts", "left"),
        ("newest set", "right"),
        ("goodput", "right"),
        ("disk", "right"),
        ("last activity", "right"),
    ):
        table.add_column(name, justify=justify)
    for r in body["runs"]:
        verdicts = Text()
        for name, n in r["health_counts"].items():
            verdicts.append_text(verdict_text(name))
            verdicts.append(f" {n}  ")
        newest = r["newest_complete_set"]
        table.add_row(
            # Two ids that look alike (NFC, NFD) are printed escaped, so they read differently.
            untrusted(r["id"] + (f" ⚠ {r['lookalike']['escaped']}" if r.get("lookalike") else "")),
            ("⚠ " if r["needs_attention"] else "") + r["state"],
            str(r["world_size"]),
            "–" if r["global_step"] is None else f"{r['global_step']:,}",
            "–" if r["loss"] is None else f"{r['loss']:.4g}",
            verdicts,
            "–" if newest is None else f"step {newest['global_step']}",
            goodput_cell(r),
            ("≥ " if r["disk_truncated"] else "") + fmt_bytes(r["disk_bytes"]),
            "–" if r["last_activity"] is None else fmt_seconds(max(0.0, now - r["last_activity"])) + " ago",
        )
    out = console()
    out.print(table)
    out.print(
        Text(
            plain(
                f"{body['total']} run(s), {body['needs_attention']} need attention; page {body['page']} of "
                f"{body['pages']}"
            ),
            style="dim",
        )
    )


def goodput_cell(r: dict) -> str:
    """The row's goodput and restarts, as the landing page's column says them."""
    ratio = "–" if r.get("goodput") is None else f"{r['goodput'] * 100:.1f}%"
    n = r.get("restarts") or 0
    return f"{ratio} · {n} restart{'' if n == 1 else 's'}" if n else ratio


def existing_root(ctx, param, value: Path | None) -> Path | None:
    if value is not None and not value.is_dir():
        raise click.BadParameter(f"{value} is not a directory", ctx, param)
    return value


@click.command()
@click.argument("root", type=click.Path(path_type=Path), callback=existing_root)
@click.option("--json", "as_json", is_flag=True, help="The table as GET /api/runs answers it, for scripts.")
@click.option("--state", default=None, help="Only runs in this state (or 'attention').")
@click.option("--q", "q", default=None, help="Only runs whose id contains this text.")
@click.option("--sort", default="attention", show_default=True, help="attention, id, state, global_step, ...")
@click.option("--page", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--per-page", type=click.IntRange(min=1, max=500), default=500, show_default=True)
def runs(root: Path, as_json: bool, state, q, sort, page, per_page) -> None:
    """Every run under ROOT, those that need attention first, as the landing page lists them."""
    from app.errors import BadRequest
    from app.runs.rows import parse_args

    try:
        query = parse_args(
            {
                k: str(v)
                for k, v in {"state": state, "q": q, "sort": sort, "page": page, "per_page": per_page}.items()
                if v
            }
        )
    except BadRequest as e:
        raise click.UsageError(str(e)) from None
    body = runs_table(root, **query)
    if as_json:
        click.echo(json.dumps(body, indent=1, sort_keys=True))
    else:
        print_table(body)
