"""The edge: everything between the socket and a view, and nothing above it.

A request meets, from the outside in:

1. the server worker (``app.serve``): gunicorn's threaded worker behind a
   poller that reads heads and bodies without a thread, with per-address
   connection caps;
2. ``SecurityHeaders`` (``secheaders.py``): CSP and the other headers on
   every answer, errors included (``plotly_csp.py``: Plotly under that CSP);
3. ``HostGuard`` (``hostguard.py``): a Host this dashboard is not (DNS
   rebinding) reaches nothing;
4. ``SocketGuard`` (``sockguard.py``): malformed Engine.IO long-polling
   requests get a 400 before Flask-SocketIO sees them;
5. Flask: the bounded JSON provider and body checks (``auth.py``), the
   operator token and rate limits (``auth.py``, ``ratelimit.py``), and the
   sign-in routes (``routes.py``, ``login.py``).

``wrap`` applies 2 to 4, in that order, once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flask import Flask


def wrap(app: Flask) -> None:
    """Put the WSGI middleware around ``app`` (call after ``socketio.init_app``, which wraps it too)."""
    from app.edge.hostguard import HostAllowlist, HostGuard
    from app.edge.plotly_csp import style_attribute_hashes
    from app.edge.secheaders import SecurityHeaders, content_security_policy
    from app.edge.sockguard import SocketGuard

    app.wsgi_app = SocketGuard(app.wsgi_app)
    app.wsgi_app = HostGuard(app.wsgi_app, HostAllowlist(app.config["HOST"], app.config["ALLOWED_HOSTS"]))
    app.wsgi_app = SecurityHeaders(app.wsgi_app, content_security_policy(style_attribute_hashes()))
