"""``.ckpt``: concatenated ``Checkpoint`` protobuf messages (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

from trainer_bridge.rundir.ckptmeta.wire import (
    _CKPT_DTYPES,
    _ENCRYPTED_MAGIC,
    _MAX_ELEMENTS,
    MAX_ENTRIES,
    MAX_NAME_BYTES,
    SCALAR_MAX_BYTES,
    STRING_MAX_BYTES,
    ParamInfo,
    _check_dims,
    _Corrupt,
    _decode_scalar,
    _describe_start,
    _elements,
    _fields,
    _Parsed,
    _shape_text,
    _signed64,
    _Stream,
    _utf8,
)

_CRC_TRAILER = 17


def entries_end(f: BinaryIO, size: int) -> int:
    """Where a ``.ckpt``'s entries end: before MindSpore's ``crc_num`` trailer (17 bytes), if it has one."""
    if size >= _CRC_TRAILER:
        f.seek(size - _CRC_TRAILER)
        if f.read(7) == b"crc_num":
            return size - _CRC_TRAILER
    return size


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


def _parse_ckpt(f: BinaryIO, size: int, out: _Parsed) -> None:
    f.seek(0)
    head = f.read(16)
    if head[:4] in _ENCRYPTED_MAGIC:
        out.encrypted, out.counted = _ENCRYPTED_MAGIC[head[:4]], False
        return
    if head[:1] != b"\n":  # every entry is field 1, length-delimited
        raise _Corrupt(f"not a checkpoint: {_describe_start(head)}")
    end = entries_end(f, size)
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
