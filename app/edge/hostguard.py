"""Refuse requests whose ``Host`` is not a name this dashboard is reached by (DNS rebinding).

A page on ``rebind.test`` whose name is made to resolve to 127.0.0.1 is
same-origin with itself, so the browser lets its scripts read whatever the
dashboard answers on the loopback port: every API, the checkpoints, the
Socket.IO stream. The only thing that tells such a request apart is its
``Host`` header, which names the attacker's domain. This WSGI middleware sits
in front of everything (Flask's routes and Engine.IO's) and answers 400 in
the one error shape unless the host, port aside, is allowed:

* ``localhost``, ``127.0.0.1`` and ``::1``;
* the address the dashboard is bound to (setting ``HOST``); when that is a
  wildcard (``0.0.0.0``, ``::``), this machine's host names and the
  addresses of its network interfaces, since clients reach it by any of
  them;
* the names in setting ``ALLOWED_HOSTS`` (comma-separated; ``*.example.com``
  allows its subdomains; ``*`` alone turns the check off, for a reverse
  proxy that checks ``Host`` itself).

A reverse proxy that passes the client's ``Host`` through needs its public
name in ``ALLOWED_HOSTS``.
"""

from __future__ import annotations

import json
import socket

import psutil

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARDS = ("", "0.0.0.0", "::", "*")


def host_name(header: str) -> str:
    """The host of a ``Host`` header: no port, no brackets, lower case, no trailing dot."""
    header = header.strip()
    if header.startswith("["):
        name = header[1 : header.find("]")] if "]" in header else header[1:]
    elif header.count(":") == 1:
        name = header.split(":", 1)[0]
    else:
        name = header
    return name.lower().rstrip(".")


def this_machine() -> set[str]:
    """This machine's host names and interface addresses: how clients reach a wildcard bind."""
    names = {socket.gethostname(), socket.getfqdn()}
    try:
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    names.add(a.address.split("%", 1)[0])
    except OSError:
        pass
    return {host_name(n) for n in names if n}


class HostAllowlist:
    def __init__(self, bound: str, extra: str):
        self.any = False
        self.names = set(LOOPBACK)
        self.suffixes: list[str] = []
        bound = host_name(bound or "")
        if bound in WILDCARDS:
            self.names |= this_machine()
        else:
            self.names.add(bound)
        for item in (part.strip() for part in extra.split(",")):
            if item == "*":
                self.any = True
            elif item.startswith("*."):
                self.suffixes.append(host_name(item[1:]))
            elif item:
                self.names.add(host_name(item))

    def allows(self, host: str) -> bool:
        return self.any or host in self.names or any(host.endswith(s) for s in self.suffixes)


class HostGuard:
    """WSGI middleware: 400 for a ``Host`` the allowlist does not name."""

    def __init__(self, wsgi_app, allowlist: HostAllowlist):
        self.wsgi_app = wsgi_app
        self.allowlist = allowlist

    def __call__(self, environ, start_response):
        host = host_name(environ.get("HTTP_HOST") or environ.get("SERVER_NAME") or "")
        if self.allowlist.allows(host):
            return self.wsgi_app(environ, start_response)
        message = f"host {host[:100]!r} is not one this dashboard serves (setting ALLOWED_HOSTS)"
        body = json.dumps({"error": message, "status": 400}).encode()
        start_response(
            "400 BAD REQUEST", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        )
        return [body]
