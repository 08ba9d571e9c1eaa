"""``GET /api/runs`` and, under ``--runs ROOT``, the landing page ``/``: the runs table.

``bp`` holds ``/``: under ``--runs`` it is registered before the Ranks page,
so that ``/`` is the runs table (Werkzeug matches the first of two equal
rules), while a run's own page is ``/runs/<id>/``; with ``--run-dir`` it is
not registered and ``/`` is the Ranks page. ``register`` adds ``/api/runs``
after ``app/runs/scoping.py`` has twinned the per-run routes, so it is
served once, not per run.
"""

from __future__ import annotations

from flask import Blueprint, Flask, current_app, jsonify, render_template, request, url_for

from app.runs.rows import PER_PAGE_DEFAULT, STATES, Rows, parse_args

bp = Blueprint("runs", __name__)


@bp.get("/")
def index():
    return render_template(
        "runs.html",
        runs_config={
            "api": url_for("runs.api_runs"),
            "per_page": PER_PAGE_DEFAULT,
            "states": list(STATES),
        },
        root=current_app.config["RUNS_ROOT"],
    )


def register(app: Flask, rows: Rows) -> None:
    registry = rows.registry
    app.extensions["rankwatch_rows"] = rows
    registry.on_tick = rows.warm

    def api_runs():
        body = rows.table(**parse_args(request.args))
        # Copies: an idle run's row is shared with the cache.
        body["runs"] = [{**row, "url": url_for("ranks.index", run_id=row["id"])} for row in body["runs"]]
        return jsonify(body)

    app.add_url_rule("/api/runs", "runs.api_runs", api_runs, methods=["GET"])
