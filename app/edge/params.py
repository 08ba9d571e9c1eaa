"""What a request may carry: each JSON body and each route's query parameters as a pydantic model.

A view calls ``body(Model)`` or ``query(Model)`` first; nothing is changed
before they pass. A body must be ``application/json`` (415 otherwise: a
cross-site form cannot send it without a CORS preflight this app never
grants) and a JSON object whose fields are exactly the model's, each of its
type (strictly: ``1`` is not a bool, ``"3"`` is not a number), text
stripped and at most ``MAX_TEXT`` characters. A ``null`` field is an absent
one, and an empty body is ``{}``. Every refusal is a ``BadRequest`` (400)
that names the field, in the sentences clients and tests know ("field
'reason' is required").

Nesting: pydantic's JSON parser gives up past a depth of 200 (a
``json_invalid`` error, "recursion limit exceeded"), so a body of
``[`` x 100,000 is a 400 "nested too deeply" without ever recursing in
Python. That is why the app needs no bounded ``json.loads`` of its own:
no route parses a request body any other way (``request.get_json`` is not
used, and Socket.IO uses its own parser behind ``app.edge.sockguard``).

Query parameters arrive as text: integers are parsed by pydantic's lax
rules (ASCII digits; surrounding spaces, ``1_000`` and ``5.0`` pass) and
bounded before any arithmetic, so ``"9" * 5000`` or ``"²"`` is a 400, not a
500; unknown parameters are ignored, and a refusal reads
"query parameter 'page' must be a positive integer, not '0'". Each field's
``description`` is that "must be ..." phrase. ``/api/ranks``'s model lives
with its route (``app.ranks.routes``), built from ``PositiveInt``,
``at_most`` and ``some_of``: its choices are the ranks area's verdicts, and
the edge imports no area.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal, TypeVar

from flask import request
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.audit import MAX_TEXT
from app.config import LARGE_JOB_RANKS
from app.errors import BadRequest, NotJson
from trainer_bridge.rundir import stackfiles

# A query integer past this is refused as not one (no page, limit or point count comes near).
MAX_QUERY_INT = 2**53

B = TypeVar("B", bound="Body")
Q = TypeVar("Q", bound="Query")


def _sentence(text: str) -> PydanticCustomError:
    """A refusal whose whole sentence is ``text`` (a custom error's template would format braces)."""
    return PydanticCustomError("rankwatch", "{text}", {"text": text})


# ---------------------------------------------------------------- bodies

Text = Annotated[str, StringConstraints(strip_whitespace=True, max_length=MAX_TEXT)]
RequiredText = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=MAX_TEXT)]


class Body(BaseModel):
    """A JSON body: these fields and no others, each strictly of its type."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Kept for unknown keys, which are refused whatever their value.
        if data is None:
            return {}
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class NoFields(Body):
    """``POST /api/login-code``: nothing (an empty body or ``{}``)."""


class SessionCheck(Body):
    token: RequiredText


class LoginRedeem(Body):
    code: RequiredText


class StopRequest(Body):
    reason: RequiredText
    who: Text | None = None


class StopChange(Body):
    """Cancel: who and why, both optional."""

    reason: Text | None = None
    who: Text | None = None


class Rearm(StopChange):
    force: bool = False


class StackRequest(Body):
    native: bool = False
    who: Text | None = None


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


_KINDS = {"string_type": "str", "bool_type": "bool", "int_type": "int"}


def _body_problem(model: type[Body], e: ValidationError) -> str:
    """The one sentence a refused body gets: the JSON, then its shape, unknown fields, then the first bad field."""
    errors = e.errors(include_url=False)
    for err in errors:
        if err["type"] == "json_invalid":
            why = err["ctx"]["error"]
            return "the body is not valid JSON: " + (
                "nested too deeply" if why.startswith("recursion limit") else why[:200]
            )
        if not err["loc"]:
            return f"the body must be a JSON object, not {type(err['input']).__name__}"
    unknown = sorted(str(err["loc"][0]) for err in errors if err["type"] == "extra_forbidden")
    if unknown:
        return f"unknown field(s): {', '.join(unknown)}; expected {', '.join(model.model_fields) or 'none'}"
    order = list(model.model_fields)
    err = min(errors, key=lambda err: order.index(err["loc"][0]) if err["loc"][0] in order else len(order))
    name, kind, value = err["loc"][0], err["type"], err["input"]
    if kind == "missing":
        return f"field {name!r} is required"
    if kind == "string_too_short":
        return f"field {name!r} must not be empty"
    if kind == "string_too_long":
        return f"field {name!r} is longer than {err['ctx']['max_length']} characters"
    if kind in _KINDS:
        return f"field {name!r} must be {_KINDS[kind]}, not {type(value).__name__}"
    return f"field {name!r}: {err['msg']}"


def body(model: type[B]) -> B:
    """This request's JSON body as ``model``; 415 unless it is JSON, 400 naming the problem otherwise.

    A body over ``MAX_BODY_BYTES`` is Flask's 413 before any of it is parsed.
    """
    if not request.is_json:
        raise NotJson("send a JSON body with 'Content-Type: application/json'")
    try:
        return model.model_validate_json(request.get_data() or b"{}")
    except ValidationError as e:
        raise BadRequest(_body_problem(model, e)) from None


# ---------------------------------------------------------------- query parameters


def at_most(most: int) -> AfterValidator:
    """An upper bound with its own sentence: the operator may hit it, so say the bound."""

    def check(value: int, info: ValidationInfo) -> int:
        if value > most:
            raise _sentence(f"query parameter {info.field_name!r} may be at most {most}, not {value}")
        return value

    return AfterValidator(check)


def some_of(choices: Sequence[str], noun: str) -> Any:
    """A comma-separated list of some of ``choices`` (``?health=dead,stalled``), empty items dropped.

    For a route whose choices belong to its area (the verdicts), so that
    this module imports no area.
    """

    def split(raw: Any) -> Any:
        return tuple(v for v in raw.split(",") if v) if isinstance(raw, str) else raw

    def check(names: tuple[str, ...]) -> tuple[str, ...]:
        unknown = sorted(set(names) - set(choices))
        if unknown:
            raise _sentence(f"unknown {noun} {', '.join(unknown)}; expected some of {', '.join(choices)}")
        return names

    return Annotated[tuple[str, ...], BeforeValidator(split), AfterValidator(check)]


PositiveInt = Annotated[int, Field(gt=0, le=MAX_QUERY_INT, description="a positive integer")]
Limit = Annotated[int, Field(ge=1, le=10000, description="an integer from 1 to 10000")]


class Query(BaseModel):
    """A route's query parameters (the first value of each); others are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)


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


class MetricsScope(Query):
    per_rank: Annotated[Literal["0", "1"] | None, Field(description="0 or 1")] = None


class AuditRows(Query):
    limit: Limit = 200


class AlertRows(Query):
    limit: Limit = 100


class SetId(Query):
    set: Annotated[str, Field(min_length=1, description="a checkpoint set's id")]


class FilePath(Query):
    path: Annotated[str, Field(min_length=1, description="a file's path relative to the run directory")]


class StackTrigger(Query):
    trigger: Annotated[
        Literal[stackfiles.TRIGGERS] | None, Field(description=f"one of {', '.join(stackfiles.TRIGGERS)}")
    ] = None


class StacksAnswered(Query):
    request: Annotated[
        str | None, Field(min_length=1, max_length=128, description="a request id (1 to 128 characters)")
    ] = None


def _echo(raw: object) -> str:
    """A refused value as the answer quotes it, cut to be readable (a query may be kilobytes).

    Not always text: a Socket.IO event's payload is validated by the same models (``app/ranks/window.py``).
    """
    raw = "" if raw is None else raw if isinstance(raw, str) else str(raw)
    return repr(raw if len(raw) <= 60 else raw[:57] + "...")


def _query_problem(model: type[Query], e: ValidationError, args: dict[str, str]) -> str:
    err = e.errors(include_url=False)[0]
    name = str(err["loc"][0])
    if err["type"] == "rankwatch":
        return err["msg"]
    field = model.model_fields[name]
    if err["type"] == "missing" or (field.is_required() and args.get(name) == ""):
        return f"query parameter {name!r} is required"
    return f"query parameter {name!r} must be {field.description}, not {_echo(args.get(name))}"


def validate(model: type[Q], args: dict[str, str]) -> Q:
    """``args`` (strings, as in a query string) as ``model``; ``BadRequest`` naming the first bad one.

    The routes call it through ``query``; a CLI that takes the same options calls it directly.
    """
    try:
        return model.model_validate(args)
    except ValidationError as e:
        raise BadRequest(_query_problem(model, e, args)) from None


def query(model: type[Q]) -> Q:
    """This request's query parameters as ``model``; a 400 naming the first bad one."""
    return validate(model, request.args.to_dict())
