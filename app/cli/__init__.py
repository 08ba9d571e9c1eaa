"""``rankwatch``: the console script (click), a thin front end over the dashboard's engines.

* ``serve`` is ``python -m app`` (``app/cli/serve.py``), ``demo`` is
  ``python -m trainer_bridge.demo`` with the dashboard on;
* ``status``, ``stop`` and ``checkpoints`` read and write the run directory
  through ``app.compose.build``, the same ``RunState``, ``StopService``
  (and audit trail) and ``CheckpointService`` the dashboard uses, so they
  work with or without a dashboard running;
* ``login`` prints a fresh single-use login link for a running dashboard;
* ``launch`` supervises an msrun job and relaunches it after a failure (``app.supervise``);
* ``slurm`` prints the batch script that runs ``launch`` under Slurm, and holds the steps it calls.

Settings (thresholds, ``AUDIT_DB``, ...) come from the same ``RANKWATCH_*``
environment variables as the dashboard's (``app.config.SETTINGS``).

Each command is imported when it is named (or listed by ``--help``), and
each command module imports the engines, rich and Flask only when it runs:
``rankwatch --version`` and ``--help`` load none of them.
"""

from __future__ import annotations

import importlib

import click

# name -> "module:attribute" of its click command, in --help's order.
COMMANDS = {
    "serve": "app.cli.serve:serve",
    "demo": "app.cli:demo_command",
    "status": "app.cli.status:status",
    "runs": "app.cli.runs:runs",
    "stop": "app.cli.stop:stop",
    "checkpoints": "app.cli.checkpoints:checkpoints",
    "login": "app.cli.login:login",
    "agent": "app.cli.agent:agent",
    "redis-keys": "app.cli.rediskeys:redis_keys",
    "launch": "app.cli.launch:launch",
    "slurm": "app.cli.slurm:slurm",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use (click's documented lazy-loading pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name].split(":")
        found = getattr(importlib.import_module(module), attribute)
        return found() if attribute == "demo_command" else found

    @property
    def commands(self) -> dict[str, click.Command]:
        """Every command, imported (for the docs test and tools that walk the group)."""
        return {name: self.get_command(None, name) for name in COMMANDS}

    @commands.setter
    def commands(self, value) -> None:
        # click.Group.__init__ assigns it; the commands are COMMANDS.
        pass


def demo_command() -> click.Command:
    """``rankwatch demo``: the demo's own command (trainer_bridge/demo), with the dashboard on."""
    from trainer_bridge.demo.__main__ import demo_command as make

    return make("demo", dashboard=True)


@click.group("rankwatch", cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="rankwatch")
def main() -> None:
    """Rankwatch: watch, stop and resume a MindSpore msrun job.

    Every command takes --help. The dashboard is `rankwatch serve --run-dir RUN`;
    from a shell, `status`, `stop` and `checkpoints` work on the same run
    directory, with or without the dashboard running.
    """
