"""What every run-directory model shares: the bounds on its fields, the base model, and SchemaError."""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_bridge.rundir.runfiles import MAX_REQUEST_ID

# The largest job the dashboard will believe; a rank number or world size
# above it is a bad file, not a job (it bounds what one file can make the
# dashboard allocate per rank).
MAX_RANKS = 1 << 17
# Longest texts a heartbeat carries: an error line, a warning, a path.
MAX_ERROR = 4000
MAX_WARNING = 500
MAX_WARNINGS = 10
MAX_PATH = 4096
# Step times per heartbeat (the bridge's deque bound).
MAX_STEP_TIMES = 64

# Bounds shared by many fields. Times are Unix seconds, before year 3058.
UnixTime = Annotated[float, Field(ge=0, le=2**35)]
Millis = Annotated[float, Field(ge=0, le=1e9)]  # up to 11 days
Count = Annotated[int, Field(ge=0, le=2**53)]
Bytes = Annotated[int, Field(ge=0, le=2**60)]
Rank = Annotated[int, Field(ge=0, lt=MAX_RANKS)]
WorldSize = Annotated[int, Field(ge=1, le=MAX_RANKS)]
Pid = Annotated[int, Field(ge=1, le=1 << 22)]  # Linux's largest pid_max
Host = Annotated[str, Field(min_length=1, max_length=253)]
Path_ = Annotated[str, Field(max_length=MAX_PATH)]
RequestId = Annotated[str, Field(min_length=1, max_length=MAX_REQUEST_ID)]
LaunchId = Annotated[str, Field(pattern=r"^[A-Za-z0-9._:-]{1,64}$")]


class SchemaError(ValueError):
    """A run-directory file that does not match its schema; the message names the field.

    ``public`` is the same without any of the file's content (no value it
    held): what a page may show to viewers without the token, since the
    file may be a symlink's target or another user's data.
    """

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = public if public is not None else message


class _Model(BaseModel):
    # strict: no silent coercion of "3" or true into numbers; extra fields
    # ignored for forward compatibility; frozen so a validated object stays so.
    # A NaN or infinite loss is news (the run diverged), but JSON has no such
    # number: the heartbeat writes null plus ``loss_nonfinite`` (heartbeat.py).
    # Any other stray non-finite float is written as null, never as the
    # NaN/Infinity extension other readers (browsers, jq) refuse.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, ser_json_inf_nan="null")

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


M = TypeVar("M", bound=_Model)


def _explain(e: ValidationError) -> str:
    """``_error``'s message alone."""
    return _error(e).args[0]


def _error(e: ValidationError) -> SchemaError:
    """The first problem, in one line that names the field: 'pid: must be >= 1 (got -1)'.

    Its ``public`` leaves out the value: 'pid: must be >= 1'.
    """
    err = e.errors(include_url=False)[0]
    # Field names come from the schema, but a dict's keys come from the file.
    where = ".".join(str(p) if isinstance(p, int) or len(str(p)) <= 40 else "?" for p in err["loc"]) or "file"
    value = repr(err.get("input"))
    value = value if len(value) <= 40 else value[:37] + "..."
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    if err["type"] in ("json_invalid", "json_type"):
        return SchemaError(f"not valid JSON: {err['msg'].removeprefix('Invalid JSON: ')}", "not valid JSON")
    if err["type"] == "missing":
        return SchemaError(f"{where}: missing{more}")
    # Pydantic's messages name the expectation, never the input: only "got" shows content.
    return SchemaError(
        f"{where}: {err['msg'].lower()} (got {value}){more}", f"{where}: {err['msg'].lower()}{more}"
    )
