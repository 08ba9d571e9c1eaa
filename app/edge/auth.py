"""Who may change state, and how a state-changing request must look.

Reading needs nothing. Stop, cancel, re-arm and delete need the operator token
(setting ``TOKEN``, i.e. ``RANKWATCH_TOKEN``; generated at start when unset,
and handed to the page through a single-use login link, ``app.edge.login``) as
``Authorization: Bearer <token>``. Every token check backs off after wrong
guesses (failures only: the right token is never refused), and each client's
changes are rate-limited (``app.edge.ratelimit``). The page keeps the
token in the tab's ``sessionStorage`` and sends that header itself, so no
cookie ever authorises a request: a cross-site form or script cannot ride on
the operator's session (CSRF). As a second guard, a request whose ``Origin``
or ``Sec-Fetch-Site`` says it came from another site is refused, and bodies
must be ``application/json``, which a cross-site form cannot send without a
CORS preflight that this app never grants.
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from flask import current_app, request
from flask.json.provider import DefaultJSONProvider

from app.edge.ratelimit import Backoff, Bucket
from app.errors import BadRequest, Forbidden, NotJson, Throttled, WrongToken

log = logging.getLogger(__name__)

# Longest accepted free text (reason, operator name): an audit row, not an essay.
MAX_TEXT = 500


@dataclass
class Limits:
    """The app's rate limits (``app.extensions["rankwatch_limits"]``)."""

    backoff: Backoff
    writes: Bucket
    # Told when the failures of the last minute reach AUTH_FAILURES_PER_MIN
    # (text): the app sends it as an alert (app/__init__.py).
    on_flood: Callable[[str], None] = field(default=lambda text: None)

    @classmethod
    def from_config(cls, config) -> Limits:
        return cls(
            backoff=Backoff(global_per_min=config["AUTH_FAILURES_PER_MIN"]),
            writes=Bucket(config["OPERATOR_WRITES_PER_MIN"]),
        )


def ensure_token(config: dict) -> bool:
    """Fill ``config["TOKEN"]`` with a fresh one if unset; True if it was generated."""
    if config.get("TOKEN"):
        return False
    config["TOKEN"] = secrets.token_urlsafe(24)
    return True


# A token shorter than this, or with less entropy (bits, judged from how
# often each character repeats), is easy to guess: warned about at start.
MIN_TOKEN_LENGTH = 16
MIN_TOKEN_BITS = 60


def token_weakness(token: str) -> str | None:
    """Why ``token`` is weak, or None. Never repeats the token itself (it goes to a log)."""
    if len(token) < MIN_TOKEN_LENGTH:
        return f"{len(token)} characters, fewer than {MIN_TOKEN_LENGTH}"
    counts = Counter(token)
    bits = -sum(n * math.log2(n / len(token)) for n in counts.values())
    if bits < MIN_TOKEN_BITS:
        return f"about {bits:.0f} bits of entropy, fewer than {MIN_TOKEN_BITS}: too few distinct characters"
    return None


def check_token(token: str | None) -> bool:
    """Whether ``token`` is the operator token; a wrong one gets a 429 while failures must back off.

    Every check goes through here (``/api/session`` and every Bearer
    header). The token is checked first: the right one is never refused,
    whoever else guessed wrong from the same address or any other.
    """
    expected = current_app.config["TOKEN"]
    ok = bool(token) and hmac.compare_digest(token.encode(), expected.encode())
    settle(ok, "operator tokens")
    return ok


def settle(ok: bool, what: str) -> None:
    """Record a secret's check (``what``: "operator tokens", "login codes"); 429 for a failure that must wait.

    A failure from an address that backs off, or past AUTH_FAILURES_PER_MIN
    in all, is answered 429; the one that reaches that allowance is logged
    and alerted, once per flood.
    """
    limits = current_app.extensions["rankwatch_limits"]
    key = request.remote_addr or "?"
    if ok:
        limits.backoff.succeeded(key)
        return
    wait = limits.backoff.wait_s(key)
    if wait > 0:
        raise Throttled(
            f"too many wrong {what} (from {key} or in all): try again in {max(1, round(wait))} s", wait
        )
    if limits.backoff.failed(key):
        text = (
            f"{limits.backoff.global_per_min} wrong operator tokens or login codes in the last minute "
            f"(AUTH_FAILURES_PER_MIN), the last from {key}: someone may be guessing; further wrong "
            "guesses get 429 (the right token still works)"
        )
        log.warning("rankwatch: %s", text)
        limits.on_flood(text)


def over_write_budget() -> float:
    """Spend one of this client's operator writes (``OPERATOR_WRITES_PER_MIN``).

    0 if it had one left, else the seconds until it will.
    """
    return current_app.extensions["rankwatch_limits"].writes.take(request.remote_addr or "?")


def count_write() -> None:
    """``over_write_budget``, with a 429 when none is left."""
    key = request.remote_addr or "?"
    wait = over_write_budget()
    if wait > 0:
        raise Throttled(
            f"too many changes from {key} in a short time: try again in {max(1, round(wait))} s", wait
        )


def require_operator(count: bool = True) -> None:
    """Refuse (403 or 401) unless this request is same-site and carries the token.

    ``count``: spend one of the client's writes, 429 when none is left. The
    stop request does its own accounting: a stop is never refused for it.
    """
    site = request.headers.get("Sec-Fetch-Site")
    if site not in (None, "same-origin", "none"):
        raise Forbidden(f"cross-site request refused (Sec-Fetch-Site: {site})")
    origin = request.headers.get("Origin")
    if origin and urlsplit(origin).netloc != request.host:
        raise Forbidden(f"cross-origin request refused (Origin: {origin})")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise WrongToken(
            "operator token required: send 'Authorization: Bearer <token>' "
            "(RANKWATCH_TOKEN, or open the login link the dashboard printed; rankwatch login prints a new one)",
        )
    if not check_token(token.strip()):
        raise WrongToken("wrong operator token")
    if count:
        count_write()


class BoundedJSONProvider(DefaultJSONProvider):
    """Flask's JSON, except that absurd nesting is invalid JSON (a 400), not a RecursionError (a 500).

    ``[`` x 1000 in a body overflowed the decoder's recursion limit, which
    Flask does not treat as a decoding error.
    """

    def loads(self, s, **kwargs):
        try:
            return super().loads(s, **kwargs)
        except RecursionError:
            raise ValueError("nested too deeply") from None


def json_body(fields: dict[str, tuple[type, bool]]) -> dict[str, Any]:
    """The request's JSON object, checked against ``{name: (type, required)}``.

    Unknown fields, wrong types, over-long text and non-JSON bodies are 4xx
    errors that name the problem; nothing is changed before this passes.
    """
    if not request.is_json:
        raise NotJson("send a JSON body with 'Content-Type: application/json'")
    data = request.get_data()
    try:
        body = current_app.json.loads(data) if data else None
    except ValueError as e:  # UnicodeDecodeError is one too
        raise BadRequest(f"the body is not valid JSON: {str(e)[:200]}") from None
    body = {} if body is None else body
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, not {type(body).__name__}")
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise BadRequest(f"unknown field(s): {', '.join(unknown)}; expected {', '.join(fields) or 'none'}")
    out = {}
    for name, (kind, required) in fields.items():
        if name not in body or body[name] is None:
            if required:
                raise BadRequest(f"field {name!r} is required")
            continue
        value = body[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise BadRequest(f"field {name!r} must be {kind.__name__}, not {type(value).__name__}")
        if isinstance(value, str):
            value = value.strip()
            if len(value) > MAX_TEXT:
                raise BadRequest(f"field {name!r} is longer than {MAX_TEXT} characters")
            if required and not value:
                raise BadRequest(f"field {name!r} must not be empty")
        out[name] = value
    return out
