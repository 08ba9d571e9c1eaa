"""The stop area's request bodies and queries (``app.edge.params`` holds the machinery)."""

from __future__ import annotations

from app.edge.params import Body, Limit, Query, RequiredText, Text


class StopRequest(Body):
    reason: RequiredText
    who: Text | None = None


class StopChange(Body):
    """Cancel: who and why, both optional."""

    reason: Text | None = None
    who: Text | None = None


class Rearm(StopChange):
    force: bool = False


class AuditRows(Query):
    limit: Limit = 200
