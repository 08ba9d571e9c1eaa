"""The incidents area's request bodies and queries (``app.edge.params`` holds the machinery)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from app.edge.params import Body, Limit, Query, Text
from trainer_bridge.rundir import stackfiles


class StackRequest(Body):
    native: bool = False
    who: Text | None = None


class StackTrigger(Query):
    trigger: Annotated[
        Literal[stackfiles.TRIGGERS] | None, Field(description=f"one of {', '.join(stackfiles.TRIGGERS)}")
    ] = None


class StacksAnswered(Query):
    request: Annotated[
        str | None, Field(min_length=1, max_length=128, description="a request id (1 to 128 characters)")
    ] = None


class AlertRows(Query):
    limit: Limit = 100
