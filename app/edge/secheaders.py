"""Security headers on every response, Flask's and Engine.IO's alike.

* ``Content-Security-Policy``: scripts, styles, images, fonts and
  connections only from this origin (Socket.IO's WebSocket included), no
  plugins, no ``<base>``, forms only to this origin, and never inside a frame
  (``frame-ancestors 'none'``). The pages carry no inline script and no
  inline event handler: their settings travel in a ``<script
  type="application/json">`` block, which is data, not code. Styles come
  from this origin too: Plotly's own CSS, which it would add as inline
  ``<style>`` elements, is served as a stylesheet instead
  (``app/edge/plotly_csp.py``), and ``style`` attributes written as text
  are allowed only for the two exact values Plotly writes (their hashes,
  ``'unsafe-hashes'``): an empty one, and its heat map's image-rendering.
* ``X-Frame-Options: DENY`` for browsers that predate ``frame-ancestors``.
* ``X-Content-Type-Options: nosniff``: a downloaded checkpoint, or a JSON
  answer, is never run as a script or a page.
* ``Referrer-Policy: no-referrer``: the page's URL (which may carry a login
  code) is never sent to another site.

A WSGI middleware rather than ``after_request``, so that Engine.IO's answers
and the host guard's refusals get them too. A response that set one of them
itself keeps its own.
"""

from __future__ import annotations


def content_security_policy(style_attribute_hashes: tuple[str, ...] = ()) -> str:
    """The policy; ``style_attribute_hashes`` are the exact ``style="..."`` values allowed."""
    attrs = " ".join(["'unsafe-hashes'", *(f"'{h}'" for h in style_attribute_hashes)])
    return "; ".join(
        [
            "default-src 'self'",
            "script-src 'self'",
            "style-src 'self'",
            f"style-src-attr {attrs}" if style_attribute_hashes else "style-src-attr 'none'",
            "img-src 'self' data:",
            "font-src 'self'",
            "connect-src 'self'",
            "object-src 'none'",
            "base-uri 'none'",
            "form-action 'self'",
            "frame-ancestors 'none'",
        ]
    )


OTHER_HEADERS = (
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
)


class SecurityHeaders:
    """WSGI middleware: add the policy and ``OTHER_HEADERS`` to every response that lacks them."""

    def __init__(self, wsgi_app, csp: str):
        self.wsgi_app = wsgi_app
        self.headers = (("Content-Security-Policy", csp), *OTHER_HEADERS)

    def __call__(self, environ, start_response):
        def start(status, headers, exc_info=None):
            have = {name.lower() for name, _ in headers}
            headers = list(headers) + [(k, v) for k, v in self.headers if k.lower() not in have]
            return start_response(status, headers, exc_info)

        return self.wsgi_app(environ, start)
