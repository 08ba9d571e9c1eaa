"""``.mindir``: a ``ModelProto``, only checked to be well-formed protobuf."""

from __future__ import annotations

from typing import BinaryIO

from trainer_bridge.rundir.ckptmeta.wire import (
    _ENCRYPTED_MAGIC,
    MAX_ENTRIES,
    _Corrupt,
    _describe_start,
    _fields,
    _Parsed,
    _Stream,
)

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
