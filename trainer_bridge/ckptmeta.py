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
"""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import re
import stat
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from trainer_bridge.rundir import safeio

# Payloads up to this size are read so that scalars can be decoded; anything
# larger is skipped with a seek.
SCALAR_MAX_BYTES = 64
# Strings are metadata (request ids, names) and UTF-32 takes 4 bytes a
# character, so they get a larger budget than numbers.
STRING_MAX_BYTES = 4096
_CHUNK = 64 * 1024

# What the reader believes. Every file in the run directory is untrusted (any
# rank, a buggy one, another user of the storage can write there), so a
# header past these bounds is ``corrupt`` with a reason, found in time and
# memory bounded by the bounds, never by the numbers the file claims.
# numpy (and so MindSpore) allows at most 64 dimensions.
MAX_DIMS = 64
# Parameter names are dotted paths of a few dozen characters.
MAX_NAME_BYTES = 4096
# Entries (tensor slices) in one .ckpt: a per-rank file of even a large
# mixture-of-experts model, optimizer state included, holds some 10^4.
# Bounds the parse time of a file crafted from tiny entries (reading 10^5
# takes about 2-4 s on the 2-core development VM; the cache reads each
# version of a file once).
MAX_ENTRIES = 200_000
# safetensors' own reader refuses headers above 100 MB; parsing one costs
# about ten times its size in Python objects, so this reader stops at 16 MiB,
# which describes some 300,000 tensors.
SAFETENSORS_MAX_HEADER = 16 * 1024 * 1024
_SAFETENSORS_FORMAT_MAX_HEADER = 100 * 1000 * 1000
# 0-d values kept as ``extras`` (append_dict's few, plus an optimizer's
# scalars), and the text they may hold in all: what one file can make the
# dashboard's cache keep.
MAX_EXTRAS = 64
MAX_EXTRAS_BYTES = 16 * 1024
# Only these single-element values decide where a file stands in training.
_STEP_KEYS = frozenset({"epoch_num", "step_num", "batch_num", "global_step"})
_CRC_TRAILER = 17
_ENCRYPTED_MAGIC = {b"\xd8^:\x7f": "AES-GCM", b"\xd9^:\x7f": "AES-CBC"}

FORMATS = {".ckpt": "ckpt", ".safetensors": "safetensors", ".mindir": "mindir"}

# MindSpore dtype name -> (struct code, item size). BFloat16 and Int4 have no
# struct code; BFloat16 is decoded by hand, Int4 packs two values a byte.
_CKPT_DTYPES = {
    "Bool": ("?", 1),
    "Int8": ("b", 1),
    "UInt8": ("B", 1),
    "Int16": ("h", 2),
    "UInt16": ("H", 2),
    "Int32": ("i", 4),
    "UInt32": ("I", 4),
    "Int64": ("q", 8),
    "UInt64": ("Q", 8),
    "Float16": ("e", 2),
    "Float32": ("f", 4),
    "Float64": ("d", 8),
    "BFloat16": (None, 2),
    "Int4": (None, None),
    "str": (None, None),
}
# safetensors dtype -> MindSpore name, so both formats report alike.
_SAFETENSORS_DTYPES = {
    "BOOL": "Bool",
    "I8": "Int8",
    "U8": "UInt8",
    "I16": "Int16",
    "U16": "UInt16",
    "I32": "Int32",
    "U32": "UInt32",
    "I64": "Int64",
    "U64": "UInt64",
    "F16": "Float16",
    "BF16": "BFloat16",
    "F32": "Float32",
    "F64": "Float64",
}
# safetensors dtypes MindSpore has no name for; kept as-is, sizes for checks.
_SAFETENSORS_OTHER_SIZES = {
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E8M0": 1,
    "C64": 8,
    "C128": 16,
}

log = logging.getLogger(__name__)

_NAME_RE = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.(?:ckpt|safetensors)$")
# The MindIO TTP docs say tft_, MindSpore 2.10's code writes ttp_.
TTP_STEP_DIR_RE = re.compile(r"^(?:tft|ttp)_saved_checkpoints-step_(?P<global_step>\d+)$")


@dataclass(frozen=True)
class ParamInfo:
    """One stored entry: a tensor, a map tensor, or an ``append_dict`` value."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}


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


class _Corrupt(Exception):
    """The file is not what its name says; the message is the reason."""


@dataclass
class _Parsed:
    """A parser's findings before the step is worked out.

    ``params`` is kept only when asked for (``read_meta(with_params=True)``);
    the count and the byte total always are, so a scan's memory does not grow
    with the number of entries in a file.
    """

    params: list[ParamInfo] | None = None
    scalars: dict = field(default_factory=dict)  # step keys -> decoded single-element values
    extras: dict = field(default_factory=dict)
    encrypted: str | None = None
    counted: bool = True  # False when params could not be read (mindir, encrypted)
    count: int = 0
    total_bytes: int = 0
    _extras_bytes: int = 0

    def add(self, param: ParamInfo) -> None:
        self.count += 1
        self.total_bytes += param.bytes
        if self.params is not None:
            self.params.append(param)

    def value(self, name: str, value: Any, zero_d: bool) -> None:
        """Keep a decoded single-element value: for the step, and as an extra if 0-d, within budget."""
        if name in _STEP_KEYS:
            self.scalars[name] = value
        if not zero_d or len(self.extras) >= MAX_EXTRAS:
            return
        cost = len(name) + (len(value) if isinstance(value, str) else 8)
        if self._extras_bytes + cost <= MAX_EXTRAS_BYTES:
            self.extras[name] = value
            self._extras_bytes += cost


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


def _describe_start(head: bytes) -> str:
    """A guess at what a non-checkpoint file is, for the reason text."""
    stripped = head.lstrip()
    if stripped[:1] in (b"{", b"["):
        return "it looks like JSON"
    if len(head) >= 9 and head[8:9] == b"{":
        return "it looks like safetensors (wrong extension?)"
    if head[:2] == b"PK":
        return "it looks like a zip archive"
    return f"it starts with {head[:8]!r}"


# -- protobuf wire format ----------------------------------------------------


class _Stream:
    """Forward reader over the first ``end`` bytes of a file, with seeks to skip.

    Reads go through a 64 KiB buffer, so a small file costs one read and a
    big one a read per entry header; skipped payloads are never read.
    """

    def __init__(self, f: BinaryIO, end: int):
        self._f = f
        self.end = end
        self.pos = 0
        self._buf = b""
        self._buf_at = 0

    def _window(self, n: int) -> tuple[bytes, int]:
        """The buffer and the offset of ``pos`` in it, holding ``n`` bytes if the file does."""
        off = self.pos - self._buf_at
        if off < 0 or off + n > len(self._buf):
            self._f.seek(self.pos)
            self._buf = self._f.read(max(n, _CHUNK))
            self._buf_at = self.pos
            off = 0
        return self._buf, off

    def peek(self, n: int) -> bytes:
        buf, off = self._window(n)
        return buf[off : off + n]

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes of ``what``; truncated if the file ends first."""
        if self.pos + n > self.end:
            raise _Corrupt(f"truncated: {what} needs {n} bytes, {self.end - self.pos} left")
        data = self.peek(n)
        if len(data) < n:
            raise _Corrupt("truncated: the file shrank while it was being read")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if self.pos + n > self.end:
            raise _Corrupt(f"truncated: {what} needs {n} bytes, {self.end - self.pos} left")
        self.pos += n

    def varint(self, what: str) -> int:
        # Keys, short lengths and dims are single bytes; skip the general path for them.
        off = self.pos - self._buf_at
        if self.pos < self.end and 0 <= off < len(self._buf) and self._buf[off] < 0x80:
            self.pos += 1
            return self._buf[off]
        avail = min(10, self.end - self.pos)
        raw = self.peek(avail)
        result = shift = 0
        for i, b in enumerate(raw):
            result |= (b & 0x7F) << shift
            if b < 0x80:
                self.pos += i + 1
                return result
            shift += 7
        if avail < 10:
            raise _Corrupt(f"truncated: {what} is cut off at byte {self.end}")
        raise _Corrupt(f"not a checkpoint: malformed number in {what} at byte {self.pos}")


# Fields in one message: a Value has 2, a TensorProto 3 plus at most MAX_DIMS
# dims; this stops a message padded with millions of unknown fields.
MAX_FIELDS = 4096


def _fields(s: _Stream, end: int, what: str, limit: int = MAX_FIELDS):
    """Yield ``(field number, wire type, value)`` for each field of a message ending at ``end``.

    For a length-delimited field ``value`` is its length and the stream is
    left at its payload: the caller must take or skip exactly that many bytes.
    A varint field yields its value; fixed-size fields are skipped. ``end``
    may lie past the end of the file when an enclosing message was cut: the
    innermost reader then reports the truncation, naming what it was reading.
    """
    count = 0
    while s.pos < end:
        if s.pos >= s.end:
            raise _Corrupt(f"truncated: {what} is cut off at byte {s.end}")
        count += 1
        if count > limit:
            raise _Corrupt(f"not a checkpoint: {what} has more than {limit} fields")
        at = s.pos
        key = s.varint(what)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise _Corrupt(f"not a checkpoint: invalid protobuf field 0 at byte {at}")
        if wire == 0:
            yield number, wire, s.varint(what)
        elif wire == 1 or wire == 5:
            s.skip(8 if wire == 1 else 4, what)
            yield number, wire, 0
        elif wire == 2:
            length = s.varint(what)
            if s.pos + length > end and end <= s.end:
                raise _Corrupt(
                    f"not a checkpoint: {what} claims {length} bytes, but only {end - s.pos} remain in it"
                )
            yield number, wire, length
        else:
            raise _Corrupt(f"not a checkpoint: invalid protobuf wire type {wire} at byte {at}")


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _Corrupt(f"not a checkpoint: {what} is not text") from None


# -- .ckpt -------------------------------------------------------------------


@dataclass
class _Tensor:
    dims: list[int]
    dtype: str | None
    size: int
    content: bytes | None  # only when small enough to decode


def _read_tensor(s: _Stream, end: int, what: str, keep: int) -> _Tensor:
    """Parse a TensorProto; the content is read only if it is at most ``keep`` bytes."""
    t = _Tensor(dims=[], dtype=None, size=-1, content=None)
    for number, wire, value in _fields(s, end, what):
        if number == 1 and wire == 0:
            t.dims.append(_signed64(value))
            _check_dims(t.dims, what)
        elif number == 1 and wire == 2:  # packed dims, as a proto3 writer would emit
            stop = s.pos + value
            while s.pos < stop:
                t.dims.append(_signed64(s.varint(what)))
                _check_dims(t.dims, what)
        elif number == 2 and wire == 2:
            if value > 64:
                raise _Corrupt(f"not a checkpoint: {what} has a {value}-byte type name")
            t.dtype = _utf8(s.take(value, what), f"the type of {what}")
        elif number == 3 and wire == 2:
            t.size = value
            if value <= (STRING_MAX_BYTES if t.dtype == "str" else keep):
                t.content = s.take(value, what)
            else:
                s.skip(value, what)
        elif wire == 2:
            s.skip(value, what)
    if t.dtype is None or t.size < 0:
        raise _Corrupt(f"not a checkpoint: {what} has no {'type' if t.dtype is None else 'content'}")
    if any(d < 0 for d in t.dims):
        raise _Corrupt(f"not a checkpoint: {what} has a negative dimension {_shape_text(t.dims)}")
    return t


def _check_dims(dims: list, what: str) -> None:
    """Refuse a tensor with more dimensions than numpy has, before reading the rest."""
    if len(dims) > MAX_DIMS:
        raise _Corrupt(f"not a checkpoint: {what} has more than {MAX_DIMS} dimensions")


def _shape_text(shape) -> str:
    """A shape for a reason: a few dims, then how many there are, never a giant list."""
    shape = list(shape)
    if len(shape) <= 8:
        return str(shape)
    return "[" + ", ".join(map(str, shape[:4])) + f", ... ({len(shape)} dimensions)]"


# No file holds more elements than this; a shape past it is refused before
# its product is computed in full (64 dims of 2^62 make a 3,968-bit number).
_MAX_ELEMENTS = 1 << 64


def _elements(shape, limit: int) -> int | None:
    """The element count of ``shape``, or None once it passes ``limit`` (no giant products)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > limit:
            return None
    return n


def _parse_ckpt(f: BinaryIO, size: int, out: _Parsed) -> None:
    f.seek(0)
    head = f.read(16)
    if head[:4] in _ENCRYPTED_MAGIC:
        out.encrypted, out.counted = _ENCRYPTED_MAGIC[head[:4]], False
        return
    if head[:1] != b"\n":  # every entry is field 1, length-delimited
        raise _Corrupt(f"not a checkpoint: {_describe_start(head)}")
    end = size
    if size >= _CRC_TRAILER:
        f.seek(size - _CRC_TRAILER)
        if f.read(7) == b"crc_num":
            end = size - _CRC_TRAILER
    s = _Stream(f, end)
    merger = _Merger(out)
    index = 0
    while s.pos < end:
        left = s.peek(min(7, end - s.pos))
        if end - s.pos < _CRC_TRAILER and b"crc_num".startswith(left):
            raise _Corrupt(f"truncated: the CRC trailer is cut off ({end - s.pos} of {_CRC_TRAILER} bytes)")
        if index >= MAX_ENTRIES:
            raise _Corrupt(f"not a checkpoint: more than {MAX_ENTRIES} entries")
        at = s.pos
        key = s.varint("the checkpoint")
        if key != 0x0A:
            raise _Corrupt(f"not a checkpoint: unexpected protobuf key {key} at byte {at}")
        length = s.varint(f"entry {index}")
        merger.push(*_read_value(s, s.pos + length, index))
        index += 1
    merger.flush()


def _read_value(s: _Stream, end: int, index: int) -> tuple[str, _Tensor | None, int]:
    """Parse one ``Value``: its tag and its tensor, or the byte total of a map tensor."""
    tag = None
    tensor = None
    map_bytes = -1
    for number, wire, value in _fields(s, end, f"entry {index}"):
        what = f"tensor {tag!r}" if tag is not None else f"entry {index}"
        if number == 1 and wire == 2:
            if value > MAX_NAME_BYTES:
                raise _Corrupt(f"not a checkpoint: entry {index} has a {value}-byte name")
            tag = _utf8(s.take(value, what), f"the name of entry {index}")
        elif number == 2 and wire == 2:
            tensor = _read_tensor(s, s.pos + value, what, SCALAR_MAX_BYTES)
            if tensor.dtype not in _CKPT_DTYPES:
                raise _Corrupt(f"not a checkpoint: {what} has unknown type {tensor.dtype!r}")
        elif number == 3 and wire == 2:
            # Map tensors carry numpy dtype names ("float32"), so types are not checked.
            map_bytes = 0
            stop = s.pos + value
            for n2, w2, v2 in _fields(s, stop, what):
                if n2 == 1 and w2 == 2:
                    map_bytes += _read_tensor(s, s.pos + v2, what, 0).size
                elif w2 == 2:
                    s.skip(v2, what)
        elif wire == 2:
            s.skip(value, what)
    if tag is None:
        raise _Corrupt(f"not a checkpoint: entry {index} has no name")
    if tensor is None and map_bytes < 0:
        raise _Corrupt(f"not a checkpoint: entry {tag!r} holds no tensor")
    return tag, tensor, map_bytes


class _Merger:
    """Joins the slices of split tensors and decodes the small values, as load_checkpoint does.

    Entries arrive one at a time and only the current run of one tag is
    held, so memory does not grow with the entries of a file.
    """

    def __init__(self, out: _Parsed):
        self.out = out
        self._tag: str | None = None
        self._first: _Tensor | None = None
        self._total = 0
        self._pieces = 0

    def push(self, tag: str, tensor: _Tensor | None, map_bytes: int) -> None:
        if tensor is not None and self._first is not None and tag == self._tag:
            self._total += tensor.size
            self._pieces += 1
            return
        self.flush()
        if tensor is None:
            self.out.add(ParamInfo(tag, (), "MapTensor", map_bytes))
            return
        self._tag, self._first, self._total, self._pieces = tag, tensor, tensor.size, 1

    def flush(self) -> None:
        tag, tensor, total, pieces = self._tag, self._first, self._total, self._pieces
        self._tag, self._first = None, None
        if tensor is None:
            return
        if tensor.dtype == "str":
            if tensor.content is not None and pieces == 1:
                self.out.value(tag, _decode_str(tensor.content, tag), zero_d=True)
            return
        # load_checkpoint reads dims [0] as a scalar; mirror it so shapes agree.
        shape = () if tensor.dims == [0] else tuple(tensor.dims)
        _check_size(tag, shape, tensor.dtype, total)
        self.out.add(ParamInfo(tag, shape, tensor.dtype, total))
        if pieces == 1 and tensor.content is not None and _elements(shape, 1) == 1:
            value = _decode_scalar(tensor.content, tensor.dtype)
            if value is not None:
                self.out.value(tag, value, zero_d=shape == ())


def _decode_str(raw: bytes, tag: str) -> str:
    """MindSpore stores a str as a numpy unicode array: UTF-32-LE, NUL-padded."""
    if len(raw) % 4:
        raise _Corrupt(f"not a checkpoint: string {tag!r} has {len(raw)} bytes, not a multiple of 4")
    try:
        return raw.decode("utf-32-le").rstrip("\0")
    except UnicodeDecodeError:
        raise _Corrupt(f"not a checkpoint: string {tag!r} is not valid text") from None


def _check_size(tag: str, shape: tuple[int, ...], dtype: str, total: int) -> None:
    """The stored bytes must be exactly what the shape needs; the need is never computed past them."""
    item = _CKPT_DTYPES.get(dtype, (None, None))[1]
    if item is None:
        return
    count = _elements(shape, _MAX_ELEMENTS)
    if count is None:
        raise _Corrupt(
            f"not a checkpoint: tensor {tag!r} {dtype}{_shape_text(shape)} claims more than 2^64 "
            f"elements, more than the file holds ({total} bytes)"
        )
    need = count * item
    if need != total:
        raise _Corrupt(
            f"truncated: tensor {tag!r} {dtype}{_shape_text(shape)} needs {need} bytes, the file holds {total}"
            if total < need
            else f"not a checkpoint: tensor {tag!r} {dtype}{_shape_text(shape)} needs {need} bytes "
            f"but holds {total}"
        )


def _decode_scalar(raw: bytes, dtype: str) -> Any:
    code, item = _CKPT_DTYPES.get(dtype, (None, None))
    if item is None or len(raw) != item:
        return None
    if dtype == "BFloat16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return struct.unpack("<" + code, raw)[0]


# -- .safetensors ------------------------------------------------------------


def _parse_safetensors(f: BinaryIO, size: int, out: _Parsed) -> None:
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise _Corrupt(f"truncated: the safetensors header length needs 8 bytes, {len(head)} present")
    (n,) = struct.unpack("<Q", head)
    if n > _SAFETENSORS_FORMAT_MAX_HEADER:
        raise _Corrupt(f"not a checkpoint: {_describe_start(head)}")
    if 8 + n > size:
        raise _Corrupt(f"truncated: the safetensors header needs {n} bytes, {size - 8} left")
    if n > SAFETENSORS_MAX_HEADER:
        raise _Corrupt(
            f"not a checkpoint: a {n}-byte safetensors header, more than the {SAFETENSORS_MAX_HEADER} "
            "this reader accepts"
        )
    raw = f.read(n)
    if raw[:1] != b"{":
        raise _Corrupt(f"not a checkpoint: {_describe_start(head + raw[:8])}")
    try:
        header = json.loads(raw)
    except RecursionError:
        raise _Corrupt("not a checkpoint: the safetensors header is nested too deeply") from None
    except ValueError as e:
        raise _Corrupt(f"not a checkpoint: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _Corrupt("not a checkpoint: the safetensors header is not a JSON object")
    meta = header.pop("__metadata__", None)
    meta = meta if isinstance(meta, dict) else {}
    data_start = 8 + n
    small: list[tuple[str, str, int, int, bool]] = []
    for name, entry in header.items():
        shape, st_dtype, begin, stop = _safetensors_entry(name, entry)
        dtype = "Int4" if meta.get(name) == "Int4" else _SAFETENSORS_DTYPES.get(st_dtype, st_dtype)
        if begin + data_start > size or stop + data_start > size:
            left = max(0, size - data_start - begin)
            raise _Corrupt(f"truncated: tensor {name!r} needs {stop - begin} bytes, {left} left")
        item = _SAFETENSORS_OTHER_SIZES.get(st_dtype) or _CKPT_DTYPES.get(dtype, (None, None))[1]
        if item is not None and dtype != "Int4":
            count = _elements(shape, _MAX_ELEMENTS)
            if count is None or count * item != stop - begin:
                raise _Corrupt(
                    f"not a checkpoint: tensor {name[:200]!r} {dtype}{_shape_text(shape)} "
                    + (
                        f"claims more than 2^64 elements, more than the file holds ({size} bytes)"
                        if count is None
                        else f"needs {count * item} bytes but holds {stop - begin}"
                    )
                )
        out.add(ParamInfo(name, shape, dtype, stop - begin))
        if stop - begin <= SCALAR_MAX_BYTES and _elements(shape, 1) == 1:
            small.append((name, dtype, begin, stop, shape == ()))
    for name, dtype, begin, stop, zero_d in sorted(small, key=lambda x: x[2]):
        f.seek(data_start + begin)
        value = _decode_scalar(f.read(stop - begin), dtype)
        if value is not None:
            out.value(name, value, zero_d=zero_d)


def _safetensors_entry(name: str, entry: Any) -> tuple[tuple[int, ...], str, int, int]:
    """Validate one header entry and return (shape, dtype, begin, end)."""
    bad = f"not a checkpoint: the safetensors entry {name[:200]!r} is malformed"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise _Corrupt(f"not a checkpoint: a safetensors entry has a {len(name)}-character name")
    if not isinstance(entry, dict):
        raise _Corrupt(bad)
    shape, dtype, offsets = entry.get("shape"), entry.get("dtype"), entry.get("data_offsets")
    if isinstance(shape, list) and len(shape) > MAX_DIMS:
        raise _Corrupt(f"not a checkpoint: tensor {name[:200]!r} has more than {MAX_DIMS} dimensions")
    if (
        not isinstance(shape, list)
        or not all(type(d) is int and d >= 0 for d in shape)
        or not isinstance(dtype, str)
        or len(dtype) > 64
        or not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _Corrupt(bad)
    return tuple(shape), dtype, offsets[0], offsets[1]


# -- .mindir -----------------------------------------------------------------

# ModelProto's string fields worth showing; the graph (field 7) is skipped.
_MINDIR_STRINGS = {1: "ir_version", 2: "producer_name", 3: "producer_version", 5: "model_version"}
_MINDIR_MAX_FIELD = 14


def _parse_mindir(f: BinaryIO, size: int, out: _Parsed) -> None:
    out.counted = False
    try:
        _read_mindir(f, size, out)
    except _Corrupt as e:
        raise _Corrupt(str(e).replace("not a checkpoint:", "not a MindIR model:", 1)) from None


def _read_mindir(f: BinaryIO, size: int, out: _Parsed) -> None:
    f.seek(0)
    head = f.read(16)
    if head[:4] in _ENCRYPTED_MAGIC:
        out.encrypted = _ENCRYPTED_MAGIC[head[:4]]
        return
    s = _Stream(f, size)
    extras = out.extras
    seen = 0
    for number, wire, length in _fields(s, size, "the model", MAX_ENTRIES):
        if number > _MINDIR_MAX_FIELD:
            raise _Corrupt(f"not a MindIR model: {_describe_start(head)}")
        seen += 1
        if wire == 2 and number in _MINDIR_STRINGS and length <= 256:
            extras[_MINDIR_STRINGS[number]] = s.take(length, "the model").decode("utf-8", "replace")
        elif wire == 2:
            s.skip(length, "the model")
    if not seen:
        raise _Corrupt("not a MindIR model: no protobuf fields")


_PARSERS = {"ckpt": _parse_ckpt, "safetensors": _parse_safetensors, "mindir": _parse_mindir}


# -- where a file stands in training ---------------------------------------


def steps_from_name(path: str | os.PathLike) -> tuple[int | None, int | None, int | None]:
    """``(epoch, step_in_epoch, global_step)`` from a path, each None if absent.

    ``{prefix}-{epoch}_{step}.ckpt`` is ModelCheckpoint's name (TTP's
    ``ttp_rank_{r}-{E}_{S}.ckpt`` and the bridge's follow it); a TTP
    ``tft_saved_checkpoints-step_{G}`` directory up to two levels above the
    file gives the global step.
    """
    path = os.fspath(path)
    name = os.path.basename(path)
    m = _NAME_RE.match(name)
    epoch, step = (int(m["epoch"]), int(m["step"])) if m else (None, None)
    global_step = None
    parent = os.path.dirname(path)
    for _ in range(2):
        parent, part = os.path.split(parent)
        g = TTP_STEP_DIR_RE.match(part)
        if g:
            global_step = int(g["global_step"])
            break
    return epoch, step, global_step


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _resolve_step(
    path: str, scalars: dict, fmt: str
) -> tuple[int | None, int | None, int | None, str | None]:
    """Epoch, step in epoch and global step: the contents first, the name for gaps.

    MindSpore's callbacks store ``epoch_num``, ``step_num`` (cumulative, not
    within the epoch), ``batch_num`` (steps per epoch) and ``global_step``.
    A one-element ``global_step`` is also what an optimizer keeps, and what
    ``OnRequestExit`` itself reports as the global step.
    """
    if fmt == "mindir":
        return None, None, None, None
    epoch = _as_int(scalars.get("epoch_num"))
    step_num = _as_int(scalars.get("step_num"))
    batch_num = _as_int(scalars.get("batch_num"))
    global_step = _as_int(scalars.get("global_step"))
    if global_step is None:
        global_step = step_num
    step = (step_num - 1) % batch_num + 1 if step_num and batch_num and batch_num > 0 else None
    from_contents = global_step is not None or (epoch is not None and step is not None)
    n_epoch, n_step, n_global = steps_from_name(path)
    epoch = epoch if epoch is not None else n_epoch
    step = step if step is not None else n_step
    global_step = global_step if global_step is not None else n_global
    if from_contents:
        return epoch, step, global_step, "contents"
    if epoch is not None or step is not None or global_step is not None:
        return epoch, step, global_step, "name"
    return None, None, None, None


# -- cache -------------------------------------------------------------------


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
