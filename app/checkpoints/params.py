"""The checkpoint browser's request bodies and queries (``app.edge.params`` holds the machinery)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from app.edge.params import Body, Query, RequiredText, Text


class DeleteSet(Body):
    set: RequiredText
    reason: RequiredText
    who: Text | None = None
    force: bool = False


class VerifySet(Body):
    set: RequiredText


class ApplyPlan(Body):
    hash: RequiredText
    who: Text | None = None


class PinSet(Body):
    set: RequiredText
    pinned: bool
    who: Text | None = None
    reason: Text | None = None


class SetId(Query):
    set: Annotated[str, Field(min_length=1, description="a checkpoint set's id")]


class FilePath(Query):
    path: Annotated[str, Field(min_length=1, description="a file's path relative to the run directory")]
