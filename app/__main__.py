"""``python -m app --run-dir RUN [--host 127.0.0.1] [--port 5000]``: start the dashboard.

Every setting in ``app.config.SETTINGS`` is also a flag (``--tick-s``,
``--dead-after-s``, ...); a flag wins over ``RANKWATCH_<NAME>``, which wins
over the default. ``rankwatch serve`` takes the same flags (``app.cli``).
"""

from __future__ import annotations

import argparse

from app.config import PING_INTERVAL_S, SETTINGS, from_env


def parse_args(argv: list[str] | None = None, prog: str = "python -m app") -> dict:
    env = from_env()
    parser = argparse.ArgumentParser(prog=prog, description="Rankwatch: a live console for a MindSpore run.")
    for s in SETTINGS:
        parser.add_argument(
            s.flag,
            dest=s.name,
            type=s.coerce,
            default=env[s.name],
            help=f"{s.help} (env {s.env}; default {s.default!r})",
        )
    args = vars(parser.parse_args(argv))
    if not args["RUN_DIR"]:
        parser.error("--run-dir is required (or set RANKWATCH_RUN_DIR)")
    if args["READ_TIMEOUT_S"] <= PING_INTERVAL_S:
        parser.error(
            f"--read-timeout-s must exceed Engine.IO's ping interval of {PING_INTERVAL_S} s, "
            "or every open page loses its WebSocket"
        )
    return args


def main(argv: list[str] | None = None, prog: str = "python -m app") -> None:
    config = parse_args(argv, prog)
    # Imported here: parsing the flags must not need the server (tests, --help).
    from app.server import serve

    serve(config)


if __name__ == "__main__":
    main()
