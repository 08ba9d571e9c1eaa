"""The wire reader every format shares: bounded reads, protobuf fields, the limits, and the result being built."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

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


# 0-d values kept as ``extras`` (append_dict's few, plus an optimizer's
# scalars), and the text they may hold in all: what one file can make the
# dashboard's cache keep.
MAX_EXTRAS = 64


MAX_EXTRAS_BYTES = 16 * 1024


# Only these single-element values decide where a file stands in training.
_STEP_KEYS = frozenset({"epoch_num", "step_num", "batch_num", "global_step"})


_ENCRYPTED_MAGIC = {b"\xd8^:\x7f": "AES-GCM", b"\xd9^:\x7f": "AES-CBC"}


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


@dataclass(frozen=True)
class ParamInfo:
    """One stored entry: a tensor, a map tensor, or an ``append_dict`` value."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}


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


def _decode_scalar(raw: bytes, dtype: str) -> Any:
    code, item = _CKPT_DTYPES.get(dtype, (None, None))
    if item is None or len(raw) != item:
        return None
    if dtype == "BFloat16":
        return struct.unpack("<f", b"\0\0" + raw)[0]
    return struct.unpack("<" + code, raw)[0]
