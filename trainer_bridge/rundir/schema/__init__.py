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

The package: ``base`` (the bounds, the base model, SchemaError),
``heartbeat`` (the files each rank rewrites), ``job`` (job.json,
retention.json, attempts.jsonl), ``validation`` (parse, build, validate,
load) and ``docs`` (the tables). Import the names from here.
"""

from __future__ import annotations

from trainer_bridge.rundir.schema.base import (
    MAX_ERROR,
    MAX_PATH,
    MAX_RANKS,
    MAX_STEP_TIMES,
    MAX_WARNING,
    MAX_WARNINGS,
    Bytes,
    Count,
    Host,
    LaunchId,
    Millis,
    Path_,
    Pid,
    Rank,
    RequestId,
    SchemaError,
    UnixTime,
    WorldSize,
)

# stackfiles' models share the base model and its error message.
from trainer_bridge.rundir.schema.base import _error as _error
from trainer_bridge.rundir.schema.base import _Model as _Model
from trainer_bridge.rundir.schema.docs import README_TABLES, main, markdown_table, render_readme
from trainer_bridge.rundir.schema.heartbeat import (
    BridgeCost,
    CheckpointRef,
    Device,
    Heartbeat,
    HistoryLine,
    ResumedFrom,
    StopRecord,
)
from trainer_bridge.rundir.schema.job import (
    MAX_ATTEMPT_HOSTS,
    MAX_PINS,
    MAX_SET_ID,
    AttemptCause,
    AttemptEnd,
    AttemptHosts,
    AttemptNo,
    AttemptNode,
    AttemptRefused,
    AttemptResume,
    AttemptStart,
    AttemptSupervised,
    Hosts,
    Job,
    RetentionFile,
    Scheduler,
    SpikesFile,
)
from trainer_bridge.rundir.schema.validation import build, clean_device, load, parse, validate

__all__ = [
    "AttemptCause",
    "AttemptEnd",
    "AttemptHosts",
    "AttemptNo",
    "AttemptNode",
    "AttemptResume",
    "AttemptStart",
    "AttemptRefused",
    "AttemptSupervised",
    "BridgeCost",
    "Bytes",
    "CheckpointRef",
    "Count",
    "Device",
    "Heartbeat",
    "HistoryLine",
    "Host",
    "Hosts",
    "Job",
    "LaunchId",
    "MAX_ATTEMPT_HOSTS",
    "MAX_ERROR",
    "MAX_PATH",
    "MAX_PINS",
    "MAX_RANKS",
    "MAX_SET_ID",
    "MAX_STEP_TIMES",
    "MAX_WARNING",
    "MAX_WARNINGS",
    "Millis",
    "Path_",
    "Pid",
    "README_TABLES",
    "Rank",
    "RequestId",
    "ResumedFrom",
    "RetentionFile",
    "Scheduler",
    "SpikesFile",
    "SchemaError",
    "StopRecord",
    "UnixTime",
    "WorldSize",
    "build",
    "clean_device",
    "load",
    "main",
    "markdown_table",
    "parse",
    "render_readme",
    "validate",
]
