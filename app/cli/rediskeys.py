"""``rankwatch redis-keys``: hand each rank and agent its own Redis key (issue 32, P7).

Run where the master key is (the dashboard's ``RANKWATCH_REDIS_KEY`` or
``RANKWATCH_REDIS_KEY_FILE``); it writes one 0600 file per rank or host, each
holding a key derived from the master for that rank or host only
(``trainer_bridge.rundir.redisbus.hand_out``), and with ``--launch`` the key
the nodes' ``rankwatch launch`` sign their records in Redis with
(``app/supervise/board.py``). Copy to each node only its own files. The
master key itself is never written.
"""

from __future__ import annotations

import os
from pathlib import Path

import click


def _ranks(spec: str) -> list[int]:
    """``0-7,12`` -> [0, ..., 7, 12]; BadParameter for anything else."""
    out: list[int] = []
    try:
        for part in spec.split(","):
            low, _, high = part.strip().partition("-")
            first, last = int(low), int(high or low)
            if not 0 <= first <= last < 1 << 31 or last - first >= 1_000_000:
                raise ValueError
            out.extend(range(first, last + 1))
    except ValueError:
        raise click.BadParameter(
            f"ranks are N or N-M, comma-separated, not {spec!r}", param_hint="--ranks"
        ) from None
    return out


def write_key(path: Path, value: str) -> None:
    """Write ``value`` to a new 0600 file (never through a symlink, never over another file's mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (value + "\n").encode())
    finally:
        os.close(fd)


@click.command("redis-keys")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The directory the key files go to (made 0700 if absent).",
)
@click.option("--ranks", default="", help="Ranks to write a key for, e.g. 0-7,12: rank_{R}.key each.")
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The job's run directory (its Redis job name, as the bridge derives it); or --job.",
)
@click.option(
    "--job", default="", help="The job's name in Redis (RANKWATCH_REDIS_JOB), when the nodes set one."
)
@click.option(
    "--agent",
    "agents",
    multiple=True,
    help="A host to write an agent key for: agent_{HOST}.key (repeatable).",
)
@click.option(
    "--launch",
    is_flag=True,
    help="Also write launch.key: for every node's rankwatch launch (RANKWATCH_LAUNCH_KEY_FILE).",
)
def redis_keys(
    out: Path, ranks: str, run_dir: Path | None, job: str, agents: tuple[str, ...], launch: bool
) -> None:
    """Write per-rank and per-host Redis keys derived from the master key (one 0600 file each)."""
    from app.config import from_env
    from trainer_bridge.rundir import redisbus

    master = from_env()["REDIS_KEY"]
    if not master:
        raise click.UsageError(
            f"no master key: set {redisbus.REDIS_KEY_ENV} or {redisbus.REDIS_KEY_FILE_ENV}"
        )
    if redisbus.parse_handed(master.encode()) is not None:
        raise click.UsageError(
            "the key given is a handed key, not the master: only the dashboard's key derives others"
        )
    if (ranks or launch) and not (job or run_dir):
        raise click.UsageError("rank and launch keys are bound to the job: give --run-dir or --job")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    name = job or (redisbus.job_key(run_dir) if run_dir else "")
    written = 0
    for rank in _ranks(ranks) if ranks else []:
        write_key(
            out / f"rank_{rank}.key", redisbus.hand_out(master.encode(), redisbus.rank_label(name, rank))
        )
        written += 1
    if launch:
        write_key(out / "launch.key", redisbus.hand_out(master.encode(), redisbus.launch_label(name)))
        written += 1
    for host in agents:
        if not host or "/" in host or host.startswith("."):
            raise click.BadParameter(f"not a host name: {host!r}", param_hint="--agent")
        write_key(out / f"agent_{host}.key", redisbus.hand_out(master.encode(), redisbus.agent_label(host)))
        written += 1
    click.echo(f"rankwatch redis-keys: {written} key file(s) in {out}", err=True)
