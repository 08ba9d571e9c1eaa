"""Are a checkpoint's floating-point weights finite? A streaming scan of ``.ckpt`` files, without MindSpore.

The health evidence of ``ckpthealth`` (a ``*_breakpoint.ckpt`` name, the
bridge's NaN-loss flag, MindFormers' health file) catches the known cases;
a periodic ``ModelCheckpoint`` saved after the loss went NaN carries none of
it. So before the supervisor resumes from a set, it reads the float tensors
of its files (``Float16``, ``BFloat16``, ``Float32``, ``Float64``) in
bounded chunks and passes the set over if any value is NaN or infinite.
The parse reuses ``ckptmeta``'s bounded protobuf reader; what it cannot
read (an encrypted file, another format) is not judged here.
"""

from __future__ import annotations

import os

import numpy as np

from trainer_bridge.rundir import safeio
from trainer_bridge.rundir.ckptmeta.ckpt import entries_end
from trainer_bridge.rundir.ckptmeta.wire import _ENCRYPTED_MAGIC, MAX_NAME_BYTES, _Corrupt, _fields, _Stream

FLOATS = {"Float16": np.float16, "Float32": np.float32, "Float64": np.float64, "BFloat16": None}
CHUNK = 16 << 20


def _finite(raw: bytes, dtype: str) -> bool:
    if dtype == "BFloat16":
        values = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        values = np.frombuffer(raw, FLOATS[dtype])
    return bool(np.isfinite(values).all())


def nonfinite(path: str | os.PathLike) -> str | None:
    """The first tensor of the ``.ckpt`` at ``path`` with a NaN or infinite value, in words; else None."""
    if not os.fspath(path).endswith(".ckpt"):
        return None
    try:
        fd, st = safeio.open_regular(path)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        try:
            return _scan(f, st.st_size)
        except (_Corrupt, OSError, ValueError):
            return None  # unreadable here: the index's own check decides whether it is corrupt


def _scan(f, size: int) -> str | None:
    head = f.read(4)
    if head in _ENCRYPTED_MAGIC:
        return None
    end = entries_end(f, size)
    s = _Stream(f, end)
    while s.pos < end:
        if s.varint("the checkpoint") != 0x0A:
            return None
        length = s.varint("an entry")
        value_end = s.pos + length
        tag = "?"
        for number, wire, value in _fields(s, value_end, "an entry"):
            if number == 1 and wire == 2 and value <= MAX_NAME_BYTES:
                tag = s.take(value, "a name").decode("utf-8", "replace")
            elif number == 2 and wire == 2:
                bad = _tensor(s, s.pos + value, tag)
                if bad:
                    return bad
            elif wire == 2:
                s.skip(value, "a field")
    return None


def _tensor(s: _Stream, end: int, tag: str) -> str | None:
    dtype = None
    for number, wire, value in _fields(s, end, tag):
        if number == 2 and wire == 2 and value <= 64:
            dtype = s.take(value, tag).decode("ascii", "replace")
        elif number == 3 and wire == 2 and dtype in FLOATS:
            item = 2 if dtype in ("Float16", "BFloat16") else np.dtype(FLOATS[dtype]).itemsize
            left = value - value % item
            while left:
                n = min(CHUNK - CHUNK % item, left)
                if not _finite(s.take(n, tag), dtype):
                    return f"{tag} holds NaN or infinite values"
                left -= n
            s.skip(value % item, tag)
        elif wire == 2:
            s.skip(value, tag)
    return None


class Reader:
    """The tensor check a target choice is given (``target.newest_healthy``): reads sets within a byte budget.

    ``budget`` bytes in all, over the sets it is asked about; a set past what
    is left, or on another node (an agent's listing: its files are not here),
    is not read and the choice takes it *unverified*, saying so. ``memo``
    (a dict the caller keeps) remembers each file's verdict by path, size
    and mtime, so a dashboard asked again about the same sets reads them once:
    a file rewritten in place has another size or mtime and is read again.
    """

    MEMO_MAX = 4096

    def __init__(self, budget: int, memo: dict | None = None):
        self.left = budget
        self.budget = budget
        self.memo = memo

    def __call__(self, s) -> tuple[str | None, str | None]:
        """(why a tensor of set ``s`` is not finite, why its tensors were not read); (None, None): finite."""
        away = next((f for f in s.files if f.host is not None), None)
        if away is not None:
            return None, f"its files are on node {away.host}: their tensors are read there, at the resume"
        todo = []
        for f in s.files:
            key = (f.abspath, f.meta.bytes, f.meta.mtime)
            if self.memo is not None and key in self.memo:
                if self.memo[key] is not None:
                    return f"{f.path}: {self.memo[key]}", None
            else:
                todo.append((f, key))
        need = sum(f.meta.bytes or 0 for f, _ in todo)
        if need > self.left:
            return None, f"its {need} bytes of tensors are past the {self.budget >> 20} MiB this choice reads"
        self.left -= need
        for f, key in todo:
            bad = nonfinite(f.abspath)
            if self.memo is not None:
                if len(self.memo) >= self.MEMO_MAX:
                    self.memo.clear()
                self.memo[key] = bad
            if bad:
                return f"{f.path}: {bad}", None
        return None, None
