"""The stop API (README, "JSON API"): request, follow, cancel, re-arm, audit.

Every state change needs the operator token (``app.auth``) and a JSON body
that passes ``json_body``; checks happen before anything is written.
"""
from __future__ import annotations

import time

from flask import Response, current_app, jsonify, request

from app import rankwatch
from app.auth import check_token, json_body, require_operator
from app.errors import ApiError
from app.stop import bp

WHO_DEFAULT = "operator"


def _live():
    """(heartbeats by rank, world size), read from the files now.

    Not the watcher's view, which may be a tick old: cancel and re-arm decide
    on where the ranks are, and a rank may have agreed a moment ago.
    """
    if not current_app.config["RUN_DIR"]:
        raise ApiError(409, "the dashboard was started without a run directory (--run-dir)")
    state = rankwatch().state
    state.scan(time.time())
    return state.heartbeats()


def _who(body: dict) -> str:
    return body.get("who") or WHO_DEFAULT


@bp.post("/api/session")
def api_session():
    """Check a token typed into the page; the page keeps it in sessionStorage."""
    body = json_body({"token": (str, True)})
    if not check_token(body["token"]):
        raise ApiError(401, "wrong operator token")
    return jsonify({"ok": True})


@bp.get("/api/exit")
def api_exit_status():
    ranks, world = _live()
    stop = rankwatch().stop
    return jsonify(stop.status(ranks, world, time.time()) | {"estimate": stop.estimate(ranks, world)})


@bp.post("/api/exit")
def api_exit_request():
    require_operator()
    body = json_body({"reason": (str, True), "who": (str, False)})
    _live()
    rid, created = rankwatch().stop.request(body["reason"], _who(body), request.remote_addr)
    return jsonify({"request_id": rid, "created": created}), 202


@bp.post("/api/exit/cancel")
def api_exit_cancel():
    require_operator()
    body = json_body({"reason": (str, False), "who": (str, False)})
    ranks, _ = _live()
    rid = rankwatch().stop.cancel(ranks, _who(body), request.remote_addr, body.get("reason"))
    return jsonify({"request_id": rid, "cancelled": True})


@bp.post("/api/exit/rearm")
def api_exit_rearm():
    require_operator()
    body = json_body({"reason": (str, False), "who": (str, False), "force": (bool, False)})
    ranks, world = _live()
    rid = rankwatch().stop.rearm(ranks, world, _who(body), request.remote_addr, body.get("reason"),
                                 force=body.get("force", False))
    return jsonify({"request_id": rid, "rearmed": True})


@bp.get("/api/audit")
def api_audit():
    raw = request.args.get("limit", "200")
    # isascii: str.isdigit() also accepts "²", which int() refuses (a 500).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 5 or not 0 < int(raw) <= 10000:
        raise ApiError(400, f"query parameter 'limit' must be an integer from 1 to 10000, not {raw!r}")
    return jsonify({"rows": rankwatch().stop.audit.rows(limit=int(raw))})


@bp.get("/api/audit.csv")
def api_audit_csv():
    return Response(rankwatch().stop.audit.to_csv(), mimetype="text/csv",
                    headers={"Content-Disposition": "attachment; filename=rankwatch-audit.csv"})
