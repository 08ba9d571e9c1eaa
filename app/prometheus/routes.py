"""``GET /metrics`` (and, under ``--runs``, every open run's series at ``/metrics`` and one run's at
``/runs/<id>/metrics``)."""

from __future__ import annotations

import time
from typing import Annotated, Literal

from flask import Blueprint, Response, current_app, g, request
from pydantic import Field

from app.edge import params
from app.edge.auth import require_operator
from app.extensions import rankwatch
from app.large import large_answer
from app.prometheus import exporter, runs

bp = Blueprint("metrics", __name__)


class MetricsScope(params.Query):
    per_rank: Annotated[Literal["0", "1"] | None, Field(description="0 or 1")] = None


@bp.get("/metrics")
def prometheus_metrics():
    """Prometheus's text format (OpenMetrics if asked): see app/prometheus/exporter.py.

    ``?per_rank=1`` serves every rank's series whatever the job's size, ``?per_rank=0`` only the
    summaries; without it, per-rank series come up to METRICS_PER_RANK_MAX ranks.
    """
    raw = params.query(MetricsScope).per_rank
    registry = current_app.extensions["rankwatch_runs"]
    if registry.is_root:
        return _runs_metrics(registry, raw)
    rw = rankwatch()
    rw.state.refresh(time.time(), rw.watcher.tick_s)
    world = rw.state.world_size()
    most = current_app.config["METRICS_PER_RANK_MAX"]
    if raw == "1" and world > most:
        # An answer that grows with the world size job.json declares: the operator's to ask for (P8).
        require_operator(count=False)
    per_rank = world <= most if raw is None else raw == "1"
    with large_answer(world if per_rank else 0, "/metrics with every rank's series"):
        body, content_type = exporter.exposition(rw, request.headers.get("Accept"), per_rank)
    return Response(body, content_type=content_type)


def _runs_metrics(registry, raw: str | None) -> Response:
    """Under --runs, /metrics is every open run's series, /runs/<id>/metrics that run's; each with ``run``."""
    run_id = g.get("run_id")
    if run_id is not None:
        chosen = [(run_id, registry.get(run_id))]
    else:
        chosen = [(i, rw) for i in registry.open_ids() if (rw := registry.peek(i)) is not None]
    most = current_app.config["METRICS_PER_RANK_MAX"]
    if raw == "1" and any(rw.state.world_size() > most for _, rw in chosen):
        # Every rank's series of a job past the limit: the operator's to ask for (P8).
        require_operator(count=False)
    body, content_type = runs.exposition(
        chosen,
        request.headers.get("Accept"),
        current_app.config["METRICS_PER_RANK_MAX"],
        None if raw is None else raw == "1",
    )
    return Response(body, content_type=content_type)
