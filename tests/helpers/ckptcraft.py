"""Checkpoint files crafted byte by byte, as a hostile or buggy writer could leave them.

``.ckpt`` is protobuf (``Checkpoint { repeated Value { tag, TensorProto { dims,
tensor_type, tensor_content } } }``, see ``trainer_bridge/rundir/ckptmeta.py``) and
``.safetensors`` an 8-byte length plus a JSON header; these helpers write
either with any dims, shapes, types and lengths a test wants, including
ones no MindSpore would write. The security tests and the fuzz suite share
them; nothing here imports mindspore.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path


def varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # protobuf's int64 negative numbers are 10-byte two's complement
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def tensor(dims: Iterable[int], dtype: str, content: bytes, *, packed: bool = False) -> bytes:
    dims = list(dims)
    if packed:
        head = field(1, b"".join(varint(d) for d in dims)) if dims else b""
    else:
        head = b"".join(varint(1 << 3) + varint(d) for d in dims)
    return head + field(2, dtype.encode()) + field(3, content)


def entry(tag: str | bytes, tensor_bytes: bytes) -> bytes:
    """One ``Value`` of a Checkpoint: field 1 of the file."""
    tag = tag.encode() if isinstance(tag, str) else tag
    return field(1, field(1, tag) + field(2, tensor_bytes))


def scalar_int(tag: str, value: int) -> bytes:
    return entry(tag, tensor([], "Int64", struct.pack("<q", value)))


def ckpt(*entries: bytes, global_step: int | None = None) -> bytes:
    """A .ckpt body: the entries, then (like the bridge's append_dict) a global step."""
    body = b"".join(entries)
    if global_step is not None:
        body += scalar_int("global_step", global_step)
    return body


def safetensors(header: dict | bytes, data: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# The headers of the security review (issue 13, item 1), each a few KB at most.
HOSTILE_CKPT = {
    "300 dims of 2^62": ckpt(entry("w", tensor([2**62] * 300, "Float32", b"\0" * 4))),
    "50000 dims": ckpt(entry("w", tensor([2**62] * 50_000, "Float32", b"\0" * 4))),
    "50000 packed dims": ckpt(entry("w", tensor([3] * 50_000, "Float32", b"\0" * 4, packed=True))),
    "product overflows int64": ckpt(entry("w", tensor([2**40, 2**40], "Float32", b"\0" * 4))),
    "claims more than the file": ckpt(entry("w", tensor([40000, 40000], "Float32", b"\0" * 64))),
    # The review's file: MindSpore 2.10 loads it as a 6.4 GB zero tensor and calls it fine.
    "40000x40000 in 26 bytes": ckpt(entry("w", tensor([40000, 40000], "Float32", b""))),
    "negative dim": ckpt(entry("w", tensor([-1, 4], "Float32", b"\0" * 16))),
    "huge tag": ckpt(entry("t" * 200_000, tensor([1], "Float32", b"\0" * 4))),
    "huge type name": ckpt(entry("w", field(2, b"F" * 100) + field(3, b""))),
}
HOSTILE_SAFETENSORS = {
    "nested header": safetensors(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "nested entry": safetensors(b'{"w":{"dtype":"F32","shape":' + b"[" * 5000 + b"]" * 5000 + b"}}"),
    "50000 dims": safetensors(
        {"w": {"dtype": "F32", "shape": [2**62] * 50_000, "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "300 dims of 2^62": safetensors(
        {"w": {"dtype": "F32", "shape": [2**62] * 300, "data_offsets": [0, 4]}}, b"\0" * 4
    ),
    "huge offsets": safetensors(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 2**70]}}, b"\0" * 16
    ),
    "header length beyond the file": struct.pack("<Q", 2**63) + b"{}",
    "4400-digit number": safetensors(
        b'{"w":{"dtype":"F32","shape":[' + b"9" * 4400 + b'],"data_offsets":[0,4]}}'
    ),
    "40000x40000 in 64 bytes": safetensors(
        {"w": {"dtype": "F32", "shape": [40000, 40000], "data_offsets": [0, 6_400_000_000]}}, b"\0" * 8
    ),
}
