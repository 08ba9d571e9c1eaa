"""One error shape, one handler.

Views raise ``ApiError(status, message)`` (or let Flask raise its HTTP
errors); a single handler answers ``{"error": str, "status": int}`` under
``/api/`` and at ``/metrics``, and an HTML page elsewhere. Anything else that escapes a view is a
bug: it is logged with its traceback and answered as a 500 in the same shape.
"""

from __future__ import annotations

from flask import Flask, current_app, jsonify, render_template, request
from werkzeug.exceptions import HTTPException


class ApiError(Exception):
    """A request the dashboard refuses, with the HTTP status to answer."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def error_response(status: int, message: str, headers: dict[str, str] | None = None):
    """The one error shape, as JSON for ``/api/`` and as a page for browsers."""
    # /metrics is read by Prometheus, not in a browser: it gets the JSON shape too.
    if request.path.startswith("/api/") or request.path == "/metrics":
        return jsonify({"error": message, "status": status}), status, headers or {}
    return render_template("error.html", status=status, message=message), status, headers or {}


def handle_exception(exc: Exception):
    if isinstance(exc, ApiError):
        return error_response(exc.status, exc.message, exc.headers)
    if isinstance(exc, HTTPException):
        return error_response(exc.code or 500, exc.description or exc.name)
    current_app.logger.exception("unhandled error on %s %s", request.method, request.path)
    return error_response(500, "internal error (a bug: see the dashboard's log)")


def register(app: Flask) -> None:
    app.register_error_handler(Exception, handle_exception)
