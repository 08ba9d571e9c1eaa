"""The domain's refusals, and the one handler that answers them.

Services raise a ``RankwatchError`` subclass named after what they refuse
(``StopRefused``, ``SetNotFound``, ...). Each class carries its HTTP status
as a class attribute, so the code that has no request (the CLI, the stop
policy) catches the domain error by name, never a status number, and the
one handler here answers ``{"error": str, "status": int}`` under ``/api/``
and at ``/metrics``, and an HTML page elsewhere. Flask's own HTTP errors
(404, 405, 413) get the same shape. Anything else that escapes a view is a
bug: it is logged with its traceback and answered as a 500 in that shape.
"""

from __future__ import annotations

import math
from typing import ClassVar

from flask import Flask, current_app, jsonify, render_template, request
from werkzeug.exceptions import HTTPException


class RankwatchError(Exception):
    """Something the dashboard refuses, with a sentence that says why. Raise a subclass.

    ``status`` is the HTTP status the edge answers with; the base's 500 says
    that raising the base itself is a bug. ``retry_after_s``, when set, is
    sent as ``Retry-After``.
    """

    status: ClassVar[int] = 500
    retry_after_s: float | None = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class BadRequest(RankwatchError):
    """A body, query parameter or path that is not what the route takes."""

    status = 400


class WrongToken(RankwatchError):
    """No operator token, a wrong one, or a login link that is used up."""

    status = 401


class Forbidden(RankwatchError):
    """A cross-site request, or a file the dashboard may not open."""

    status = 403


class NotFound(RankwatchError):
    """Something asked for by name that the run does not have."""

    status = 404


class RankNotFound(NotFound):
    def __init__(self, rank: int):
        super().__init__(f"rank {rank} is not part of this job")
        self.rank = rank


class RunNotFound(NotFound):
    """A run id this dashboard does not serve (``GET /api/runs`` lists them)."""


class SetNotFound(NotFound):
    def __init__(self, set_id: str):
        super().__init__(
            f"no checkpoint set {set_id!r} in the run directory (GET /api/checkpoints lists the sets' ids)"
        )
        self.set_id = set_id


NO_RUN_DIR = "the dashboard was started without a run directory (--run-dir)"


class NoRunDir(RankwatchError):
    """An action on the run directory of a dashboard started without one."""

    status = 409

    def __init__(self, message: str = NO_RUN_DIR):
        super().__init__(message)


class StopRefused(RankwatchError):
    """Cancel or re-arm with no stop pending, too late, or before the stop completed."""

    status = 409


class CheckpointRefused(RankwatchError):
    """A delete, retention run or pin that would lose a resume point or act on a stale plan."""

    status = 409


class FileElsewhere(RankwatchError):
    """A checkpoint file on another node's disk, listed by its agent: this dashboard cannot open or remove it."""

    status = 409


class SetBusy(RankwatchError):
    """A deep verify is running (of this set, or of another: one runs at a time)."""

    status = 409


class CaptureRefused(RankwatchError):
    """A stack capture that no route can take for this rank now (ended, unreachable, ...)."""

    status = 409


class NotJson(RankwatchError):
    """A state-changing request whose body is not ``application/json``."""

    status = 415


class Throttled(RankwatchError):
    """Too many wrong secrets or changes from a client: wait ``retry_after_s``."""

    status = 429

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Busy(RankwatchError):
    """A resource held by another request (the one large-answer slot): wait ``retry_after_s``."""

    status = 503

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(RankwatchError):
    """A store the answer needs cannot be read now (a corrupt or locked audit database)."""

    status = 503


class CannotWrite(RankwatchError):
    """A file the action must leave in the run directory cannot be written (a full disk, a symlink)."""

    status = 507


def error_response(status: int, message: str, headers: dict[str, str] | None = None):
    """The one error shape, as JSON for ``/api/`` and as a page for browsers."""
    # /metrics is read by Prometheus, not in a browser: it gets the JSON shape too.
    if request.path.startswith("/api/") or request.path == "/metrics":
        return jsonify({"error": message, "status": status}), status, headers or {}
    return render_template("error.html", status=status, message=message), status, headers or {}


def handle_exception(exc: Exception):
    if isinstance(exc, RankwatchError):
        # Whole seconds, at least 1: a client that retries at once would be refused again.
        wait = exc.retry_after_s
        headers = None if wait is None else {"Retry-After": str(max(1, math.ceil(wait)))}
        return error_response(exc.status, exc.message, headers)
    if isinstance(exc, HTTPException):
        return error_response(exc.code or 500, exc.description or exc.name)
    current_app.logger.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(500, "internal error (a bug: see the dashboard's log)")


def register(app: Flask) -> None:
    app.register_error_handler(Exception, handle_exception)
