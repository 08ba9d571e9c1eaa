"""The run directory: the only channel between the trainers and the dashboard.

Both sides import this module, so the layout and the file rules live in one
place. It must not import mindspore: the dashboard never loads it.

Layout (``RUN`` is the directory given to ``--run-dir``)::

    RUN/graceful_exit.json                 the stop flag (MindSpore's format)
    RUN/rankwatch/job.json                 job facts, written by rank 0 at start
    RUN/rankwatch/rank_{r}.json            rank r's heartbeat, rewritten ~1 Hz
    RUN/rankwatch/rank_{r}.history.jsonl   rank r's chart history, bounded
    RUN/rankwatch/rank_{r}.history.jsonl.1 the previous history segment
    RUN/rankwatch/audit.sqlite3            the dashboard's audit trail
    RUN/rankwatch/stacks/rank_{r}.request.json  asks rank r for a stack capture
    RUN/rankwatch/stacks/all.request.json  asks every rank for one
    RUN/rankwatch/stacks/rank_{r}/*.json   rank r's newest stack captures, bounded
    RUN/checkpoints/rank_{r}/rankwatch-{epoch}_{step}.ckpt
                                           checkpoints saved by the bridge

Every JSON file is written atomically (temporary file in the same directory,
fsync, ``os.replace``), so a reader sees the old file or the new one, never
half of one. Readers still treat a bad file as "no data" rather than crashing,
because other tools (or a full disk) can leave anything behind.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer_bridge.rundir import safeio
from trainer_bridge.rundir.safeio import FileTooLarge, NotRegular  # noqa: F401  (re-exported)

HEARTBEAT_SCHEMA = 1
FLAG_NAME = "graceful_exit.json"
FLAG_KEY = "GracefulExit"
STATE_DIR = "rankwatch"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PREFIX = "rankwatch"
# A history segment is rotated once it passes this size; with one previous
# segment kept, a rank's history never takes more than twice this on disk.
HISTORY_SEGMENT_BYTES = 256 * 1024

# A heartbeat is about 1.5 KB, job.json and the flag a few hundred bytes: a
# file past this is not ours, and is refused before it is read into memory.
MAX_FILE_BYTES = 64 * 1024
# Request ids are ours (``new_request_id``: 24 characters) or an operator's.
MAX_REQUEST_ID = 128

# Pins the checkpoint set the bridge resumes from, by global step, without
# editing the training script (GracefulExitBridge's resume_step).
RESUME_STEP_ENV = "RANKWATCH_RESUME_STEP"

# Rank lifecycle states, in the order a healthy run passes through them.
STATES = ("starting", "training", "stopping", "saving", "exited", "finished", "failed")
# Stop stages a rank reports under "stop": {"stage": ...}.
STOP_STAGES = ("seen", "agreed", "saving", "saved", "exited")


class FlagError(ValueError):
    """The flag file exists but is not a JSON object (torn write, garbage)."""


def flag_path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / FLAG_NAME


def state_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / STATE_DIR


def heartbeat_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return state_dir(run_dir) / f"rank_{rank}.json"


def history_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return state_dir(run_dir) / f"rank_{rank}.history.jsonl"


def job_path(run_dir: str | os.PathLike) -> Path:
    return state_dir(run_dir) / "job.json"


def stacks_dir(run_dir: str | os.PathLike) -> Path:
    """Stack requests and captures (``trainer_bridge.stacks``)."""
    return state_dir(run_dir) / "stacks"


def stack_request_path(run_dir: str | os.PathLike, rank: int | None) -> Path:
    """The request file for ``rank``, or for every rank when ``rank`` is None."""
    return stacks_dir(run_dir) / ("all.request.json" if rank is None else f"rank_{rank}.request.json")


def stack_captures_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return stacks_dir(run_dir) / f"rank_{rank}"


def checkpoint_path(run_dir: str | os.PathLike, rank: int, epoch: int, step_in_epoch: int) -> Path:
    """Where the bridge saves rank ``rank``'s checkpoint.

    The name follows ``ModelCheckpoint``'s ``{prefix}-{epoch}_{step}.ckpt`` so
    any tool that knows MindSpore's convention reads it; the global step and
    the stop request's id are inside the file (``append_dict``).
    """
    return (
        Path(run_dir) / CHECKPOINT_DIR / f"rank_{rank}" / f"{CHECKPOINT_PREFIX}-{epoch}_{step_in_epoch}.ckpt"
    )


def atomic_write_bytes(
    path: str | os.PathLike, data: bytes, fsync: bool = True, *, root: str | os.PathLike | None = None
) -> None:
    """Replace ``path`` with ``data`` so readers never see a partial file.

    ``root`` is the run directory ``path`` lies under: the walk from it
    follows no symlink (``safeio.write_atomic``), so a symlinked
    ``rankwatch/`` cannot send the write elsewhere. Without it only the
    file's own directory is trusted as given.
    """
    path = Path(path)
    if root is None:
        root, rel = path.parent, path.name
    else:
        rel = safeio.relative(root, path)
    safeio.write_atomic(root, rel, data, fsync=fsync)


def atomic_write_json(
    path: str | os.PathLike, obj: Any, fsync: bool = True, *, root: str | os.PathLike | None = None
) -> None:
    atomic_write_bytes(path, json.dumps(obj, separators=(",", ":")).encode(), fsync=fsync, root=root)


def read_capped(path: str | os.PathLike, limit: int = MAX_FILE_BYTES) -> bytes:
    """A regular file's bytes; FileTooLarge (without reading it) if it holds more than ``limit``.

    Every file in the run directory is untrusted input: this bounds what one
    can make a reader allocate, and never blocks (``safeio.read_regular``:
    a FIFO, socket, device, directory or symlink is ``safeio.NotRegular``,
    an OSError). The size is checked on the open file and at most
    ``limit + 1`` bytes are read, so a file that grows in between cannot
    slip through.
    """
    return safeio.read_regular(path, limit)


def read_json(path: str | os.PathLike) -> Any:
    """Read a JSON file of at most ``MAX_FILE_BYTES``; raises OSError or ValueError."""
    return loads_bounded(read_capped(path))


def loads_bounded(data: bytes | str) -> Any:
    """``json.loads`` that fails with ValueError, not RecursionError, on absurd nesting."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def read_json_or_none(path: str | os.PathLike) -> Any | None:
    """Read a JSON file, or None if it is missing, unreadable, too large or not JSON."""
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Flag:
    """The stop flag as read from ``graceful_exit.json``."""

    exit: bool
    request_id: str | None
    raw: dict


def parse_flag(data: bytes) -> Flag:
    """Parse the flag file's bytes; raises FlagError for anything not a JSON object.

    ``GracefulExit`` keeps MindSpore's meaning: exactly 1 means stop. A missing
    key or any other value means "do not stop", as in ``OnRequestExit``.
    """
    if len(data) > MAX_FILE_BYTES:
        raise FlagError(f"flag file is {len(data)} bytes, more than the {MAX_FILE_BYTES} allowed")
    try:
        obj = loads_bounded(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise FlagError(f"flag file is not valid JSON: {e}") from None
    return flag_from_obj(obj)


def flag_from_obj(obj: Any) -> Flag:
    """The ``Flag`` a parsed JSON value stands for; FlagError unless it is an object."""
    if not isinstance(obj, dict):
        raise FlagError(f"flag file must hold a JSON object, not {type(obj).__name__}")
    value = obj.get(FLAG_KEY)
    exit_ = value == 1 and not isinstance(value, bool)
    rid = obj.get("request_id")
    # An id is only ever compared and shown; one that is not a short string is no id.
    rid = rid if isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID else None
    return Flag(exit=exit_, request_id=rid, raw=obj)


def read_flag(run_dir: str | os.PathLike) -> Flag | None:
    """Read the flag; None if there is none. Raises FlagError if it is garbage."""
    try:
        data = read_capped(flag_path(run_dir))
    except FileNotFoundError:
        return None
    except FileTooLarge as e:
        raise FlagError(str(e)) from None
    return parse_flag(data)


def write_flag(run_dir: str | os.PathLike, exit: bool, **extra: Any) -> dict:
    """Write the flag atomically in MindSpore's format and return what was written.

    Extra keys (request id, time, who, reason) are allowed: native
    ``OnRequestExit`` only looks at ``GracefulExit``.
    """
    obj = {FLAG_KEY: 1 if exit else 0, **extra}
    atomic_write_json(flag_path(run_dir), obj, root=run_dir)
    return obj


def new_request_id() -> str:
    return time.strftime("%Y%m%dT%H%M%S") + "-" + uuid.uuid4().hex[:8]
