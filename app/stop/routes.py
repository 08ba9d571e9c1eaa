"""The stop API (README, "JSON API"): request, follow, cancel, re-arm, audit.

Every state change needs the operator token (``app.edge.auth``) and a JSON body
that passes ``app.edge.params``; checks happen before anything is written.
"""

from __future__ import annotations

import time

from flask import Blueprint, Response, jsonify, request

from app.edge import params
from app.edge.auth import over_write_budget, require_operator
from app.errors import NoRunDir
from app.extensions import rankwatch
from app.stop.params import AuditRows, Rearm, StopChange, StopRequest

bp = Blueprint("stop", __name__)

WHO_DEFAULT = "operator"


def _live() -> None:
    """Bring the run's view up to date with the files now, before the stop service reads it.

    Not the watcher's view, which may be a tick old: cancel and re-arm decide
    on where the ranks are, and a rank may have agreed a moment ago.
    """
    _require_run_dir()
    rankwatch().state.scan(time.time())


def _require_run_dir() -> None:
    if rankwatch().state.run_dir is None:
        raise NoRunDir()


def _who(body: StopRequest | StopChange) -> str:
    return body.who or WHO_DEFAULT


@bp.get("/api/exit")
def api_exit_status():
    _live()
    rw = rankwatch()
    inputs = rw.state.stop_inputs()  # one look at the run for both parts of the answer
    return jsonify(rw.stop.status(time.time(), inputs) | {"estimate": rw.stop.estimate(inputs)})


@bp.post("/api/exit")
def api_exit_request():
    """Write the flag. Reads no heartbeat: the stop must not depend on any rank's file.

    Never refused for the write budget (``OPERATOR_WRITES_PER_MIN``): past it,
    a press that joins the pending request is answered but not audited, so a
    flood of presses cannot grow the trail and the stop still goes through.
    """
    require_operator(count=False)
    body = params.body(StopRequest)
    _require_run_dir()
    over = over_write_budget() > 0
    rid, created, audit_error, lock_error = rankwatch().stop.request(
        body.reason, _who(body), request.remote_addr, audit_duplicate=not over
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
    body = params.body(StopChange)
    _live()
    rid = rankwatch().stop.cancel(_who(body), request.remote_addr, body.reason)
    return jsonify({"request_id": rid, "cancelled": True})


@bp.post("/api/exit/rearm")
def api_exit_rearm():
    require_operator()
    body = params.body(Rearm)
    _live()
    rid = rankwatch().stop.rearm(_who(body), request.remote_addr, body.reason, force=body.force)
    return jsonify({"request_id": rid, "rearmed": True})


@bp.get("/api/audit")
def api_audit():
    """The newest audit rows, newest first; ``?limit=N`` (1 to 10000, default 200)."""
    limit = params.query(AuditRows).limit
    return jsonify({"rows": rankwatch().stop.audit.rows(limit=limit)})


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
