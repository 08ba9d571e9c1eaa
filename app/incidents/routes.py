"""The stack, alert and policy API (README, "JSON API" and "When a job hangs").

Reading needs no token. Asking for a capture needs the operator token and a
JSON body (``app.edge.auth``): it makes a trainer, or py-spy, do work.
"""

from __future__ import annotations

import time

from flask import Blueprint, jsonify

from app.edge import params
from app.edge.auth import require_operator
from app.extensions import rankwatch
from app.incidents.params import AlertRows, StackRequest, StacksAnswered, StackTrigger

bp = Blueprint("incidents", __name__)

WHO_DEFAULT = "operator"


def _fresh_now() -> float:
    """Now, with the view at most a tick old: routing a request reads the rank's verdict."""
    rw = rankwatch()
    now = time.time()
    rw.state.refresh(now, rw.watcher.tick_s)
    return now


@bp.get("/api/ranks/<int:rank>/stack")
def api_stack(rank: int):
    """The rank's newest stack capture; ``?trigger=stall`` (or ``request``) the newest of that kind."""
    now = _fresh_now()
    return jsonify(rankwatch().stacks.get(rank, now, params.query(StackTrigger).trigger))


@bp.post("/api/ranks/<int:rank>/stack")
def api_stack_request(rank: int):
    require_operator()
    body = params.body(StackRequest)
    now = _fresh_now()
    answer = rankwatch().stacks.request(rank, body.who or WHO_DEFAULT, body.native, now)
    return jsonify(answer), 202


@bp.get("/api/stacks")
def api_stacks():
    """Every rank's newest capture, grouped by identical training-thread stacks.

    ``?request=ID`` adds ``answered``: how many ranks' newest capture answers request ID.
    """
    request_id = params.query(StacksAnswered).request
    return jsonify(rankwatch().stacks.grouped(_fresh_now(), request_id))


@bp.post("/api/stacks")
def api_stacks_request():
    require_operator()
    body = params.body(StackRequest)
    now = _fresh_now()
    answer = rankwatch().stacks.request_all(body.who or WHO_DEFAULT, body.native, now)
    return jsonify(answer), 202


@bp.get("/api/policy")
def api_policy():
    return jsonify(rankwatch().incidents.policy.status(time.time()))


@bp.get("/api/spikes")
def api_spikes():
    """The loss-spike policy in force, the detections (the loss chart's marks) and the rollbacks."""
    _fresh_now()
    return jsonify(rankwatch().incidents.spikes.status())


@bp.get("/api/alerts")
def api_alerts():
    """The webhook targets and delivery attempts, newest first; ``?limit=N`` (1 to 10000, default 100)."""
    limit = params.query(AlertRows).limit
    incidents = rankwatch().incidents
    status = incidents.alerts_status()
    del status["recent"]
    return jsonify({**status, "rows": incidents.alerts.sender.rows(limit)})
