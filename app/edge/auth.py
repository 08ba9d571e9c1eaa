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
must be ``application/json`` (``app.edge.params``), which a cross-site form
cannot send without a CORS preflight that this app never grants.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import os
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from flask import current_app, request

from app.edge.login import LOGIN_COMMAND
from app.edge.ratelimit import Backoff, Bucket
from app.errors import Forbidden, Throttled, WrongToken

log = logging.getLogger(__name__)


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
            f"(RANKWATCH_TOKEN, or open the login link the dashboard printed; {LOGIN_COMMAND} prints a new one)",
        )
    if not check_token(token.strip()):
        raise WrongToken("wrong operator token")
    if count:
        count_write()


def has_token() -> bool:
    """Whether this request carries the operator token (a read that shows more to the operator).

    A wrong token counts as a wrong guess (``check_token``): a read route is no way around the backoff.
    """
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and bool(token.strip()) and check_token(token.strip())


def for_viewer(body, run_dir, run_id: str | None = None):
    """``body`` as this request's client sees it: ``redact_run_dir``'s, unless it carries the token."""
    if has_token() or not run_dir:
        return body
    return redact_run_dir(body, run_dir, run_id)


def redact_run_dir(body, run_dir, run_id: str | None = None):
    """``body`` as a viewer without the token sees it: the run directory's absolute path (its real
    path, the path it was found at, the path given) replaced in every string by the run's id under
    ``--runs`` (``run_id``), else by the directory's name (issue 32, P11).

    The one redaction of the HTTP answers (``for_viewer``) and of the pushes to the viewers' rooms
    (``app/push.py``); ``body`` itself (the same object) when it names no such path.
    """
    if not run_dir:
        return body
    # A run under --runs is held by its descriptor (app/runs/pinned.py): its name is the one found.
    logical = getattr(run_dir, "logical", run_dir)
    name = run_id or os.path.basename(os.path.normpath(logical))
    paths = dict.fromkeys(p for p in (os.path.realpath(run_dir), str(logical), str(run_dir)) if p)
    return _redact(body, tuple(paths), name)


def redact_paths(value, run_dir: str | None, name: str):
    """``value`` with the run directory's absolute path replaced by ``name`` in every string.

    For viewers without the token (issue 32, P11): where the run lives on disk (a user's home,
    a project's name) is the operator's to know. What holds no such path comes back as the same
    object, so a push that names none is sent once to every room (``app/push.py``).
    """
    return _redact(value, (run_dir,), name) if run_dir else value


def _redact(value, paths: tuple[str, ...], name: str):
    if isinstance(value, str):
        for path in paths:
            if path in value:
                value = value.replace(path, name)
        return value
    if isinstance(value, dict):
        out = {k: _redact(v, paths, name) for k, v in value.items()}
        return value if all(out[k] is v for k, v in value.items()) else out
    if not isinstance(value, list | tuple):
        return value
    try:
        # A snapshot's 4,096 rows name no path (its run status does): the C encoder tells a list
        # that holds none far faster than a walk of every string (the path as JSON writes it).
        text = json.dumps(value)
        if not any(json.dumps(path)[1:-1] in text for path in paths):
            return value
    except (TypeError, ValueError):
        pass  # not JSON: walk it all
    items = [_redact(v, paths, name) for v in value]
    return value if all(a is b for a, b in zip(items, value, strict=True)) else items
