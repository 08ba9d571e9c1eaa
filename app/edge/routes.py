"""Signing in: check a typed token, trade a login link's code for it, mint a code.

The page keeps the token in ``sessionStorage``; the link printed by
``rankwatch login`` carries a single-use code instead (``app.edge.login``).
"""

from __future__ import annotations

from flask import Blueprint, current_app, jsonify, request

from app.edge import params
from app.edge.auth import check_token, require_operator, settle
from app.edge.login import LOGIN_COMMAND, login_url
from app.errors import WrongToken

bp = Blueprint("edge", __name__)


@bp.post("/api/session")
def api_session():
    """Check a token typed into the page; the page keeps it in sessionStorage."""
    body = params.body(params.SessionCheck)
    if not check_token(body.token):
        raise WrongToken("wrong operator token")
    return jsonify({"ok": True})


@bp.post("/api/login")
def api_login():
    """Trade a single-use login code (from the ``#login=`` URL) for the token, once."""
    body = params.body(params.LoginRedeem)
    # Redeemed first: a live code works whatever others guessed (app.edge.auth.settle).
    ok = current_app.extensions["rankwatch_login"].redeem(body.code)
    settle(ok, "login codes")
    if not ok:
        raise WrongToken(
            "this login link is used up or expired: open a new one "
            f"({LOGIN_COMMAND} prints it), or enter the token",
        )
    response = jsonify({"token": current_app.config["TOKEN"]})
    # The token must not stay in a browser's or a proxy's cache (issue 32, P11).
    response.headers["Cache-Control"] = "no-store"
    return response


@bp.post("/api/login-code")
def api_login_code():
    """A new single-use login code, for someone who has the token (``rankwatch login``)."""
    require_operator()
    params.body(params.NoFields)
    code, expires = current_app.extensions["rankwatch_login"].mint()
    response = jsonify({"code": code, "expires_at": expires, "login_url": login_url(request.host_url, code)})
    response.headers["Cache-Control"] = "no-store"  # a live login code is as good as the token
    return response, 201
