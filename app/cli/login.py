"""``rankwatch login``: a fresh single-use login link for a running dashboard (``app/edge/login.py``)."""

from __future__ import annotations

import click

from app.cli.common import run_dir_params


@click.command()
@click.option("--url", default=None, help="The dashboard's address, when several of yours run.")
@run_dir_params(
    required=False,
    envvar=None,
    type=click.STRING,
    callback=None,
    help="The dashboard's run directory (or RUN), when several of yours run (env RANKWATCH_RUN_DIR is not read).",
)
def login(url: str | None, run_dir: str | None) -> None:
    """Print a single-use link that makes a browser an operator (stop, delete).

    Run it on the dashboard's machine, as the user running it: it asks that
    dashboard for a code with the token from its private server file. The
    link works once, and for LOGIN_TTL_S seconds (2 min by default).
    """
    from app.edge.login import mint_login_url

    try:
        click.echo(mint_login_url(url, run_dir))
    except (LookupError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
