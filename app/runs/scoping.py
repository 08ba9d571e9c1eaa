"""Every page and JSON route, once more for each run: ``/runs/<id>/...`` and ``/api/runs/<id>/...``.

Done once, generically, after the blueprints are registered: each rule gets
a run-scoped twin (the same endpoint, with a ``run_id`` argument in
``app/runs/ids.py``'s one-segment form). ``url_value_preprocessor`` pops the
run id into ``g.run_id``, ``app.extensions.rankwatch()`` then returns that
run's container, and ``url_defaults`` puts it back, so every ``url_for`` in
a run's page builds that run's URLs (Werkzeug tries the rule with more
arguments first). Views are unchanged and know nothing of runs.

With ``--run-dir RUN`` today's URLs stay and ``/api/runs/<name>/X`` answers
too. With ``--runs ROOT`` there is no run without an id: ``/`` is the runs
table (``app/runs/routes.py``) and a per-run route without an id is a 404
that says where to look.
"""

from __future__ import annotations

from urllib.parse import quote

from flask import Flask, g, request
from werkzeug.routing import Rule

from app.errors import RunNotFound
from app.runs import ids

RUN_ARG = "run_id"
# Served once for every run: the assets, the session and login that one token covers, and
# /api/health (this dashboard process, for a load balancer's probe).
APP_WIDE = {
    "static",
    "ranks.plotly_js",
    "ranks.plotly_css",
    "ranks.api_health",
    "edge.api_session",
    "edge.api_login",
    "edge.api_login_code",
    "runs.index",  # under --runs, "/": the runs table (app/runs/routes.py)
}


# Under --runs, served without a run too: /metrics, every open run's series.
ROOT_WIDE = {"metrics.prometheus_metrics"}


def twin_path(path: str) -> str:
    if path.startswith("/api/"):
        return f"/api/runs/<run:{RUN_ARG}>/" + path[len("/api/") :]
    return f"/runs/<run:{RUN_ARG}>" + path


def install(app: Flask, registry) -> None:
    """Add the run-scoped twin of every per-run rule registered so far, and the hooks that route by run."""
    app.extensions["rankwatch_runs"] = registry
    app.url_map.converters["run"] = ids.RunIdConverter
    scoped = set()
    for rule in list(app.url_map.iter_rules()):
        if rule.endpoint in APP_WIDE or RUN_ARG in rule.arguments:
            continue
        scoped.add(rule.endpoint)
        app.url_map.add(
            Rule(
                twin_path(rule.rule),
                endpoint=rule.endpoint,
                methods=rule.methods,
                defaults=rule.defaults,
                strict_slashes=rule.strict_slashes,
                # A run id never holds a "/" (ids.encode), so "//" after /runs/ is a decoded
                # %2F: refused with a 404 rather than redirected to a path with ".." in it.
                merge_slashes=False,
            )
        )
    app.extensions["rankwatch_scoped"] = scoped

    @app.url_value_preprocessor
    def pop_run(endpoint, values):
        if values and RUN_ARG in values:
            g.run_id = values.pop(RUN_ARG)

    @app.url_defaults
    def add_run(endpoint, values):
        run_id = g.get("run_id")
        if (
            run_id is not None
            and RUN_ARG not in values
            and app.url_map.is_endpoint_expecting(endpoint, RUN_ARG)
        ):
            values[RUN_ARG] = run_id

    @app.before_request
    def check_run():
        run_id = g.get("run_id")
        if run_id is not None:
            registry.get(run_id)  # RunNotFound for a run that is not here
        elif registry.is_root and request.endpoint in scoped and request.endpoint not in ROOT_WIDE:
            raise RunNotFound(
                f"this dashboard serves the runs under {app.config['RUNS_ROOT']}: each run's routes are "
                f"/runs/<id>/ and /api/runs/<id>/{request.path.removeprefix('/api/')} (the ids: GET /api/runs)",
            )

    @app.context_processor
    def run_context():
        run_id = g.get("run_id")
        if run_id is None and registry.single is not None:
            api = request.script_root + "/api"
        else:
            api = request.script_root + (
                "/api/runs/" + quote(ids.encode(run_id), safe="") if run_id else "/api"
            )
        return {"run_id": run_id, "api_base": api, "runs_root": registry.is_root}
