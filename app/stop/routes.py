"""The stop API (README, "JSON API"): request, follow, cancel, re-arm, audit.

Every state change needs the operator token (``app.edge.auth``) and a JSON body
that passes ``json_body``; checks happen before anything is written.
"""

from __future__ import annotations

import time

from flask import Blueprint, Response, current_app, jsonify, request

from app.edge.auth import json_body, over_write_budget, require_operator
from app.errors import BadRequest, NoRunDir
from app.extensions import rankwatch

bp = Blueprint("stop", __name__)

WHO_DEFAULT = "operator"


def _live():
    """(heartbeats by rank, world size), read from the files now.

    Not the watcher's view, which may be a tick old: cancel and re-arm decide
    on where the ranks are, and a rank may have agreed a moment ago.
    """
    _require_run_dir()
    state = rankwatch().state
    state.scan(time.time())
    return state.heartbeats()


def _require_run_dir() -> None:
    if not current_app.config["RUN_DIR"]:
        raise NoRunDir()


def _who(body: dict) -> str:
    return body.get("who") or WHO_DEFAULT


@bp.get("/api/exit")
def api_exit_status():
    ranks, world = _live()
    rw = rankwatch()
    status = rw.stop.status(
        ranks, world, time.time(), logs=rw.state.log_stop_facts(), facts=rw.state.job_facts()
    )
    return jsonify(status | {"estimate": rw.stop.estimate(ranks, world)})


@bp.post("/api/exit")
def api_exit_request():
    """Write the flag. Reads no heartbeat: the stop must not depend on any rank's file.

    Never refused for the write budget (``OPERATOR_WRITES_PER_MIN``): past it,
    a press that joins the pending request is answered but not audited, so a
    flood of presses cannot grow the trail and the stop still goes through.
    """
    require_operator(count=False)
    body = json_body({"reason": (str, True), "who": (str, False)})
    _require_run_dir()
    over = over_write_budget() > 0
    rid, created, audit_error, lock_error = rankwatch().stop.request(
        body["reason"], _who(body), request.remote_addr, audit_duplicate=not over
    )
    answer = {"request_id": rid, "created": created}
    if audit_error:
        answer["audit_error"] = audit_error
    if lock_error:
        answer["lock_error"] = f"{lock_error}; the flag was written atomically without the flag lock"
    return jsonify(answer), 202


@bp.post("/api/exit/cancel")
def api_exit_cancel():
    require_operator()
    body = json_body({"reason": (str, False), "who": (str, False)})
    ranks, _ = _live()
    rw = rankwatch()
    rid = rw.stop.cancel(
        ranks, _who(body), request.remote_addr, body.get("reason"), facts=rw.state.job_facts()
    )
    return jsonify({"request_id": rid, "cancelled": True})


@bp.post("/api/exit/rearm")
def api_exit_rearm():
    require_operator()
    body = json_body({"reason": (str, False), "who": (str, False), "force": (bool, False)})
    ranks, world = _live()
    rw = rankwatch()
    rid = rw.stop.rearm(
        ranks,
        world,
        _who(body),
        request.remote_addr,
        body.get("reason"),
        force=body.get("force", False),
        facts=rw.state.job_facts(),
    )
    return jsonify({"request_id": rid, "rearmed": True})


@bp.get("/api/audit")
def api_audit():
    raw = request.args.get("limit", "200")
    # isascii: str.isdigit() also accepts "²", which int() refuses (a 500).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 5 or not 0 < int(raw) <= 10000:
        raise BadRequest(f"query parameter 'limit' must be an integer from 1 to 10000, not {raw!r}")
    return jsonify({"rows": rankwatch().stop.audit.rows(limit=int(raw))})


@bp.get("/api/audit.csv")
def api_audit_csv():
    """The whole trail, streamed a few hundred rows at a time (never built in memory).

    A trail that cannot be opened is a 503 (``AuditError`` is ``Unavailable``).
    """
    return Response(
        rankwatch().stop.audit.iter_csv(),
        mimetype="text/csv",
        headers={"Content-Disposition": "attachment; filename=rankwatch-audit.csv"},
    )
