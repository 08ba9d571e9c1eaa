"""``rankwatch agent --run-dir RUN --redis URL [--run NAME]``: one per node, beside msrun (app/agent/).

It reads this host's ranks from its run directory, judges them with the
dashboard's rules and publishes one host digest a second to Redis, where a
dashboard started with ``AGENTS`` (or ``--run NAME``) reads every node's.
Thresholds come from the same ``RANKWATCH_*`` variables as the dashboard's;
the digests are signed with ``RANKWATCH_REDIS_KEY`` when it is set.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import click

from app.cli.common import run_dir_params


@click.command("agent", context_settings={"help_option_names": ["-h", "--help"]})
@run_dir_params(
    envvar=None,
    type=click.Path(file_okay=False, path_type=Path),
    callback=None,
    help="This host's run directory, also as RUN (may be a local path, different on every node).",
)
@click.option(
    "--redis", "url", envvar="RANKWATCH_REDIS_URL", required=True, help="Redis URL (RANKWATCH_REDIS_URL)."
)
@click.option(
    "--run",
    default="",
    help="The run's name, the same on every node [default: the run directory's base name].",
)
@click.option(
    "--interval-s",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.05, 60),
    help="Seconds between digests.",
)
@click.option(
    "--resync-s",
    default=10.0,
    show_default=True,
    type=click.FloatRange(0.1, 3600),
    help="Every rank's full row is sent at least this often, spread over the digests.",
)
@click.option(
    "--host",
    default="",
    help="The host name this node's ranks report (their heartbeats' `host`) [default: this machine's]; "
    "set it where the agent's own name differs, e.g. a Kubernetes pod without hostNetwork.",
)
@click.option(
    "--buffer",
    default=300,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Digests kept while Redis is unreachable (the oldest are dropped first).",
)
def agent(
    run_dir: Path, url: str, run: str, interval_s: float, resync_s: float, host: str, buffer: int
) -> None:
    """Publish this host's ranks to Redis as one digest a second (run one per node)."""
    from app.agent.digest import check_run
    from app.agent.runner import Agent, run_forever
    from app.config import from_env

    config = from_env()
    name = run or run_dir.resolve().name
    try:
        check_run(name)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--run") from None
    from trainer_bridge.rundir import redisbus

    try:
        redisbus.connect(url).close()  # only parses the URL: Redis may well be down now
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--redis") from None
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    key = config["REDIS_KEY"].encode() if config["REDIS_KEY"] else None
    try:
        worker = Agent(
            run_dir,
            url,
            name,
            config,
            key=key,
            host=host or None,
            interval_s=interval_s,
            resync_s=resync_s,
            buffer=buffer,
        )
    except ValueError as e:  # a handed key of another host (issue 32, P7)
        raise click.UsageError(str(e)) from None
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    click.echo(
        f"rankwatch agent: host {worker.host}, run {name!r}, run directory {run_dir}, "
        f"one digest every {interval_s:g} s{' (signed)' if key else ''}",
        err=True,
    )
    run_forever(worker, stopping)
