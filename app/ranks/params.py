"""The Ranks page's chart queries (``app.edge.params`` holds the machinery; ``window.py`` the rows')."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.edge.params import MAX_QUERY_INT, Query


class HistoryPoints(Query):
    points: Annotated[int | None, Field(gt=0, le=MAX_QUERY_INT, description="a positive integer")] = None


class RunHistoryQuery(Query):
    """``GET /api/history/run``'s ``?after=T&generation=G``: only what changed since an earlier answer."""

    after: Annotated[
        float | None, Field(ge=0, le=MAX_QUERY_INT, allow_inf_nan=False, description="a Unix time in seconds")
    ] = None
    generation: Annotated[int | None, Field(ge=0, le=MAX_QUERY_INT, description="a non-negative integer")] = (
        None
    )
