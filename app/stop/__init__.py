"""Stop gracefully: the flag, the operator token, the lifecycle and the audit trail."""

from flask import Blueprint

bp = Blueprint("stop", __name__)

from app.stop import routes  # noqa: E402,F401  (registers the views on bp)
