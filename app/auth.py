"""Who may change state, and how a state-changing request must look.

Reading needs nothing. Stop, cancel, re-arm and delete need the operator token
(setting ``TOKEN``, i.e. ``RANKWATCH_TOKEN``; generated and printed once at
start when unset) as ``Authorization: Bearer <token>``. The page keeps the
token in the tab's ``sessionStorage`` and sends that header itself, so no
cookie ever authorises a request: a cross-site form or script cannot ride on
the operator's session (CSRF). As a second guard, a request whose ``Origin``
or ``Sec-Fetch-Site`` says it came from another site is refused, and bodies
must be ``application/json``, which a cross-site form cannot send without a
CORS preflight that this app never grants.
"""
from __future__ import annotations

import hmac
import secrets
from typing import Any
from urllib.parse import urlsplit

from flask import current_app, request

from app.errors import ApiError

# Longest accepted free text (reason, operator name): an audit row, not an essay.
MAX_TEXT = 500


def ensure_token(config: dict) -> bool:
    """Fill ``config["TOKEN"]`` with a fresh one if unset; True if it was generated."""
    if config.get("TOKEN"):
        return False
    config["TOKEN"] = secrets.token_urlsafe(24)
    return True


def check_token(token: str | None) -> bool:
    expected = current_app.config["TOKEN"]
    return bool(token) and hmac.compare_digest(token.encode(), expected.encode())


def require_operator() -> None:
    """Refuse (403 or 401) unless this request is same-site and carries the token."""
    site = request.headers.get("Sec-Fetch-Site")
    if site not in (None, "same-origin", "none"):
        raise ApiError(403, f"cross-site request refused (Sec-Fetch-Site: {site})")
    origin = request.headers.get("Origin")
    if origin and urlsplit(origin).netloc != request.host:
        raise ApiError(403, f"cross-origin request refused (Origin: {origin})")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "operator token required: send 'Authorization: Bearer <token>' "
                            "(the token is RANKWATCH_TOKEN, or the one printed at start)")
    if not check_token(token.strip()):
        raise ApiError(401, "wrong operator token")


def json_body(fields: dict[str, tuple[type, bool]]) -> dict[str, Any]:
    """The request's JSON object, checked against ``{name: (type, required)}``.

    Unknown fields, wrong types, over-long text and non-JSON bodies are 4xx
    errors that name the problem; nothing is changed before this passes.
    """
    if not request.is_json:
        raise ApiError(415, "send a JSON body with 'Content-Type: application/json'")
    body = request.get_json(silent=True)
    if body is None and request.get_data():
        raise ApiError(400, "the body is not valid JSON")
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise ApiError(400, f"unknown field(s): {', '.join(unknown)}; "
                            f"expected {', '.join(fields) or 'none'}")
    out = {}
    for name, (kind, required) in fields.items():
        if name not in body or body[name] is None:
            if required:
                raise ApiError(400, f"field {name!r} is required")
            continue
        value = body[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ApiError(400, f"field {name!r} must be {kind.__name__}, not {type(value).__name__}")
        if isinstance(value, str):
            value = value.strip()
            if len(value) > MAX_TEXT:
                raise ApiError(400, f"field {name!r} is longer than {MAX_TEXT} characters")
            if required and not value:
                raise ApiError(400, f"field {name!r} must not be empty")
        out[name] = value
    return out
