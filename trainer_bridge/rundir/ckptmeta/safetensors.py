"""``.safetensors``: a length, a JSON header, then the data (see the package docstring)."""

from __future__ import annotations

import json
import struct
from typing import Any, BinaryIO

from trainer_bridge.rundir.ckptmeta.wire import (
    _CKPT_DTYPES,
    _MAX_ELEMENTS,
    MAX_DIMS,
    MAX_NAME_BYTES,
    SCALAR_MAX_BYTES,
    ParamInfo,
    _Corrupt,
    _decode_scalar,
    _describe_start,
    _elements,
    _Parsed,
    _shape_text,
)

# safetensors' own reader refuses headers above 100 MB; parsing one costs
# about ten times its size in Python objects, so this reader stops at 16 MiB,
# which describes some 300,000 tensors.
SAFETENSORS_MAX_HEADER = 16 * 1024 * 1024


_SAFETENSORS_FORMAT_MAX_HEADER = 100 * 1000 * 1000


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
