"""Stack captures on disk: their format, their text, their files (``trainer_bridge.stacks`` takes them).

A capture is one JSON file per capture,
``RUN/rankwatch/stacks/rank_{r}/{ms}-{trigger}.json`` (``Capture``); a request
is ``RUN/rankwatch/stacks/rank_{r}.request.json`` or ``all.request.json``
(``Request``). The bridge writes captures of its own process, the dashboard
writes the ones py-spy takes for it, and the dashboard reads them all, so the
format lives here once. Every capture is bounded (threads, frames, text, file
size) and read back only up to ``MAX_CAPTURE_BYTES``.
"""

from __future__ import annotations

import collections
import os
import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from trainer_bridge.rundir import runfiles, safedirs, safeio, schema

TRIGGERS = ("request", "stall")
SOURCES = ("bridge", "py-spy")
NATIVE = ("included", "off", "unavailable", "failed")
KEEP_PER_TRIGGER = 4
MAX_THREADS = 64
MAX_FRAMES = 64
MAX_NATIVE_FRAMES = 32
MAX_TEXT = 192 * 1024
# A capture file is refused above this; the bounds above keep ours well under.
MAX_CAPTURE_BYTES = 512 * 1024
# Entries of a rank's capture directory looked at: the bridge keeps
# 2 x KEEP_PER_TRIGGER there, so more is junk, and junk must cost no more.
MAX_LISTED = 256
CAPTURE_NAME = re.compile(r"\d{1,20}-(" + "|".join(TRIGGERS) + r")\.json")

Text = Annotated[str, Field(max_length=1000)]
# What one frame keeps: enough to read, small enough that 64 threads of 64
# frames (and their text) fit a capture file.
FRAME_TEXT = 300
FRAME_FILE = 500


class StackFrame(schema._Model):
    """One frame: a Python function, or a native one (``native``)."""

    function: Text = Field(description="the function (its qualified name for Python)")
    file: Annotated[str, Field(max_length=1000)] = Field(
        description="source file, or the shared library for a native frame"
    )
    line: Annotated[int, Field(ge=0, le=10**9)] = Field(0, description="line number (0: unknown)")
    code: Text | None = Field(None, description="the source line, when the capture could read it")


class StackThread(schema._Model):
    """One thread's stack, innermost frame first."""

    id: Annotated[int, Field(ge=0, le=2**64)] = Field(description="the OS thread id (as `ps -L` shows)")
    name: Annotated[str, Field(max_length=200)] | None = Field(None, description="the Python thread name")
    training: bool = Field(False, description="the thread that runs the training loop")
    frames: Annotated[list[StackFrame], Field(max_length=MAX_FRAMES)] = Field(
        default_factory=list, description="Python frames, innermost first"
    )
    omitted: Annotated[int, Field(ge=0, le=10**6)] = Field(0, description="outer frames left out")
    native: Annotated[list[StackFrame], Field(max_length=MAX_NATIVE_FRAMES)] = Field(
        default_factory=list, description="native frames below the innermost Python frame, innermost first"
    )


class Capture(schema._Model):
    """``RUN/rankwatch/stacks/rank_{r}/{ms}-{trigger}.json``: one stack capture of one rank."""

    rank: schema.Rank = Field(description="the rank")
    host: schema.Host | None = Field(None, description="its host")
    pid: schema.Pid | None = Field(None, description="its process id")
    captured_at: schema.UnixTime = Field(description="when (Unix seconds)")
    source: Literal[SOURCES] = Field(description="`bridge` (in the rank) or `py-spy` (by the dashboard)")
    trigger: Literal[TRIGGERS] = Field(description="`request` (asked for) or `stall` (automatic)")
    request_id: schema.RequestId | None = Field(None, description="the request it answers")
    global_step: schema.Count | None = Field(None, description="the rank's global step")
    since_step_s: Annotated[float, Field(ge=0, le=1e9)] | None = Field(
        None, description="seconds since the rank last finished a step"
    )
    native: Literal[NATIVE] = Field("off", description="native frames: " + ", ".join(NATIVE))
    native_note: Annotated[str, Field(max_length=500)] | None = Field(
        None, description="why native frames are missing"
    )
    took_ms: schema.Millis = Field(0.0, description="how long the capture took")
    threads: Annotated[list[StackThread], Field(max_length=MAX_THREADS)] = Field(
        default_factory=list, description="the training thread first"
    )
    threads_omitted: Annotated[int, Field(ge=0, le=10**6)] = Field(0, description="threads left out")
    text: Annotated[str, Field(max_length=MAX_TEXT)] = Field("", description="the capture as text")


class Request(schema._Model):
    """``RUN/rankwatch/stacks/rank_{r}.request.json`` (or ``all.request.json``)."""

    request_id: schema.RequestId = Field(description="echoed in the capture that answers it")
    requested_at: schema.UnixTime = Field(description="when (Unix seconds)")
    requested_by: Annotated[str, Field(max_length=200)] | None = Field(None, description="who asked")
    native: bool = Field(
        False, description="include native frames (py-spy pauses the rank for about a second to unwind them)"
    )


def _clip(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[: limit - 3] + "..."


# ---------------------------------------------------------------- the text


def _where(frame: dict) -> str:
    line = f":{frame['line']}" if frame.get("line") else ""
    return f"{frame['function']} ({frame['file']}{line})"


def render(fields: dict) -> str:
    """A capture as text, py-spy's layout: a header, then each thread innermost frame first."""
    at = datetime.fromtimestamp(fields["captured_at"]).strftime("%Y-%m-%d %H:%M:%S")
    why = "on request" if fields["trigger"] == "request" else "automatically: the rank stopped stepping"
    facts = []
    if fields.get("global_step") is not None:
        facts.append(f"global step {fields['global_step']}")
    if fields.get("since_step_s") is not None:
        facts.append(f"{fields['since_step_s']:.1f} s since its last step")
    where = "".join(
        part
        for part, value in (
            (f", pid {fields.get('pid')}", fields.get("pid")),
            (f" on {fields.get('host')}", fields.get("host")),
        )
        if value is not None
    )
    lines = [
        f"rank {fields['rank']}{where}: captured {at} {why} by {fields['source']}"
        + (f" ({', '.join(facts)})" if facts else "")
    ]
    if fields.get("native_note"):
        lines.append(f"native frames {fields['native']}: {fields['native_note']}")
    if fields.get("threads_omitted"):
        lines.append(f"{fields['threads_omitted']} more threads left out (the capture's bound)")
    for t in fields["threads"]:
        label = f' "{t["name"]}"' if t.get("name") else ""
        lines.append("")
        lines.append(f"Thread {t['id']}{label}{' (training thread)' if t['training'] else ''}")
        for f in t["native"]:
            lines.append(f"    {_where(f)}  [native]")
        for f in t["frames"]:
            lines.append(f"    {_where(f)}")
            if f.get("code"):
                lines.append(f"        {f['code']}")
        if t["omitted"]:
            lines.append(f"    ... {t['omitted']} outer frames left out")
    return _clip("\n".join(lines) + "\n", MAX_TEXT)


def build_capture(**fields: Any) -> Capture:
    """A validated ``Capture`` from its fields, with its text, within ``MAX_CAPTURE_BYTES``.

    Threads past the training thread are dropped, last first, until the file fits.
    """
    threads = fields["threads"]
    while True:
        fields["text"] = render(fields)
        capture = schema.build(Capture, **fields)
        if len(capture.to_json()) <= MAX_CAPTURE_BYTES or len(threads) <= 1:
            return capture
        fields["threads_omitted"] = fields.get("threads_omitted", 0) + (len(threads) - len(threads) // 2)
        fields["threads"] = threads = threads[: max(1, len(threads) // 2)]


# ---------------------------------------------------------------- the files


def capture_name(capture: Capture) -> str:
    return f"{int(capture.captured_at * 1000):014d}-{capture.trigger}.json"


def write_capture(run_dir: str | os.PathLike, capture: Capture) -> Path:
    """Write ``capture`` atomically into its rank's directory, then drop the oldest beyond the bound.

    Through ``safeio``'s walk from the run directory: a symlinked
    ``stacks/`` or ``rank_{r}/`` cannot send the write, or the clean-up's
    unlinks, outside it. Only regular files with a capture's name count.
    """
    folder = runfiles.stack_captures_dir(run_dir, capture.rank)
    rel = safeio.relative(run_dir, folder)
    path = folder / capture_name(capture)
    safeio.write_atomic(run_dir, f"{rel}/{path.name}", capture.to_json(), fsync=False)
    by_trigger: dict[str, list[str]] = collections.defaultdict(list)
    with safedirs.pinned_dir(run_dir, rel) as pinned:
        entries, _ = safedirs.scan_regular(pinned, MAX_LISTED)
    for entry in entries:
        m = CAPTURE_NAME.fullmatch(entry.name)
        if m:
            by_trigger[m.group(1)].append(entry.name)
    for names in by_trigger.values():
        for old in sorted(names)[:-KEEP_PER_TRIGGER]:
            try:
                safeio.unlink(run_dir, f"{rel}/{old}")
            except OSError:
                pass
    return path


def capture_files(run_dir: str | os.PathLike, rank: int) -> list[Path]:
    """Rank ``rank``'s capture files, newest first (names sort by capture time).

    Only regular files named like a capture, among the first ``MAX_LISTED``
    entries: a directory stuffed with junk costs a bounded listing.
    """
    folder = runfiles.stack_captures_dir(run_dir, rank)
    try:
        entries, _ = safedirs.scan_regular(folder, MAX_LISTED)
    except OSError:
        return []
    names = [e.name for e in entries if CAPTURE_NAME.fullmatch(e.name)]
    return [folder / n for n in sorted(names, reverse=True)]


def load_capture(path: str | os.PathLike) -> Capture:
    """Read (at most ``MAX_CAPTURE_BYTES``) and validate one capture; OSError or SchemaError."""
    try:
        data = runfiles.read_capped(path, MAX_CAPTURE_BYTES)
    except runfiles.FileTooLarge as e:
        raise schema.SchemaError(str(e)) from None
    try:
        return Capture.model_validate_json(data)
    except ValidationError as e:
        raise schema._error(e) from None


def write_request(run_dir: str | os.PathLike, rank: int | None, request: Request) -> Path:
    path = runfiles.stack_request_path(run_dir, rank)
    runfiles.atomic_write_bytes(path, request.to_json(), root=run_dir)
    return path


def read_request(run_dir: str | os.PathLike, rank: int | None) -> Request | None:
    """The request file's content; None if there is none or it is not a valid request."""
    try:
        return schema.load(Request, runfiles.stack_request_path(run_dir, rank))
    except (OSError, schema.SchemaError):
        return None
