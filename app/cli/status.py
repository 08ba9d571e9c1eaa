"""``rankwatch status --run-dir RUN [--watch]``: the rank table in a terminal.

The rows are the page's: when a dashboard of this user serves the run
(its server file, ``app/edge/login.py``), they are that dashboard's ``/api/ranks``
at this moment; otherwise ``RunState``'s, judged here from the files as the
dashboard judges them (the same thresholds, from the same ``RANKWATCH_*``
variables). The reason cell is composed as the page composes it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from app.cli.common import (
    SEVERITY,
    console,
    fmt_bytes,
    fmt_number,
    fmt_seconds,
    open_cli_run,
    plain,
    run_dir_params,
    untrusted,
    verdict_text,
)
from app.cli.runs import existing_root, print_table, runs_table
from app.run.verdicts import VERDICTS

if TYPE_CHECKING:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    from app.run.state import RunState

# Lines the header, the summary and the table's frame take in --watch.
CHROME_LINES = 10


# The page's note on a rank read from its worker log (static/js/table.js, LOG_ONLY.note).
LOG_ONLY_NOTE = (
    "read from its worker log only: CPU, memory, device and stop stages are not in it; "
    "add the Rankwatch bridge to the script to see them"
)


def reason_text(row: dict) -> str:
    """The reason cell as the page writes it: the verdict's reason, the newest warning, the log note."""
    reason = str(row["reason"])
    warnings = row.get("warnings") or []
    if warnings:
        more = f" (+{len(warnings) - 1} more)" if len(warnings) > 1 else ""
        reason = f"{reason} ⚠ {warnings[-1]}{more}"
    return f"{reason} · {LOG_ONLY_NOTE}" if row.get("source") == "log" else reason


def step_cells(row: dict) -> tuple[str, str]:
    """(global step, epoch/step): each shown when known, whether or not the other is."""
    gstep = "–" if row["global_step"] is None else f"{row['global_step']:,}"
    if row["epoch"] is None and row["step"] is None:
        return gstep, "–"
    epoch = "–" if row["epoch"] is None else row["epoch"]
    step = "–" if row["step"] is None else row["step"]
    return gstep, f"{epoch}/{step}"


def rank_table(rows: list[dict], hidden: int = 0) -> Table:
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False, expand=False)
    table.add_column("rank", justify="right")
    table.add_column("host")
    table.add_column("verdict", no_wrap=True)
    table.add_column("global step", justify="right")
    table.add_column("epoch/step", justify="right")
    table.add_column("loss", justify="right")
    table.add_column("step ms", justify="right")
    table.add_column("heartbeat", justify="right")
    table.add_column("CPU %", justify="right")
    table.add_column("RSS", justify="right")
    table.add_column("reason", overflow="fold", ratio=1)
    for row in rows:
        table.add_row(
            str(row["rank"]),
            untrusted(row["host"] or "–"),
            verdict_text(row["health"]),
            *step_cells(row),
            "–" if row["loss"] is None else f"{row['loss']:.4g}",
            fmt_number(row["step_time_ms"]),
            fmt_seconds(row["heartbeat_age_s"]),
            fmt_number(row["cpu_percent"], 0),
            fmt_bytes(row["rss_bytes"]),
            untrusted(reason_text(row)),
        )
    if hidden:
        table.caption = f"… and {hidden} more rank(s) (larger terminal, or --health, to see them)"
    return table


def summary_text(snapshot: dict) -> Text:
    from rich.text import Text

    s = snapshot["summary"]
    text = Text()
    # A Text's append reads no markup; only the controls need replacing.
    text.append(f"{plain(snapshot['run']['message'])}\n")
    text.append(f"world size {snapshot['world_size']}  ")
    for verdict in VERDICTS:
        n = s["counts"].get(verdict, 0)
        if n:
            text.append_text(verdict_text(verdict))
            text.append(f" {n}  ")
    slowest = s.get("slowest")
    if slowest:
        from app.run import peers  # numpy: not for --help (tests/cli/test_cli_usage.py)

        # The page's words (app/run/peers.py), from the dashboard's answer when it has them.
        said = slowest.get("text")
        text.append(
            f"\nslowest rank: {plain(said) if isinstance(said, str) else peers.slowest_text(slowest)}"
        )
    if s.get("throughput"):
        text.append(f"   throughput {s['throughput']:.0f} samples/s")
    return text


def ordered(rows: list[dict]) -> list[dict]:
    """Trouble first (the page's verdict sort), then by rank."""
    order = {v: i for i, v in enumerate(SEVERITY)}
    return sorted(rows, key=lambda r: (order.get(r["health"], len(order)), r["rank"]))


# The largest /api/ranks answer read from a dashboard; a larger job is judged here.
MAX_ANSWER_BYTES = 128 * 2**20


def dashboard_snapshot(run_dir: Path, health: list[str]) -> tuple[dict, str] | None:
    """``GET /api/ranks`` from this user's dashboard on ``run_dir``, and its URL; None if none answers.

    The page's rows at this moment, judged by the dashboard's own engines
    with their history: a process started now has seen one heartbeat per
    rank, so a verdict that needs several (a straggler's window of step
    times) would read differently here than on the page.
    """
    import json
    import urllib.parse
    import urllib.request

    from app.edge.login import running_dashboards

    here = os.path.realpath(run_dir)
    for info in running_dashboards():
        if not isinstance(info.get("url"), str) or os.path.realpath(str(info.get("run_dir", ""))) != here:
            continue
        query = "?" + urllib.parse.urlencode({"health": ",".join(health)}) if health else ""
        request = urllib.request.Request(
            info["url"].rstrip("/") + "/api/ranks" + query,
            headers={"Authorization": f"Bearer {info.get('token', '')}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                body = response.read(MAX_ANSWER_BYTES + 1)
            snapshot = json.loads(body) if len(body) <= MAX_ANSWER_BYTES else None
        except (OSError, ValueError):
            continue
        if isinstance(snapshot, dict) and {"ranks", "summary", "run", "world_size"} <= snapshot.keys():
            if health or len(snapshot["ranks"]) >= (snapshot["world_size"] or 0):  # every row, not a page
                return snapshot, info["url"]
    return None


class Source:
    """The rows: the running dashboard's when one serves this run, else judged here from the files."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.state: RunState | None = None

    def files(self) -> RunState:
        if self.state is None:
            self.state = open_cli_run(self.run_dir).state
        return self.state

    def snapshot(self, health: list[str]) -> tuple[dict, str]:
        found = dashboard_snapshot(self.run_dir, health)
        if found is not None:
            return found[0], f"as the dashboard at {found[1]} shows it"
        now = time.time()
        self.files().scan(now)
        snapshot = self.files().snapshot(now, health or None)
        return snapshot, "judged from the run directory (no dashboard of yours serves it)"


def restarts_text(source: Source) -> str | None:
    """The attempts line: the goodput, the restarts, the relaunches by ``rankwatch launch``, the last one's cause.

    The goodput is judged from the run directory's files (the page's ``/api/attempts`` does the same
    from the dashboard's whole-run series, ``app.run.goodput``).
    """
    from app import attempts
    from app.supervise.cause import describe

    state = source.files()
    now = time.time()
    state.scan(now)
    beats, _ = state.heartbeats()
    answer = attempts.answer(state.run_dir, beats, state.job_ended(), state.log_attempts())
    rows = answer["attempts"]
    if not rows:
        return None
    restarts = [r for r in rows if r.get("restarted_by") == "launch"]
    text = f"{state.goodput(rows, now)['text']}; {len(rows)} attempt(s)"
    if restarts:
        text += f", {len(restarts)} restarted by rankwatch launch"
        last = restarts[-1]
        down = (last.get("downtime") or {}).get("total_s")
        text += f"; last after attempt {last['attempt']}: {describe(last['cause'])}"
        if down is not None:
            text += f" (fault to relaunch {down:.1f} s)"
    ended = rows[-1].get("supervisor") or {}
    if ended.get("action") == "end" and ended.get("exit_code"):
        text += f"; the supervisor ended the run (exit {ended['exit_code']}): {ended.get('note') or ''}"
    from app.supervise.slurm import status_text

    scheduler = status_text(rows)
    return f"{text}\n{scheduler}" if scheduler else text


def spikes_text(run_dir: Path) -> str | None:
    """The loss-spike line: the pending rollback, and the lines of ``rankwatch/rollbacks.jsonl``."""
    from trainer_bridge.rundir import rollbacks

    lines, skipped = rollbacks.read_lines(run_dir)
    pending, refused = rollbacks.read_request(run_dir)
    if not lines and pending is None and refused is None:
        return None
    kinds: dict[str, int] = {}
    for ln in lines:
        kinds[ln.kind] = kinds.get(ln.kind, 0) + 1
    parts = [", ".join(f"{n} {kind}" for kind, n in kinds.items()) or "no line yet"]
    if lines:
        last = lines[-1]
        to = f"the set at step {last.target_step}" if last.target_step is not None else "no healthy set"
        parts.append(
            f"last: {last.kind} {last.rule} from step {last.first_step} (rank {last.evidence.rank}, "
            f"step {last.evidence.step}), to {to}, skip {last.skip_batches}"
        )
        if last.kind in ("refused", "exhausted"):
            parts.append("needs attention")
    if pending is not None:
        parts.append(f"a rollback for step {pending.first_step} ({pending.rule}) is pending")
    if refused:
        parts.append(refused)
    if skipped:
        parts.append(f"{skipped} invalid line(s) skipped")
    return "loss spikes (rollbacks.jsonl): " + "; ".join(parts)


def view(source: Source, health: list[str], limit: int | None) -> Group:
    from rich.console import Group
    from rich.text import Text

    snapshot, origin = source.snapshot(health)
    rows = snapshot["ranks"]
    if limit is not None:
        rows = ordered(rows)
        shown, hidden = rows[: max(1, limit)], max(0, len(rows) - max(1, limit))
        shown.sort(key=lambda r: r["rank"])
    else:
        shown, hidden = rows, 0
    parts = [summary_text(snapshot)]
    restarts = restarts_text(source)
    if restarts:
        # Attempt causes quote worker logs: untrusted, printed as plain text.
        parts.append(Text(plain(restarts)))
    spikes = spikes_text(source.run_dir)
    if spikes:
        # Evidence text quotes rank-written files: untrusted, printed as plain text.
        parts.append(Text(plain(spikes), style="bold red" if "needs attention" in spikes else ""))
    return Group(*parts, rank_table(shown, hidden), Text(plain(origin), style="dim"))


@click.command()
@run_dir_params(required=False)
@click.option(
    "--runs",
    "runs_root",
    type=click.Path(path_type=Path),
    callback=existing_root,
    help="Instead of one run: the table of every run under this root (as `rankwatch runs ROOT`).",
)
@click.option("--watch", is_flag=True, help="Redraw every --interval seconds until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True)
@click.option(
    "--health",
    "health",
    default="",
    help=f"Only these verdicts, comma-separated ({', '.join(VERDICTS)}).",
)
def status(run_dir: Path | None, runs_root: Path | None, watch: bool, interval: float, health: str) -> None:
    """Every rank's verdict and figures, as the dashboard shows them (--runs ROOT: every run's row)."""
    if runs_root is not None:
        print_table(runs_table(runs_root, per_page=500))
        return
    if run_dir is None:
        raise click.UsageError(
            "give the run directory: RUN or --run-dir RUN (or --runs ROOT for the table of runs)"
        )
    wanted = [h for h in health.split(",") if h]
    unknown = sorted(set(wanted) - set(VERDICTS))
    if unknown:
        raise click.BadParameter(f"unknown verdict {', '.join(unknown)}", param_hint="--health")
    try:
        show(run_dir, wanted, watch, interval)
    except KeyboardInterrupt:
        # Ctrl-C is how --watch ends, and it may come while the engines load.
        raise SystemExit(130 if not watch else 0) from None


def show(run_dir: Path, wanted: list[str], watch: bool, interval: float) -> None:
    source = Source(run_dir)
    out = console()
    if not watch:
        out.print(view(source, wanted, None))
        return
    from rich.live import Live

    with Live(console=out, auto_refresh=False, screen=False) as live:
        while True:
            live.update(view(source, wanted, out.size.height - CHROME_LINES), refresh=True)
            time.sleep(interval)
