"""``GET /api/runs`` and, under ``--runs ROOT``, the landing page ``/``: the runs table.

Registered after ``app/runs/scoping.py`` has twinned the per-run routes, so
these two are served once, not per run.
"""

from __future__ import annotations

from flask import Flask, Response, g, jsonify, render_template, request, url_for

from app.edge import params
from app.edge.auth import require_operator
from app.runs.rows import PER_PAGE_DEFAULT, STATES, Rows, parse_args


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

    @app.before_request
    def landing():
        # Under --runs, "/" (main.index without a run) is the runs table.
        if registry.is_root and request.endpoint == "ranks.index" and g.get("run_id") is None:
            return render_template(
                "runs.html",
                runs_config={
                    "api": url_for("runs.api_runs"),
                    "per_page": PER_PAGE_DEFAULT,
                    "states": list(STATES),
                },
                root=app.config["RUNS_ROOT"],
            )
        if registry.is_root and request.endpoint == "ranks.prometheus_metrics":
            return runs_metrics()
        return None

    def runs_metrics():
        """Under --runs, /metrics is every open run's series, /runs/<id>/metrics that run's; each with ``run``."""
        from app.runs.metrics import exposition

        raw = params.query(params.MetricsScope).per_rank
        run_id = g.get("run_id")
        if run_id is not None:
            chosen = [(run_id, registry.get(run_id))]
        else:
            chosen = [(i, rw) for i in registry.open_ids() if (rw := registry.peek(i)) is not None]
        if raw == "1" and any(rw.state.world_size() > app.config["METRICS_PER_RANK_MAX"] for _, rw in chosen):
            # Every rank's series of a job past the limit: the operator's to ask for (P8).
            require_operator(count=False)
        body, content_type = exposition(
            chosen,
            request.headers.get("Accept"),
            app.config["METRICS_PER_RANK_MAX"],
            None if raw is None else raw == "1",
        )
        return Response(body, content_type=content_type)
