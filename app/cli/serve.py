"""``rankwatch serve`` (and ``python -m app``): start the dashboard, one option per setting.

The options are made from ``app.config.SETTINGS`` and grouped as
``Setting.group`` says (``app.config.GROUPS`` orders the groups); a flag wins over ``RANKWATCH_<NAME>``, which
wins over the default. Before the server starts, the port is tried, so a
port in use is one clear line and a non-zero exit, not gunicorn's retries.
"""

from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click

from app.cli.common import one_run_dir, plain
from app.cli.grouped import GroupedCommand, setting_option
from app.config import PING_INTERVAL_S, grouped, secrets_from_env

PORT_IN_USE = "port {port} is in use (another Rankwatch?): use --port N or --port 0"
# When the port's holder is one of this user's dashboards, say which run it
# serves: the advice "use another port" alone led newcomers to launch a second
# job into the same run directory (issue 33).
PORT_HELD_BY_DASHBOARD = (
    "port {port} is in use by your Rankwatch dashboard of {what} (pid {pid}, {url}): "
    "`{login} --url {url}` prints a login link for it. To run another job beside it, "
    "give that job its own run directory and a free port (--run-dir OTHER --port 0; "
    "make demo RUN=runs/other PORT=0)"
)


def port_in_use(port: int) -> str:
    """What to say about a port in use: the dashboard of ours that holds it, else the plain advice."""
    from app.edge.login import LOGIN_COMMAND, running_dashboards

    for info in running_dashboards():
        url = info.get("url")
        if not isinstance(url, str) or urlsplit(url).port != port:
            continue
        root, run = info.get("runs_root"), info.get("run_dir")
        what = (
            f"the runs under {root}"
            if isinstance(root, str) and root
            else run
            if isinstance(run, str)
            else "?"
        )
        return PORT_HELD_BY_DASHBOARD.format(
            port=port, what=what, pid=info.get("pid", "?"), url=url, login=LOGIN_COMMAND
        )
    return PORT_IN_USE.format(port=port)


def check_port(host: str, port: int) -> None:
    """Refuse at once when ``host:port`` cannot be listened on (``--port 0`` always can).

    SO_REUSEADDR as gunicorn sets it, so a port only in TIME_WAIT after a
    previous dashboard is not taken for one in use. The socket is closed
    before gunicorn binds: another process could take the port in between,
    and then gunicorn's own error stands.
    """
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise click.ClickException(f"cannot listen on {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise click.ClickException(port_in_use(port)) from None
            raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror}") from None


def settings_params(f):
    params = [setting_option(s, title) for title, settings in grouped() for s in settings if s.argv]
    f.__click_params__ = getattr(f, "__click_params__", []) + list(reversed(params))
    return f


@click.command(
    cls=GroupedCommand, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110}
)
@settings_params
@click.option(
    "--runs",
    "runs",
    metavar="ROOT",
    default=None,
    help="Serve every run under ROOT: a landing page of runs, a console per run (as --runs-root).",
)
@click.argument("run_arg", metavar="[RUN]", required=False)
def serve(runs: str | None = None, run_arg: str | None = None, **settings) -> None:
    """Serve the dashboard on a run directory (RUN, or --run-dir RUN) or a root of runs (--runs ROOT).

    Every setting is an option below and an environment variable; the
    README's "Dashboard settings" explains each one.
    """
    settings["RUN_DIR"] = one_run_dir(settings["RUN_DIR"], run_arg, "RUN_DIR")
    config = config_from(settings, runs)
    check_port(config["HOST"], config["PORT"])
    if config["RUNS_ROOT"]:
        if not Path(config["RUNS_ROOT"]).is_dir():
            raise click.BadParameter(f"{plain(config['RUNS_ROOT'])} is not a directory", param_hint="--runs")
    elif not Path(config["RUN_DIR"]).is_dir():
        click.echo(
            f"Rankwatch: {plain(config['RUN_DIR'])} does not exist (yet): the dashboard waits for the "
            "job to create it; if that is a typo, Ctrl-C and check --run-dir",
            err=True,
        )
    # Imported here: the options and --help must not need the server.
    from app.serve.server import serve as run_server

    run_server(config)


def config_from(settings: dict, runs: str | None = None) -> dict:
    """The settings' values by name (``RUN_DIR``...), checked as a whole."""
    config = dict(settings)
    config.pop("runs", None)
    try:
        config |= secrets_from_env()  # no flags: the environment, or a file it names
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if runs:
        config["RUNS_ROOT"] = runs
    if config["RUN_DIR"] and config["RUNS_ROOT"]:
        raise click.UsageError("give --run-dir RUN (one run) or --runs ROOT (every run under ROOT), not both")
    if not config["RUN_DIR"] and not config["RUNS_ROOT"]:
        raise click.UsageError(
            "--run-dir is required (or --runs ROOT for every run under ROOT; "
            "or set RANKWATCH_RUN_DIR / RANKWATCH_RUNS_ROOT)"
        )
    if config["READ_TIMEOUT_S"] <= PING_INTERVAL_S:
        raise click.BadParameter(
            f"must exceed Engine.IO's ping interval of {PING_INTERVAL_S} s, "
            "or every open page loses its WebSocket",
            param_hint="--read-timeout-s",
        )
    return config


def parse(argv: list[str], prog: str) -> dict:
    """The settings ``argv`` gives (``app.__main__.parse_args``); exits on a bad one, as the command does."""
    try:
        with serve.make_context(prog, list(argv)) as ctx:
            params = dict(ctx.params)
            params["RUN_DIR"] = one_run_dir(params["RUN_DIR"], params.pop("run_arg", None), "RUN_DIR")
            return config_from(params, params.pop("runs", None))
    except click.ClickException as e:
        e.show(sys.stderr)
        raise SystemExit(e.exit_code) from None
