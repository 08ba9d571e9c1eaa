"""The checkpoint browser: which sets every rank can resume from, and how; download, delete, verify."""

from flask import Blueprint

bp = Blueprint("checkpoints", __name__)
bp.record_once(
    lambda setup: setup.app.extensions["rankwatch"].nav.append(("checkpoints.page", "Checkpoints"))
)

from app.checkpoints import routes  # noqa: E402,F401  (registers the views on bp)
