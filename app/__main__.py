"""``python -m app --run-dir RUN [--host 127.0.0.1] [--port 5000]``: start the dashboard.

The same command as ``rankwatch serve`` (``app/cli/serve.py``): every
setting in ``app.config.SETTINGS`` is also an option (``--tick-s``,
``--dead-after-s``, ...); an option wins over ``RANKWATCH_<NAME>``, which
wins over the default.
"""

from __future__ import annotations

import sys


def parse_args(argv: list[str] | None = None, prog: str = "python -m app") -> dict:
    """The settings the options give, by name; exits with the message on a bad one."""
    from app.cli.serve import parse

    return parse(sys.argv[1:] if argv is None else argv, prog)


def main(argv: list[str] | None = None, prog: str = "python -m app") -> None:
    from app.cli.serve import serve

    serve.main(argv, prog_name=prog)


if __name__ == "__main__":
    main()
