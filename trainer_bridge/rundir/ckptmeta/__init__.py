"""Checkpoint metadata without loading tensors: names, shapes, dtypes, step.

The dashboard imports this module, so it must not import mindspore (or rely
on the protobuf runtime): it parses the formats by hand with the standard
library. ``read_meta`` streams a file and seeks over every tensor payload
except tiny ones (the scalars ``append_dict`` stores), so a 1 GB checkpoint
costs a handful of small reads.

Formats, as MindSpore 2.10 writes them:

``.ckpt``
    A concatenation of serialised ``Checkpoint`` protobuf messages
    (``mindspore/train/checkpoint_pb2.py``)::

        Checkpoint     { repeated Value value = 1; }
        Value          { required string tag = 1;
                         oneof value { TensorProto tensor = 2; MapTensorProto maptensor = 3; } }
        TensorProto    { repeated int64 dims = 1; required string tensor_type = 2;
                         required bytes tensor_content = 3; }
        MapTensorProto { repeated TensorProto tensor = 1; }

    A tensor over 512 MiB is split into several consecutive ``Value``\\ s with
    the same tag, each carrying the full dims. ``append_dict`` values are
    ordinary entries after the parameters: an int is a 0-d ``Int64``, a float
    a 0-d ``Float32``, a bool a 0-d ``Bool``, and a str has type ``str``, dims
    ``[0]`` and UTF-32-LE content. With ``crc_check=True`` the file ends in
    ``b"crc_num"`` plus 10 big-endian bytes, which is not protobuf and must be
    cut off before parsing. Encrypted files start with a 4-byte magic.
``.safetensors``
    8-byte little-endian header length, a JSON header, then the data.
    ``append_dict`` values are ordinary 0-d tensors in the header (not in
    ``__metadata__``, which only holds ``{"format": "ms"}``, a CRC, or
    ``{name: "Int4"}`` for 4-bit parameters). MindSpore cannot save a str
    ``append_dict`` value in this format (``save_checkpoint`` raises).
``.mindir``
    A ``ModelProto``; it is only checked to be well-formed protobuf.

Limits: a file cut exactly between two ckpt entries is well-formed protobuf
and reads as ``ok`` with fewer entries; only a CRC trailer could tell, and
checking it means reading every byte. A 0-d network parameter (for example an
optimizer's ``learning_rate``) is stored exactly like an ``append_dict``
value, so it shows up in ``extras`` too.

The package: ``read_meta`` and ``MetaCache`` here; ``wire`` (bounded reads,
protobuf fields, the limits), one module per format (``ckpt``,
``safetensors``, ``mindir``, each a parser in ``_PARSERS``), and ``steps``
(which step a file holds).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from trainer_bridge.rundir import safeio
from trainer_bridge.rundir.ckptmeta.ckpt import _parse_ckpt
from trainer_bridge.rundir.ckptmeta.mindir import _parse_mindir
from trainer_bridge.rundir.ckptmeta.safetensors import _parse_safetensors
from trainer_bridge.rundir.ckptmeta.steps import _resolve_step
from trainer_bridge.rundir.ckptmeta.wire import ParamInfo, _Corrupt, _Parsed

FORMATS = {".ckpt": "ckpt", ".safetensors": "safetensors", ".mindir": "mindir"}


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``read_meta`` learnt about one file.

    ``status`` is ``"ok"`` or ``"corrupt"``; ``reason`` says why in a sentence
    when corrupt. ``epoch`` and ``step`` follow MindSpore's file names
    (``step`` counts within the epoch, 1-based); ``global_step`` counts from
    the start of the job. ``step_source`` is ``"contents"`` when the file
    itself said where it stands (missing parts filled in from the name),
    ``"name"`` when only its path did, else None. ``param_count`` and
    ``param_bytes`` are None when they cannot be known (mindir, encrypted).
    """

    path: str
    format: str | None
    bytes: int
    mtime: float
    status: str
    reason: str | None = None
    param_count: int | None = None
    param_bytes: int | None = None
    extras: dict = field(default_factory=dict)
    epoch: int | None = None
    step: int | None = None
    global_step: int | None = None
    step_source: str | None = None
    encrypted: str | None = None
    params: tuple[ParamInfo, ...] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def to_dict(self) -> dict:
        """A JSON-ready dict; non-finite floats become strings, as JSON has none."""
        return {
            "path": self.path,
            "format": self.format,
            "bytes": self.bytes,
            "mtime": self.mtime,
            "status": self.status,
            "reason": self.reason,
            "param_count": self.param_count,
            "param_bytes": self.param_bytes,
            "extras": {k: _json_safe(v) for k, v in self.extras.items()},
            "epoch": self.epoch,
            "step": self.step,
            "global_step": self.global_step,
            "step_source": self.step_source,
            "encrypted": self.encrypted,
            "params": None if self.params is None else [p.to_dict() for p in self.params],
        }


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def read_meta(path: str | os.PathLike, with_params: bool = False, fd: int | None = None) -> CheckpointMeta:
    """Read a checkpoint's metadata; never raises for a bad or unreadable file.

    The format comes from the extension; an unknown extension is sniffed
    (safetensors if the header looks like one, else ckpt). ``with_params``
    adds the per-entry list, which the index does not need. A corrupt file
    still gets the epoch and step its name carries, so it can be shown
    beside its peers. ``fd``: read this open descriptor (a duplicate of it;
    the caller keeps its own) instead of opening ``path``, which then only
    names the file.
    """
    path = os.fspath(path)
    fmt = FORMATS.get(os.path.splitext(path)[1].lower())
    try:
        f = _open(path) if fd is None else os.fdopen(os.dup(fd), "rb")
    except safeio.NotRegular:
        return _corrupt(path, fmt, "not a checkpoint: not a regular file")
    except OSError as e:
        return _corrupt(path, fmt, _unreadable(e))
    with f:
        try:
            st = os.fstat(f.fileno())
        except OSError as e:
            return _corrupt(path, fmt, _unreadable(e))
        if not stat.S_ISREG(st.st_mode):
            return _corrupt(path, fmt, "not a checkpoint: not a regular file", st)
        if st.st_size == 0:
            return _corrupt(path, fmt, "empty file", st)
        try:
            if fmt is None:
                fmt = _sniff(f)
            parsed = _Parsed(params=[] if with_params else None)
            _PARSERS[fmt](f, st.st_size, parsed)
        except _Corrupt as e:
            return _corrupt(path, fmt, str(e), st)
        except OSError as e:
            return _corrupt(path, fmt, _unreadable(e), st)
        except (ValueError, RecursionError, MemoryError, OverflowError, struct.error) as e:
            # A case the checks above missed. The bridge resumes from what this
            # reader says and must never crash on a file, so the file is
            # corrupt, and the log keeps the traceback of the gap.
            log.warning("ckptmeta: unexpected %s reading %s", type(e).__name__, path, exc_info=True)
            return _corrupt(
                path, fmt, f"not a checkpoint: the reader could not parse it ({type(e).__name__})", st
            )
    epoch, step, global_step, source = _resolve_step(path, parsed.scalars, fmt)
    return CheckpointMeta(
        path=path,
        format=fmt,
        bytes=st.st_size,
        mtime=st.st_mtime,
        status="ok",
        param_count=parsed.count if parsed.counted else None,
        param_bytes=parsed.total_bytes if parsed.counted else None,
        extras=parsed.extras,
        epoch=epoch,
        step=step,
        global_step=global_step,
        step_source=source,
        encrypted=parsed.encrypted,
        params=tuple(parsed.params) if with_params and parsed.counted else None,
    )


def _open(path: str) -> BinaryIO:
    """Open without blocking or following a symlink: a FIFO named like a checkpoint must not hang a scan."""
    fd, _ = safeio.open_regular(path)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _corrupt(path: str, fmt: str | None, reason: str, st: os.stat_result | None = None) -> CheckpointMeta:
    """The result for a bad file; ``st`` is None when the file could not even be opened."""
    if st is None:
        try:
            st = os.stat(path)
        except OSError:
            pass
    epoch, step, global_step, source = _resolve_step(path, {}, fmt)
    return CheckpointMeta(
        path=path,
        format=fmt,
        bytes=st.st_size if st else 0,
        mtime=st.st_mtime if st else 0.0,
        status="corrupt",
        reason=reason,
        epoch=epoch,
        step=step,
        global_step=global_step,
        step_source=source,
    )


def _unreadable(e: OSError) -> str:
    if e.errno in (errno.EACCES, errno.EPERM):
        return "unreadable: permission denied"
    if e.errno == errno.ENOENT:
        return "unreadable: the file vanished"
    return f"unreadable: {(e.strerror or str(e)).lower()}"


def _sniff(f: BinaryIO) -> str:
    head = f.read(9)
    return "safetensors" if len(head) == 9 and head[8:9] == b"{" else "ckpt"


_PARSERS = {"ckpt": _parse_ckpt, "safetensors": _parse_safetensors, "mindir": _parse_mindir}


class MetaCache:
    """A bounded LRU of ``read_meta`` results keyed by (path, size, mtime_ns).

    A file that has not changed size or mtime is not opened again, so a
    repeated scan of thousands of checkpoints costs one ``stat`` each. The
    lock makes it safe to share between the dashboard's threads.
    """

    def __init__(self, maxsize: int = 50_000):
        if maxsize < 1:
            raise ValueError(f"MetaCache: maxsize must be at least 1, got {maxsize}")
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[str, tuple[tuple[int, int], CheckpointMeta]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def read(self, path: str | os.PathLike, st: os.stat_result | None = None) -> CheckpointMeta:
        """``read_meta(path)``, or the cached result if the file is unchanged.

        ``st`` is the file's stat if the caller already has it (a scan does).
        """
        path = os.fspath(path)
        if st is None:
            try:
                st = os.stat(path)
            except OSError:
                return read_meta(path)
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            hit = self._items.get(path)
            if hit is not None and hit[0] == key:
                self._items.move_to_end(path)
                self.hits += 1
                return hit[1]
        meta = read_meta(path)
        with self._lock:
            self.misses += 1
            self._items[path] = (key, meta)
            self._items.move_to_end(path)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)
        return meta


# Re-exported: the names other modules and tests use.
from trainer_bridge.rundir.ckptmeta.steps import TTP_STEP_DIR_RE, steps_from_name  # noqa: E402,F401
from trainer_bridge.rundir.ckptmeta.wire import MAX_DIMS, MAX_FIELDS, _Stream  # noqa: E402,F401
