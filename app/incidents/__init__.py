"""When a job goes wrong: stack captures of stuck ranks, webhook alerts, the automatic stop policy.

``stacks.py`` reads, requests and groups stack captures; ``monitor.py`` is
the watcher's incident step (alerts from verdict changes and stops, and the
policy of ``app.incidents.policy``); ``routes.py`` serves them (README, "When a job
hangs").
"""

from flask import Blueprint

bp = Blueprint("incidents", __name__)

from app.incidents import routes  # noqa: E402,F401  (registers the views on bp)
