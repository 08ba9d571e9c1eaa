"""The Ranks page's chart queries (``app.edge.params`` holds the machinery; ``window.py`` the rows')."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.config import LARGE_JOB_RANKS
from app.edge.params import MAX_QUERY_INT, PositiveInt, Query, at_most


class HistoryPoints(Query):
    points: Annotated[int | None, Field(gt=0, le=MAX_QUERY_INT, description="a positive integer")] = None


# The ranks one ``/api/history`` page holds: what one answer may cost, whatever job.json's
# world_size says (issue 32, P8); a page that is not windowed asks for the job in one page.
HISTORY_PER_PAGE_MAX = LARGE_JOB_RANKS


class HistoryPage(HistoryPoints):
    """``GET /api/history``'s ``?points=``, ``?page=`` and ``?per_page=``: paged as ``/api/ranks``."""

    page: PositiveInt = 1
    per_page: Annotated[PositiveInt, at_most(HISTORY_PER_PAGE_MAX)] = HISTORY_PER_PAGE_MAX


class RunHistoryQuery(Query):
    """``GET /api/history/run``'s ``?after=T&generation=G``: only what changed since an earlier answer."""

    after: Annotated[
        float | None, Field(ge=0, le=MAX_QUERY_INT, allow_inf_nan=False, description="a Unix time in seconds")
    ] = None
    generation: Annotated[int | None, Field(ge=0, le=MAX_QUERY_INT, description="a non-negative integer")] = (
        None
    )
