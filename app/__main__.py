"""``python -m app --run-dir RUN [--host 127.0.0.1] [--port 5000]``: start the dashboard.

Every setting in ``app.config.SETTINGS`` is also a flag (``--tick-s``,
``--dead-after-s``, ...); a flag wins over ``RANKWATCH_<NAME>``, which wins
over the default.
"""
from __future__ import annotations

import argparse
import sys

from app import create_app, socketio
from app.config import SETTINGS, from_env


def parse_args(argv: list[str] | None = None) -> dict:
    env = from_env()
    parser = argparse.ArgumentParser(
        prog="python -m app", description="Rankwatch: a live console for a MindSpore run.")
    for s in SETTINGS:
        parser.add_argument(s.flag, dest=s.name, type=s.coerce, default=env[s.name],
                            help=f"{s.help} (env {s.env}; default {s.default!r})")
    args = vars(parser.parse_args(argv))
    if not args["RUN_DIR"]:
        parser.error("--run-dir is required (or set RANKWATCH_RUN_DIR)")
    return args


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    app = create_app(config)
    url = f"http://{config['HOST']}:{config['PORT']}/"
    print(f"Rankwatch: watching {config['RUN_DIR']} on {url}", file=sys.stderr, flush=True)
    if app.config["TOKEN_GENERATED"]:
        # Printed once, as Jupyter does; the #fragment never reaches a server log.
        print(f"Rankwatch: operator token (set RANKWATCH_TOKEN to choose your own): "
              f"{app.config['TOKEN']}\n    or open {url}#token={app.config['TOKEN']}",
              file=sys.stderr, flush=True)
    # The watcher also records a completed stop and re-arms the flag: that
    # must not wait for a browser to connect.
    app.extensions["rankwatch"].watcher.ensure_started()
    socketio.run(app, host=config["HOST"], port=config["PORT"], allow_unsafe_werkzeug=True)


if __name__ == "__main__":
    main()
