"""The run directory's files as types: one definition for the writers and the readers.

The bridge builds a ``Heartbeat`` (with its ``StopRecord``, ``Device``, ...)
and writes ``to_json()``; the dashboard, the log reader and the test helpers
build rows from the same classes, and everything the dashboard reads from
the run directory is validated against them first. The README's schema
tables are generated from the field descriptions here
(``python -m trainer_bridge.rundir.schema``), and a docs test keeps them equal.

Why validate what our own bridge wrote: the run directory is shared. Any
rank (a buggy one, a hostile one, another user's tool) can leave any bytes
in it, and the dashboard must still serve every route and, above all, still
stop the job. So a file is read only up to ``MAX_FILE_BYTES``, parsed by
pydantic's JSON parser (which refuses nesting deeper than a few hundred
levels instead of overflowing the stack), and every field is checked for
type (strictly: ``true`` is not an int, ``"3"`` is not a number) and bounds
(a 401-digit number, ``pid: -1``, a world size of a million all fail here,
with a message that names the field). Unknown fields are ignored, so an
older dashboard reads a newer bridge's heartbeats.

Pydantic is the one dependency the trainer side adds; its ``BaseModel``
gives the strict parser, the bounds and the field documentation the README
is generated from, and its Rust core validates a heartbeat in tens of
microseconds, which matters at thousands of ranks.
"""

from __future__ import annotations

import json
import os
import re
import sys
import types
import typing
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer_bridge.rundir.runfiles import (
    HEARTBEAT_SCHEMA,
    MAX_FILE_BYTES,
    MAX_REQUEST_ID,
    STATES,
    STOP_STAGES,
    FileTooLarge,
    read_capped,
)

__all__ = [
    "BridgeCost",
    "CheckpointRef",
    "Device",
    "Heartbeat",
    "HistoryLine",
    "Job",
    "MAX_RANKS",
    "ResumedFrom",
    "RetentionFile",
    "SchemaError",
    "build",
    "StopRecord",
    "load",
    "parse",
]

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
    # A NaN or infinite loss is news (the run diverged): written as JSON's
    # NaN/Infinity extension, which Python's json and pydantic read back.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True, ser_json_inf_nan="constants")

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


class Device(_Model):
    """The rank's accelerator, from ``npu-smi`` or ``nvidia-smi``."""

    kind: Literal["npu", "gpu"] = Field(description="`npu` or `gpu`")
    index: Annotated[int, Field(ge=0, le=4095)] = Field(description="device index on the host")
    util_percent: Annotated[float, Field(ge=0, le=100)] | None = Field(None, description="utilisation")
    mem_used_bytes: Bytes | None = Field(None, description="device memory in use")
    mem_total_bytes: Bytes | None = Field(None, description="device memory in all")
    temp_c: Annotated[float, Field(ge=-100, le=300)] | None = Field(None, description="temperature")
    health: Annotated[str, Field(max_length=64)] | None = Field(
        None, description="`npu-smi`'s health word (`OK`, `Warning`, `Alarm`, `Critical`); null on GPUs"
    )


class BridgeCost(_Model):
    """What the bridge has cost this rank so far."""

    agreements: Count = Field(0, description="stop agreements made")
    agree_ms: Millis = Field(0.0, description="their total time, after the first")
    first_agree_ms: Millis | None = Field(
        None, description="the first agreement, which compiles the AllReduce graph"
    )
    reporter_cpu_ms: Millis = Field(0.0, description="the background thread's CPU time")


class CheckpointRef(_Model):
    """A checkpoint the rank saved for a stop."""

    path: Path_ = Field(description="relative to the run directory")
    bytes: Bytes = Field(description="file size")
    seconds: Annotated[float, Field(ge=0, le=1e7)] = Field(description="time the save took")


class StopRecord(_Model):
    """A rank's part in a graceful stop (heartbeat field ``stop``)."""

    request_id: RequestId | None = Field(None, description="the flag's `request_id` (null: a bare flag)")
    source: Literal["flag", "sigterm"] = Field("flag", description="what asked: the flag file or SIGTERM")
    stage: Literal[STOP_STAGES] = Field(description=" → ".join(STOP_STAGES))
    seen_step: Count | None = Field(
        None,
        description="global step at which this rank saw the request; null if it learnt of it by agreement",
    )
    stop_step: Count | None = Field(None, description="the agreed global step every rank stops after")
    checkpoint: CheckpointRef | None = Field(None, description="`{path, bytes, seconds}` once saved")
    at: dict[Literal[STOP_STAGES], UnixTime] = Field(
        default_factory=dict, description="when this rank reached each stage (Unix seconds)"
    )
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(
        None, description="why the save failed, if it did"
    )


class ResumedFrom(_Model):
    """The checkpoint set the rank resumed from."""

    global_step: Count = Field(description="the set's global step")
    epoch: Count | None = Field(None, description="its epoch")
    path: Path_ = Field(description="this rank's file, relative to the run directory")


class Heartbeat(_Model):
    """``RUN/rankwatch/rank_{r}.json``, rewritten by each rank about once a second."""

    schema_: Literal[HEARTBEAT_SCHEMA] = Field(
        HEARTBEAT_SCHEMA, alias="schema", description=f"`{HEARTBEAT_SCHEMA}`"
    )
    rank: Rank = Field(description="global rank, from `mindspore.communication`")
    world_size: WorldSize = Field(1, description="ranks in the job")
    host: Host | None = Field(None, description="host name the rank runs on")
    pid: Pid | None = Field(None, description="process id on that host")
    state: Literal[STATES] = Field("training", description=", ".join(f"`{s}`" for s in STATES))
    epoch: Count = Field(0, description="current epoch, 1-based")
    step: Count = Field(0, description="step within the epoch, 1-based")
    global_step: Count | None = Field(
        0,
        description="steps since the job began (continues across resume); the bridge always knows it, "
        "a row read from a worker log has null until the log tells",
    )
    loss: Annotated[float, Field(allow_inf_nan=True)] | None = Field(None, description="last loss")
    step_time_ms: Millis | None = Field(None, description="the last step's wall time")
    step_time_mean_ms: Millis | None = Field(
        None,
        description="mean over the steps since the previous heartbeat; this and the other window "
        "figures below keep their last values in a heartbeat that saw no step (a stall, the final one)",
    )
    step_times_ms: Annotated[list[Millis], Field(max_length=MAX_STEP_TIMES)] = Field(
        default_factory=list,
        description=f"each step's time since the previous heartbeat (at most {MAX_STEP_TIMES})",
    )
    step_in_ms: Millis | None = Field(
        None,
        description="mean time inside a step (step begin to end: compute, and waiting for peers in "
        "the gradient AllReduce), same window",
    )
    step_out_ms: Millis | None = Field(
        None,
        description="mean time between steps (data loading, other callbacks, host work), same window",
    )
    samples_per_s: Annotated[float, Field(ge=0, le=1e12)] | None = Field(
        None, description="this rank's throughput over the same window"
    )
    batch_size: Annotated[int, Field(ge=1, le=2**31)] | None = Field(
        None, description="samples per step on this rank"
    )
    cpu_percent: Annotated[float, Field(ge=0, le=1e5)] | None = Field(
        None, description="the process's CPU use, from psutil (100 = one core)"
    )
    cpu_seconds: Annotated[float, Field(ge=0, le=1e12)] | None = Field(
        None, description="the process's CPU time so far (user + system, all threads), from psutil"
    )
    rss_bytes: Bytes | None = Field(None, description="the process's resident memory, from psutil")
    device: Device | None = Field(
        None, description="the accelerator (below); null without `npu-smi`/`nvidia-smi`"
    )
    time: UnixTime = Field(description="when this heartbeat was written (Unix seconds)")
    last_step_at: UnixTime | None = Field(None, description="when the last step ended (Unix seconds)")
    started_at: UnixTime | None = Field(None, description="when the bridge started")
    seq: Count = Field(0, description="heartbeat counter, +1 per write")
    sync_every: Annotated[int, Field(ge=1, le=10**6)] = Field(
        1, description="current agreement interval *K* in steps"
    )
    bridge_cost: BridgeCost | None = Field(None, description="what the bridge costs this rank so far (below)")
    stop: StopRecord | None = Field(None, description="the stop lifecycle (below), once a stop is under way")
    resumed_from: ResumedFrom | None = Field(None, description="`{global_step, epoch, path}`")
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(
        None, description='why the rank failed (`state == "failed"`)'
    )
    warnings: Annotated[
        list[Annotated[str, Field(max_length=MAX_WARNING)]], Field(max_length=MAX_WARNINGS)
    ] = Field(default_factory=list, description="problems the bridge met and survived (e.g. disk full)")

    def to_json(self) -> bytes:
        # by_alias: the field is `schema` on disk (a BaseModel attribute name otherwise).
        return self.model_dump_json(by_alias=True).encode()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


class Job(_Model):
    """``RUN/rankwatch/job.json``, written by rank 0 when the bridge starts."""

    world_size: WorldSize = Field(description="ranks in the job")
    started_at: UnixTime | None = Field(None, description="when rank 0's bridge started")
    host: Host | None = Field(None, description="rank 0's host")
    pid: Pid | None = Field(None, description="rank 0's process id")
    argv: Annotated[list[Annotated[str, Field(max_length=MAX_PATH)]], Field(max_length=256)] = Field(
        default_factory=list, description="the training script's `sys.argv` (for the relaunch command)"
    )
    launcher_argv: Annotated[list[Annotated[str, Field(max_length=MAX_PATH)]], Field(max_length=256)] = Field(
        default_factory=list,
        description="msrun's own command line (rank 0's parent), with its options; empty when not launched by msrun",
    )
    env: Annotated[
        dict[
            Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")],
            Annotated[str, Field(max_length=MAX_PATH)],
        ],
        Field(max_length=64),
    ] = Field(
        default_factory=dict,
        description="the `MS_*`, `GLOG_*`, `HCCL_*` and `ASCEND_*` variables the job ran with (not msrun's own)",
    )
    front_end: Literal["callback", "loop"] | None = Field(
        None, description="how the bridge is attached: `Model.train`'s callback or `bridge.loop`"
    )
    checkpoint_dir: Path_ = Field(
        "checkpoints", description="where the bridge saves, relative to the run directory"
    )
    sync_interval_s: Annotated[float, Field(gt=0, le=1e6)] | None = Field(
        None, description="the bridge's target seconds between agreements"
    )


class HistoryLine(_Model):
    """One line of ``RUN/rankwatch/rank_{r}.history.jsonl``, appended with each heartbeat."""

    time: UnixTime = Field(description="the heartbeat's `time`")
    global_step: Count | None = Field(None, description="as in the heartbeat")
    loss: Annotated[float, Field(allow_inf_nan=True)] | None = Field(None, description="as in the heartbeat")
    step_time_ms: Millis | None = Field(None, description="as in the heartbeat")
    step_time_mean_ms: Millis | None = Field(None, description="as in the heartbeat")
    cpu_percent: Annotated[float, Field(ge=0, le=1e5)] | None = Field(None, description="as in the heartbeat")
    rss_bytes: Bytes | None = Field(None, description="as in the heartbeat")

    @classmethod
    def of(cls, beat: Heartbeat) -> HistoryLine:
        return cls(**{name: getattr(beat, name) for name in cls.model_fields})


# The most sets one retention file may pin, and the longest set id it may name.
MAX_PINS = 1000
MAX_SET_ID = 2 * MAX_PATH


class RetentionFile(_Model):
    """``RUN/rankwatch/retention.json``: this run's checkpoint retention, over the dashboard's settings.

    Every field is optional: a missing one keeps the setting's value. The
    checkpoint browser's pin and unpin rewrite ``pinned``.
    """

    mode: Literal["off", "dry_run", "on"] | None = Field(None, description="`RETENTION_MODE` for this run")
    keep: Annotated[int, Field(ge=1, le=100_000)] | None = Field(
        None, description="`RETENTION_KEEP`: the newest complete sets kept"
    )
    every: Annotated[int, Field(ge=0, le=2**53)] | None = Field(
        None, description="`RETENTION_EVERY`: sets at a multiple of this global step are kept (0: off)"
    )
    pinned: Annotated[list[Annotated[str, Field(max_length=MAX_SET_ID)]], Field(max_length=MAX_PINS)] = Field(
        default_factory=list, description="ids of the sets never deleted"
    )


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


# ---------------------------------------------------------------- a bad device figure

# What a Device may lose and stay a Device; without its kind or index it is dropped whole.
_DEVICE_REQUIRED = ("kind", "index")


def _device_at_fault(model: type, e: ValidationError) -> bool:
    return model is Heartbeat and all(err["loc"][:1] == ("device",) for err in e.errors())


def clean_device(raw: Any) -> tuple[dict | None, list[str]]:
    """A heartbeat's ``device`` without its bad figures, and a warning for each one left out.

    One out-of-range figure (``npu-smi`` printing a utilisation of 101, or
    garbage) must not fail the whole heartbeat, or the rank looks dead.
    """
    if not isinstance(raw, dict):
        return None, [f"device: not an object (got {type(raw).__name__}); left out"]
    device, notes = dict(raw), []
    for _ in range(len(Device.model_fields) + 1):
        try:
            Device.model_validate(device)
            return device, notes
        except ValidationError as e:
            errors = e.errors(include_url=False)
            bad = {err["loc"][0] for err in errors if err["loc"] and err["loc"][0] not in _DEVICE_REQUIRED}
            if len(bad) < len(errors) or not bad:
                return None, [*notes, f"device left out: {_explain(e)}"]
            for name in sorted(bad, key=str):
                value = repr(device.pop(name))
                value = value if len(value) <= 40 else value[:37] + "..."
                notes.append(f"device {name} {value} is out of range or not a number; left out")
    return None, notes


def _without_bad_device(fields: dict) -> dict:
    device, notes = clean_device(fields.get("device"))
    warnings = fields.get("warnings")
    if not isinstance(warnings, list):
        return {**fields, "device": device}
    # Newest last, as the bridge keeps them; a note is cut to the field's bound.
    warnings = [*warnings, *(n[:MAX_WARNING] for n in notes)][-MAX_WARNINGS:]
    return {**fields, "device": device, "warnings": warnings}


def parse(model: type[M], data: bytes | str) -> M:
    """Validate a file's bytes against ``model``; SchemaError says what is wrong."""
    if len(data) > MAX_FILE_BYTES:
        raise SchemaError(
            f"file is {len(data)} bytes, more than the {MAX_FILE_BYTES} a {model.__name__} may be"
        )
    try:
        return model.model_validate_json(data)
    except ValidationError as e:
        if not _device_at_fault(model, e):
            raise _error(e) from None
    # Only a heartbeat whose device alone is wrong gets here: keep the rest.
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise SchemaError(f"not valid JSON: {e}") from None
    return validate(model, obj)


def build(model: type[M], /, **fields: Any) -> M:
    """``model(**fields)``, failing with SchemaError: how a writer makes a file's object.

    A heartbeat whose ``device`` alone is wrong is built without the bad
    figures, and says so in its ``warnings`` (``clean_device``).
    """
    try:
        return model(**fields)
    except ValidationError as e:
        if not _device_at_fault(model, e):
            raise _error(e) from None
    try:
        return model(**_without_bad_device(fields))
    except ValidationError as e:
        raise _error(e) from None


def validate(model: type[M], obj: Any) -> M:
    """Validate an already-parsed JSON value (e.g. from Redis) against ``model``.

    As ``build``, a heartbeat whose ``device`` alone is wrong keeps the rest.
    """
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        if not (_device_at_fault(model, e) and isinstance(obj, dict)):
            raise _error(e) from None
    try:
        return model.model_validate(_without_bad_device(obj))
    except ValidationError as e:
        raise _error(e) from None


def load(model: type[M], path: str | os.PathLike) -> M:
    """Read (at most ``MAX_FILE_BYTES``) and validate one run-directory file.

    Raises OSError, or SchemaError for a file too large or not matching ``model``.
    """
    try:
        data = read_capped(path)
    except FileTooLarge as e:
        raise SchemaError(str(e)) from None
    return parse(model, data)


# ---------------------------------------------------------------- README tables


def _describe(field: Any) -> str:
    """A field's type for a reader: int, float or null, one of ..., object, list of float."""
    ann = field.annotation

    def name(t: Any) -> str:
        origin = typing.get_origin(t)
        if origin is Annotated:
            return name(typing.get_args(t)[0])
        if origin in (typing.Union, types.UnionType):
            parts = [name(a) for a in typing.get_args(t) if a is not type(None)]
            nullable = type(None) in typing.get_args(t)
            return " or ".join(parts) + (" or null" if nullable else "")
        if origin is Literal:
            args = typing.get_args(t)
            return "int" if all(isinstance(a, int) for a in args) else "str"
        if origin is list:
            return f"list of {name(typing.get_args(t)[0])}"
        if origin is dict:
            return "object"
        if isinstance(t, type) and issubclass(t, BaseModel):
            return "object"
        return getattr(t, "__name__", str(t))

    return name(ann)


def markdown_table(model: type[_Model]) -> str:
    """The README table of ``model``'s fields: name, type, meaning."""
    lines = ["| field | type | meaning |", "|---|---|---|"]
    for attr, field in model.model_fields.items():
        lines.append(f"| `{field.alias or attr}` | {_describe(field)} | {field.description or ''} |")
    return "\n".join(lines)


# The tables the README carries, in its order, between <!-- schema:NAME --> markers.
README_TABLES = {
    "heartbeat": Heartbeat,
    "stop": StopRecord,
    "device": Device,
    "bridge_cost": BridgeCost,
    "history": HistoryLine,
    "job": Job,
    "retention": RetentionFile,
}


def render_readme(text: str) -> str:
    """``text`` with every ``<!-- schema:NAME -->`` block replaced by NAME's current table."""
    for name, model in README_TABLES.items():
        block = re.compile(rf"(<!-- schema:{name} -->\n).*?(<!-- /schema -->)", re.S)
        text = block.sub(lambda m, model=model: f"{m.group(1)}{markdown_table(model)}\n{m.group(2)}", text)
    return text


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer_bridge.rundir.schema [docs/run-directory.md]``: print the tables, or rewrite them in place."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        for name, model in README_TABLES.items():
            print(f"<!-- schema:{name} -->\n{markdown_table(model)}\n<!-- /schema -->\n")
        return 0
    path = argv[0]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_readme(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
