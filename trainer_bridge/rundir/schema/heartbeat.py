"""The files each rank rewrites: its heartbeat (with the stop record, the device, ...) and its history."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from trainer_bridge.rundir.runfiles import HEARTBEAT_SCHEMA, STATES, STOP_STAGES
from trainer_bridge.rundir.schema.base import (
    MAX_ERROR,
    MAX_PATH,
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
    UnixTime,
    WorldSize,
    _Model,
)

# A value with no JSON number: the name it is written under, beside a null.
NonFinite = Literal["nan", "inf", "-inf"]
# The figures a heartbeat (and its history line) may carry as NaN or infinite.
_NONFINITE_FIELDS = ("loss", "grad_norm")


def nonfinite_name(value: float) -> NonFinite:
    """``nan``, ``inf`` or ``-inf``: how a non-finite float is written (JSON has no such number)."""
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _split_nonfinite(data: Any) -> Any:
    """A non-finite ``loss``/``grad_norm`` becomes null plus ``loss_nonfinite``/``grad_norm_nonfinite``.

    So the file stays valid JSON (issue 34), and files written before this
    (JSON's ``NaN``/``Infinity`` constants, which pydantic reads as floats)
    read the same. A finite value wins over a stale flag beside it.
    """
    if not isinstance(data, dict):
        return data
    out = None
    for name in _NONFINITE_FIELDS:
        value = data.get(name)
        if isinstance(value, float) and not math.isfinite(value):
            out = out or dict(data)
            out[name], out[f"{name}_nonfinite"] = None, nonfinite_name(value)
        elif (
            isinstance(value, (int, float)) and not isinstance(value, bool) and data.get(f"{name}_nonfinite")
        ):
            out = out or dict(data)
            out[f"{name}_nonfinite"] = None
    return data if out is None else out


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
    reporter_cpu_ms: Millis = Field(
        0.0,
        description="the reporter's CPU time: on its thread, and at agreement steps on the training thread",
    )
    reporter_thread: bool = Field(
        False,
        description="the reporter's thread was running: only while agreements do not come "
        "(start-up, a hang, an evaluation); otherwise the agreements do its work",
    )
    reporter_thread_starts: Count = Field(
        0,
        description="times the reporter's thread started: at the start, then after each pause in agreements",
    )


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
    set: Annotated[str, Field(max_length=2 * MAX_PATH)] | None = Field(
        None, description="the set's id, as the checkpoint browser names it"
    )


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
    loss: Annotated[float, Field(allow_inf_nan=False)] | None = Field(
        None, description="last loss; null when none yet or when it is NaN or infinite (below)"
    )
    loss_nonfinite: NonFinite | None = Field(
        None, description="`nan`, `inf` or `-inf` when the last loss was one (the loss is then null)"
    )
    loss_step: Count | None = Field(
        None,
        description="the global step whose loss `loss` is (the bridge converts one about once a heartbeat, "
        "so it may be a few steps behind `global_step`)",
    )
    grad_norm: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        None, description="the global gradient norm, when the script reports it (`bridge.report`)"
    )
    grad_norm_nonfinite: NonFinite | None = Field(None, description="as `loss_nonfinite`, for the norm")
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
        None, description="the process's CPU use since the last heartbeat (100 = one core)"
    )
    cpu_seconds: Annotated[float, Field(ge=0, le=1e12)] | None = Field(
        None, description="the process's CPU time so far (user + system, all threads)"
    )
    rss_bytes: Bytes | None = Field(None, description="the process's resident memory")
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
    resumed_from: ResumedFrom | None = Field(None, description="`{global_step, epoch, path, set}`")
    launch: LaunchId | None = Field(
        None,
        description="the launch this rank belongs to, the same on every rank of it "
        "(`attempts.jsonl` maps it to an attempt)",
    )
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None = Field(
        None, description='why the rank failed (`state == "failed"`)'
    )
    warnings: Annotated[
        list[Annotated[str, Field(max_length=MAX_WARNING)]], Field(max_length=MAX_WARNINGS)
    ] = Field(default_factory=list, description="problems the bridge met and survived (e.g. disk full)")

    _nonfinite = model_validator(mode="before")(_split_nonfinite)

    def to_json(self) -> bytes:
        # by_alias: the field is `schema` on disk (a BaseModel attribute name otherwise).
        return self.model_dump_json(by_alias=True).encode()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True)


class HistoryLine(_Model):
    """One line of ``RUN/rankwatch/rank_{r}.history.jsonl``, appended with each heartbeat."""

    time: UnixTime = Field(description="the heartbeat's `time`")
    global_step: Count | None = Field(None, description="as in the heartbeat")
    loss: Annotated[float, Field(allow_inf_nan=False)] | None = Field(None, description="as in the heartbeat")
    loss_nonfinite: NonFinite | None = Field(None, description="as in the heartbeat")
    loss_step: Count | None = Field(None, description="as in the heartbeat")
    grad_norm: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = Field(
        None, description="as in the heartbeat"
    )
    grad_norm_nonfinite: NonFinite | None = Field(None, description="as in the heartbeat")
    step_time_ms: Millis | None = Field(None, description="as in the heartbeat")
    step_time_mean_ms: Millis | None = Field(None, description="as in the heartbeat")
    cpu_percent: Annotated[float, Field(ge=0, le=1e5)] | None = Field(None, description="as in the heartbeat")
    rss_bytes: Bytes | None = Field(None, description="as in the heartbeat")

    _nonfinite = model_validator(mode="before")(_split_nonfinite)

    @classmethod
    def of(cls, beat: Heartbeat) -> HistoryLine:
        return cls(**{name: getattr(beat, name) for name in cls.model_fields})
