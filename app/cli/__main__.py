"""``python -m app.cli`` is ``rankwatch`` (for a checkout without the console script installed)."""

from app.cli import main

main(prog_name="rankwatch")
