"""The page, the JSON API (README, "JSON API") and the local Plotly.js; ``/metrics`` is ``app.prometheus``'s.

Reads refresh the view first when it is older than a tick, so the API
answers from the files even when the watcher has not started (the app made
by ``create_app`` alone, as in tests).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from functools import cache
from importlib import metadata, resources

from flask import Blueprint, Response, current_app, jsonify, render_template, send_file, url_for

from app.attempts import answer as attempts_answer
from app.edge import params, plotly_csp
from app.edge.auth import for_viewer, has_token
from app.errors import NotFound, RankNotFound
from app.extensions import rankwatch
from app.large import large_answer
from app.ranks import charts
from app.ranks.metrics import as_json as metrics_json
from app.ranks.params import HistoryPage, RunHistoryQuery
from app.ranks.window import (  # noqa: F401  (the page bounds are re-exported: tests import them from here)
    PER_PAGE_DEFAULT,
    PER_PAGE_MAX,
    RanksPage,
    page_of,
)
from app.run import slurmstop
from app.run.verdicts import VERDICT_HELP, VERDICTS

bp = Blueprint("ranks", __name__)

bp.record_once(lambda setup: setup.app.extensions["rankwatch"].nav.append(("ranks.index", "Ranks")))


@cache
def plotly_js_path():
    """plotly.min.js as shipped inside the installed plotly package: no CDN needed."""
    return resources.files("plotly") / "package_data" / "plotly.min.js"


def fresh_state(now: float):
    rw = rankwatch()
    rw.state.refresh(now, rw.watcher.tick_s)
    return rw.state


def page_config() -> dict:
    """What the page's scripts need, passed as JSON in the page."""
    cfg = current_app.config
    return {
        "metrics": metrics_json(),
        "verdicts": [{"name": v, "help": VERDICT_HELP[v]} for v in VERDICTS],
        "settings": {
            k.lower(): cfg[k]
            for k in (
                "TICK_S",
                "HISTORY_POINTS",
                "CHART_BUCKET_S",
                "CHART_REFRESH_S",
                "CHART_LINES_MAX_RANKS",
                "PAGE_SIZE",
                "STRAGGLER_RATIO",
            )
        },
        "urls": {
            "history": url_for("ranks.api_history"),
            "run_history": url_for("ranks.api_run_history"),
            "attempts": url_for("ranks.api_attempts"),
            "spikes": url_for("incidents.api_spikes"),
        },
    }


@bp.get("/")
def index():
    return render_template(
        "index.html",
        page_config=page_config(),
        plotly_version=metadata.version("plotly"),
        plotly_style_ids=plotly_csp.style_ids(),
    )


@bp.get("/vendor/plotly.min.js")
def plotly_js():
    return send_file(plotly_js_path(), mimetype="text/javascript", max_age=24 * 3600)


@bp.get("/vendor/plotly.css")
def plotly_css():
    """Plotly's own CSS as a stylesheet, so the CSP needs no inline styles (app/edge/plotly_csp.py)."""
    response = Response(plotly_csp.plotly_css(), mimetype="text/css")
    response.cache_control.max_age = 24 * 3600
    return response


@bp.get("/api/ranks")
def api_ranks():
    """The ranks' rows, a page at a time (``?page=``, ``?per_page=``); ``?health=dead,stalled``
    keeps only those verdicts, ``?sort=worst`` puts trouble first."""
    q = params.query(RanksPage)
    now = time.time()
    body, w = page_of(fresh_state(now), now, q)
    if q.page > w["pages"]:
        raise NotFound(
            f"page {q.page} is past the last page, {w['pages']} ({w['total']} rows, {q.per_page} a page)"
        )
    # Without the token, the run status names the run, not where it lives (issue 32, P11).
    body = for_viewer(body, rankwatch().state.run_dir, rankwatch().room)
    return jsonify(body | {k: w[k] for k in ("page", "per_page", "total", "pages")})


@bp.get("/api/ranks/<int:rank>")
def api_rank(rank: int):
    """One rank's row and its chart history."""
    now = time.time()
    found = fresh_state(now).rank(rank, now)
    if found is None:
        raise RankNotFound(rank)
    return jsonify(found)


@bp.get("/api/hosts/<host>/ranks")
def api_host_ranks(host: str):
    """The rows of one node's ranks (the page fetches them when it opens a node).

    With agents they come fresh from the node's agent (``agent`` says whether it answered).
    """
    now = time.time()
    found = fresh_state(now).node(host, now)
    if found is None:
        raise NotFound(f"no rank of this job runs on host {host[:253]!r}")
    return jsonify(found)


@bp.get("/api/attempts")
def api_attempts():
    """Every launch of the job in this run directory, oldest first (app/attempts.py)."""
    now = time.time()
    state = fresh_state(now)
    beats, _ = state.heartbeats()
    body = attempts_answer(state.run_dir, beats, state.job_ended(), state.log_attempts())
    stop = rankwatch().stop
    # Under Slurm: whether a preemption's graceful stop fits in KillWait (app/run/slurmstop.py).
    slurm_stop = (
        slurmstop.verdict(str(state.run_dir), body["attempts"], beats.values(), stop.estimated_s)
        if state.run_dir and stop is not None
        else None
    )
    # The run's goodput, restarts and steps lost (app/run/goodput.py), shown above the timeline.
    return jsonify(body | {"goodput": state.goodput(body["attempts"], now), "slurm_stop": slurm_stop})


def opaque(name: str) -> str:
    """A stable stand-in for a ``host:pid:tag`` name, the same in every process that shows it."""
    return "p-" + hashlib.sha256(name.encode()).hexdigest()[:12]


@bp.get("/api/summary")
def api_summary():
    now = time.time()
    return jsonify(for_viewer(fresh_state(now).summary(now), rankwatch().state.run_dir, rankwatch().room))


@bp.get("/api/health")
def api_health():
    """This dashboard process: its role behind a shared Redis (app/cluster.py), and Redis's state."""
    cluster = rankwatch().watcher.cluster
    body = {"pid": os.getpid()}
    if cluster is None:
        body |= {"role": "only", "redis": None}
    else:
        body |= cluster.status()
    if not has_token():
        # Host names and process ids are for the operator (issue 32, P11): a viewer without the
        # token gets an opaque name per process, enough to tell one leader.
        body.pop("pid")
        for field in ("id", "leader"):
            if body.get(field):
                body[field] = opaque(body[field])
    hub = getattr(rankwatch().state.source, "hub", None)  # with agents (app/agent/hubsource.py)
    if hub is not None:
        body["hub"] = hub.status()
    rows = current_app.extensions.get("rankwatch_rows")  # under --runs (app/runs/registry.py)
    if rows is not None and rows.registry.is_root:
        # Live runs left without a watcher, so that a flood of fake runs cannot hide it (P6).
        body["runs"] = rows.registry.watch_status()
    return jsonify(body)


@bp.get("/api/history")
def api_history():
    """Chart history as a ranks x time-bucket matrix; ``?points=N`` keeps the newest N buckets.

    Paged as ``/api/ranks`` (``?page=``, ``?per_page=`` up to 4,096 ranks, the default): one
    answer holds a page whatever world size job.json declares.
    """
    q = params.query(HistoryPage)
    state = fresh_state(time.time())
    start = (q.page - 1) * q.per_page
    with large_answer(min(state.world_size(), q.per_page), "the chart history of every rank"):
        body = charts.history(state, q.points, start, q.per_page)
    pages = max(1, math.ceil(body["total"] / q.per_page))
    if q.page > pages:
        raise NotFound(
            f"page {q.page} is past the last page, {pages} ({body['total']} ranks, {q.per_page} a page)"
        )
    return jsonify(body | {"page": q.page, "per_page": q.per_page, "pages": pages})


@bp.get("/api/history/run")
def api_run_history():
    """The whole run's chart series: per attempt, one point per global step (app/run/history.py).

    ``?after=T&generation=G`` (from an earlier answer) sends only the newer points while nothing was thinned.
    """
    q = params.query(RunHistoryQuery)
    now = time.time()
    state = fresh_state(now)
    beats, _ = state.heartbeats()
    rows = attempts_answer(state.run_dir, beats, state.job_ended())["attempts"]
    return jsonify(state.run_history(rows, q.after, q.generation))


@bp.get("/api/metrics")
def api_metrics():
    """What each field means (name, label, unit, description) and each verdict."""
    cfg = page_config()
    return jsonify({"metrics": cfg["metrics"], "verdicts": cfg["verdicts"]})


from app.ranks import events  # noqa: E402,F401  (registers its Socket.IO handlers)
