"""``rankwatch checkpoints --run-dir RUN [--set ID]``: the checkpoint sets and how to resume.

The index, the notes and the resume answer are ``CheckpointService``'s, as
on the page's checkpoint browser; nothing needs a dashboard running.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from app.cli.common import (
    RUN_DIR_HELP,
    console,
    existing_run_dir,
    fmt_bytes,
    fmt_seconds,
    open_cli_run,
    plain,
    run_dir_option,
    untrusted,
)

if TYPE_CHECKING:
    from rich.table import Table


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "–"
    text = ",".join(map(str, ranks[:8]))
    return text + (f" +{len(ranks) - 8}" if len(ranks) > 8 else "")


def sets_table(body: dict) -> Table:
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (
        ("set", "left"),
        ("global step", "right"),
        ("epoch/step", "right"),
        ("origin", "left"),
        ("complete", "left"),
        ("ranks missing", "left"),
        ("size", "right"),
        ("age", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=name != "set", overflow="fold")
    for s in body["sets"]:
        mark = " ★" if s["id"] == body["star"] else ""
        table.add_row(
            untrusted(s["id"]) + mark,
            "–" if s["global_step"] is None else str(s["global_step"]),
            f"{s['epoch'] if s['epoch'] is not None else '–'}/{s['step'] if s['step'] is not None else '–'}",
            untrusted(s["origin"]),
            "[green]yes[/]" if s["complete"] else "[red]no[/]",
            _ranks(s["ranks_missing"]),
            fmt_bytes(s["bytes"]),
            fmt_seconds(s["age_s"]),
        )
    return table


def files_table(s: dict) -> Table:
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("rank", "path", "size", "status"):
        table.add_column(name, overflow="fold")
    for f in s["files"]:
        status = (
            untrusted(f["status"])
            if f["status"] == "ok"
            else f"[red]{untrusted(f['status'])}[/]: {untrusted(f['reason'])}"
        )
        table.add_row(str(f["rank"]), untrusted(f["path"]), fmt_bytes(f["bytes"]), status)
    return table


class _Checkpoints(click.Group):
    """``rankwatch checkpoints RUN``: RUN, unless it names a subcommand (``gc``), is ``--run-dir RUN``."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        valued = {o for p in self.params if isinstance(p, click.Option) and not p.is_flag for o in p.opts}
        i = 0
        while i < len(args) and args[i] != "--":
            if args[i].startswith("-"):
                i += 2 if args[i] in valued else 1
                continue
            if args[i] not in self.commands:  # the first word that is no subcommand is RUN
                args = [*args[:i], "--run-dir", args[i], *args[i + 1 :]]
            break
        return super().parse_args(ctx, args)


@click.group(cls=_Checkpoints, invoke_without_command=True, subcommand_metavar="[RUN] | gc [ARGS]...")
@click.option(
    "--run-dir",
    envvar="RANKWATCH_RUN_DIR",
    type=click.Path(path_type=Path),
    callback=existing_run_dir,
    help=RUN_DIR_HELP,
)
@click.option(
    "--set", "set_id", default=None, help="One set (an id from the list): its files and its resume answer."
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the answer as JSON (GET /api/checkpoints's body)."
)
@click.pass_context
def checkpoints(ctx: click.Context, run_dir: Path | None, set_id: str | None, as_json: bool) -> None:
    """The checkpoint sets, newest step first, complete or not, and the command that resumes.

    `rankwatch checkpoints gc` prints the retention plan (and applies it with --apply).
    """
    from app.errors import RankwatchError

    if ctx.invoked_subcommand is not None:
        return
    if run_dir is None:
        raise click.UsageError("Missing the run directory: give RUN, or --run-dir RUN.")
    run = open_cli_run(run_dir)
    run.state.scan(time.time())  # for the world size and the hosts the resume command needs
    heartbeats, world = run.state.heartbeats()
    body = run.checkpoints.body(world)
    # The page's headline: the ★ set when it is of the newest healthy complete step, else that set.
    newest = next((s for s in body["sets"] if s["id"] == body["newest_healthy"]), None)
    star = next((s for s in body["sets"] if s["id"] == body["star"]), None)
    same_step = newest is not None and star is not None and star["global_step"] == newest["global_step"]
    chosen = set_id or (body["star"] if same_step else body["newest_healthy"])
    try:
        answer = run.checkpoints.resume(chosen, world, heartbeats) if chosen else None
    except RankwatchError as e:
        raise click.ClickException(e.message) from None
    out = console()
    if as_json:
        out.print_json(json.dumps({"checkpoints": body, "resume": answer}, default=str))
        return
    for error in body["errors"]:
        out.print(f"[red]{untrusted(error)}[/]")
    if set_id:
        found = next(s for s in body["sets"] if s["id"] == set_id)
        out.print(files_table(found))
        for note in found["notes"]:
            out.print(f"• {untrusted(note)}")
    else:
        complete = sum(s["complete"] for s in body["sets"])
        out.print(
            f"{len(body['sets'])} checkpoint {'set' if len(body['sets']) == 1 else 'sets'} in "
            f"{untrusted(run_dir)}, {complete} complete, "
            f"{fmt_bytes(body['total_bytes'])} (world size {body['world_size'] or 'unknown'}); "
            "★ = what an unchanged relaunch resumes from"
            + ("" if body["star"] == body["bridge_resume"] else " (none: the newest healthy complete set)")
        )
        if body["sets"]:
            out.print(sets_table(body))
    if answer is None:
        out.print("No healthy complete set: no step every rank can resume from.")
        return
    out.print(
        f"\n[bold]Resume from {untrusted(answer['set'])}[/] (global step {untrusted(answer['global_step'])}):"
    )
    out.print(untrusted(answer["how"]), soft_wrap=True)
    for warning in answer["warnings"]:
        out.print(f"[yellow]⚠ {untrusted(warning)}[/]")
    if answer["command"]:
        out.print(plain(answer["command"]), soft_wrap=True, markup=False)
    for note in answer["command_notes"]:
        out.print(f"  ({untrusted(note)})")


@checkpoints.command()
@run_dir_option
@click.option(
    "--keep", type=click.IntRange(1), default=None, help="Keep the newest N complete sets (RETENTION_KEEP)."
)
@click.option("--apply", "apply_", is_flag=True, help="Delete what the plan says (audited, who = cli).")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the plan as JSON (GET /api/checkpoints/retention's body)."
)
def gc(run_dir: Path, keep: int | None, apply_: bool, as_json: bool) -> None:
    """The retention plan: which sets are kept and why, which would be deleted; --apply deletes them."""
    from rich.table import Table

    from app.errors import RankwatchError

    run = open_cli_run(run_dir)
    if keep is not None:
        run.checkpoints.retention.config = dict(run.checkpoints.retention.config, RETENTION_KEEP=keep)
    run.state.scan(time.time())  # who is saving or training holds deletions back
    heartbeats, world = run.state.heartbeats()
    retention = run.checkpoints.retention
    body = retention.body(world, heartbeats)
    out = console()
    if as_json and not apply_:
        out.print_json(json.dumps(body, default=str))
        return
    table = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("set", "global step", "action", "why", "size"):
        table.add_column(name, overflow="fold")
    for e in body["sets"]:
        action = "[red]delete[/]" if e["action"] == "delete" else "keep"
        step = "–" if e["global_step"] is None else str(e["global_step"])
        table.add_row(
            untrusted(e["id"]),
            step,
            action,
            untrusted(e["why"]),
            fmt_bytes(e["bytes"]),
        )
    policy = body["policy"]
    out.print(
        f"Retention plan for {untrusted(run_dir)} (mode {policy['mode']}, keep {policy['keep']}, every "
        f"{policy['every'] or 'off'}; {policy['source']}): frees {fmt_bytes(body['frees_bytes'])}"
    )
    for error in policy["errors"]:
        out.print(f"[yellow]{untrusted(error)}[/]")
    if body["sets"]:
        out.print(table)
    if body["disk"]["warning"]:
        out.print(f"[red]⚠ {untrusted(body['disk']['warning'])}[/]")
    if not apply_:
        return
    try:
        result = retention.apply(body["hash"], world, heartbeats, who="cli")
    except RankwatchError as e:
        raise click.ClickException(e.message) from None
    out.print(
        f"Deleted {len(result['deleted'])} item(s), freed {fmt_bytes(result['frees_bytes'])}"
        + (f"; failed: {untrusted(', '.join(result['failed']))}" if result["failed"] else "")
    )
    if result["failed"]:
        raise SystemExit(1)
