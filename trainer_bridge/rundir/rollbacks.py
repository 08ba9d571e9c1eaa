"""Loss-spike rollbacks: the pending request (``rankwatch/rollback.json``) and the record (``rollbacks.jsonl``).

Who writes what:

- The detector (the dashboard's watcher, or the agent) judges the ranks'
  losses. In ``observe`` mode it appends an ``observed`` line saying what
  ``enforce`` would have done. In ``enforce`` mode it writes the pending
  request, appends a ``requested`` line, and then asks for the graceful stop
  through the flag (who = ``policy``, the rule as the reason). A rollback
  asked while a stop is already pending joins that stop.
- ``rankwatch launch``, when the attempt ends by that stop, reads the
  request, picks the rollback target (the newest complete, healthy set older
  than ``first_step`` minus a margin), relaunches pinned to it
  (``RANKWATCH_RESUME_STEP``) with ``RANKWATCH_SKIP_BATCHES``, clears the
  request, and appends a ``relaunched`` line (or ``exhausted`` / ``refused``
  when the budget is spent or no target exists). When it starts it
  publishes its rollback settings (``rankwatch/rollback_settings.json``),
  so the dashboard names the set it would take with its own margin.

Both files sit in the run's private state directory and are untrusted
input like every other file there: read bounded, validated field by field,
and a bad file is "no request", never an exception on the stop path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

from pydantic import Field

from trainer_bridge.rundir import runfiles, safedirs, safeio
from trainer_bridge.rundir.schema.base import MAX_RANKS, Count, Host, Pid, UnixTime, _Model
from trainer_bridge.rundir.schema.validation import parse

M = TypeVar("M", bound=_Model)

REQUEST_NAME = "rollback.json"
LINES_NAME = "rollbacks.jsonl"
SETTINGS_NAME = "rollback_settings.json"
# How many batches past the spike's first step the relaunched job skips (the bridge reads it).
SKIP_BATCHES_ENV = "RANKWATCH_SKIP_BATCHES"
# The step the abnormal value was seen at (the spike's first step or later), beside SKIP_BATCHES: the relaunched job's data resumes at global step
# SKIP_FROM - 1 + SKIP_BATCHES (its global step jumps there too; the skipped steps are never trained).
# Added by the enforce half (optional: without it the skip counts from the resumed set's step).
SKIP_FROM_ENV = "RANKWATCH_SKIP_FROM"
# A learning-rate scale a script may opt in to read on a later rung (1.0 when unset).
LR_SCALE_ENV = "RANKWATCH_LR_SCALE"

MAX_REQUEST_BYTES = 16 * 1024
MAX_SETTINGS_BYTES = 4096
MAX_LINE_BYTES = 16 * 1024
MAX_TAIL_BYTES = 1 << 20

RULES = ("nonfinite", "spike", "grad_norm", "divergence")
Rule = Literal["nonfinite", "spike", "grad_norm", "divergence"]
# A loss or norm as judged: a finite number, or the name of the non-finite value.
Value = float | Literal["nan", "inf", "-inf"]


class Evidence(_Model):
    """What a rule saw: the rank, the step, the value and the level it was judged against."""

    rule: Rule = Field(description="`nonfinite`, `spike`, `grad_norm` or `divergence`")
    rank: Annotated[int, Field(ge=0, lt=MAX_RANKS)] = Field(description="the rank whose value tripped it")
    step: Count = Field(description="the global step of the value")
    value: Value | None = Field(None, description="the loss or global norm (`nan`, `inf`, `-inf` as strings)")
    level: float | None = Field(None, description="the robust level it was judged against")
    ranks: Annotated[int, Field(ge=0, le=MAX_RANKS)] | None = Field(
        None, description="how many ranks showed it at that step"
    )
    text: Annotated[str, Field(max_length=500)] = Field("", description="the evidence in words")


class Request(_Model):
    """The pending rollback: written by the detector in enforce mode, consumed by ``rankwatch launch``."""

    rule: Rule = Field(description="the rule that asked for it")
    evidence: Evidence = Field(description="what it saw")
    first_step: Count = Field(description="the spike's first abnormal global step (K)")
    skip_batches: Count = Field(description="batches to skip past K on the relaunch")
    rung: Annotated[int, Field(ge=1, le=100)] = Field(1, description="1 for the first rollback at this place")
    asked_at: UnixTime = Field(description="when the detector asked")


class Line(_Model):
    """One line of ``rollbacks.jsonl``."""

    kind: Literal["observed", "requested", "relaunched", "refused", "exhausted"] = Field(
        description="`observed` (observe mode: what enforce would do), `requested` (enforce: the stop was "
        "asked), `relaunched`, `refused` (no healthy target) or `exhausted` (`MAX_ROLLBACKS` spent)"
    )
    at: UnixTime = Field(description="when")
    rule: Rule = Field(description="the rule")
    evidence: Evidence = Field(description="what it saw")
    first_step: Count = Field(description="the spike's first abnormal global step")
    target_step: Count | None = Field(None, description="the rollback target's global step")
    target_set: Annotated[str, Field(max_length=200)] | None = Field(None, description="its set id")
    skip_batches: Count = Field(0, description="batches skipped past the first step")
    rung: Annotated[int, Field(ge=1, le=100)] = Field(1, description="the rung of the ladder")
    attempt: Count | None = Field(None, description="the attempt the rollback started, once relaunched")
    note: Annotated[str, Field(max_length=1000)] = Field("", description="why, in words")


class SupervisorSettings(_Model):
    """``rankwatch/rollback_settings.json``: the rollback settings of the run's ``rankwatch launch``.

    Written when a supervisor starts (node 0's, with several nodes). The
    dashboard reads the margin from it, so the set it names for a spike is
    the one this supervisor would take; without the file it assumes the
    defaults. A later supervisor's file replaces an earlier one's.
    """

    max_rollbacks: Annotated[int, Field(ge=0, le=10**6)] = Field(description="`--max-rollbacks`")
    margin: Count = Field(description="`--rollback-margin`: a target is older than the first step minus this")
    cooldown_steps: Count = Field(description="`--rollback-cooldown-steps`")
    supervisor_pid: Pid = Field(description="the `rankwatch launch` process")
    host: Host = Field(description="its host")
    since: UnixTime = Field(description="when it started")


def data_step(resumed: int, env: Mapping[str, str]) -> int:
    """The global step a job resumed at ``resumed`` goes on from, its data skipped (``SKIP_*_ENV``).

    The bridge resumes the weights of the set at ``resumed`` and the data (and
    the step count) at ``SKIP_FROM - 1 + SKIP_BATCHES``: the batches between
    the set and the spike are skipped too, because the detector sees the
    loss a heartbeat at a time, so its first step is a bound, not the first
    bad batch. Never backwards; values that are not plain counts are ignored.
    """
    skip = env.get(SKIP_BATCHES_ENV, "")
    start = env.get(SKIP_FROM_ENV, "")
    if not (skip.isascii() and skip.isdigit()) or len(skip) > 12:
        return resumed
    base = int(start) - 1 if start.isascii() and start.isdigit() and 0 < len(start) <= 12 else resumed
    return max(resumed, base + int(skip))


def request_rel() -> str:
    return f"{runfiles.STATE_DIR}/{REQUEST_NAME}"


def lines_rel() -> str:
    return f"{runfiles.STATE_DIR}/{LINES_NAME}"


def settings_rel() -> str:
    return f"{runfiles.STATE_DIR}/{SETTINGS_NAME}"


def publish_settings(run_dir: str | os.PathLike, settings: SupervisorSettings) -> None:
    """Write the supervisor's settings atomically; raises OSError."""
    safedirs.makedirs(run_dir, runfiles.STATE_DIR)
    safeio.write_atomic(run_dir, settings_rel(), settings.to_json())


def read_settings(run_dir: str | os.PathLike) -> tuple[SupervisorSettings | None, str | None]:
    """(the published settings or None, why a file that is there was refused)."""
    return _read_one(run_dir, SETTINGS_NAME, SupervisorSettings, MAX_SETTINGS_BYTES)


def write_request(run_dir: str | os.PathLike, req: Request) -> None:
    """Write the pending request atomically; raises OSError."""
    safedirs.makedirs(run_dir, runfiles.STATE_DIR)
    safeio.write_atomic(run_dir, request_rel(), req.to_json())


def read_request(run_dir: str | os.PathLike) -> tuple[Request | None, str | None]:
    """(the pending request or None, why a file that is there was refused)."""
    return _read_one(run_dir, REQUEST_NAME, Request, MAX_REQUEST_BYTES)


def _read_one(
    run_dir: str | os.PathLike, name: str, model: type[M], limit: int
) -> tuple[M | None, str | None]:
    try:
        data = safeio.read_regular(os.path.join(run_dir, runfiles.STATE_DIR, name), limit)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{name}: {e}"
    try:
        return parse(model, data), None
    except ValueError as e:
        return None, f"{name}: {e}"


def clear_request(run_dir: str | os.PathLike) -> None:
    """Remove the pending request (absent is fine); raises OSError."""
    try:
        safeio.unlink(run_dir, request_rel())
    except FileNotFoundError:
        pass


def append(run_dir: str | os.PathLike, line: Line) -> None:
    """Append one line to ``rollbacks.jsonl``; raises OSError."""
    safedirs.makedirs(run_dir, runfiles.STATE_DIR)
    safeio.append(run_dir, lines_rel(), line.to_json() + b"\n")


def read_lines(run_dir: str | os.PathLike) -> tuple[list[Line], int]:
    """(the valid lines in the newest ``MAX_TAIL_BYTES``, lines skipped). A missing file is no lines."""
    try:
        data, start = safeio.read_tail(os.path.join(run_dir, lines_rel()), MAX_TAIL_BYTES)
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError):
        return [], 1
    raws = data.splitlines()
    if start > 0 and raws:
        raws = raws[1:]  # the tail began mid-line
    lines, skipped = [], 0
    for raw in raws:
        if not raw.strip():
            continue
        if len(raw) > MAX_LINE_BYTES:
            skipped += 1
            continue
        try:
            lines.append(parse(Line, raw))
        except ValueError:
            skipped += 1
    return lines, skipped
