"""Load checkpoint files fully with MindSpore, in a process of its own.

``app.checkpoints.verify`` runs this file as a script (not as ``-m app...``,
so that it imports neither Flask nor the dashboard): the dashboard itself
never imports mindspore, and a file that crashes the loader takes down only
this process. Protocol: a JSON list of ``{"path", "format"}`` on stdin; one
JSON line per file on stdout, in order, as each load ends::

    {"ok": bool, "error": str | null, "crc": bool, "params": int | null, "seconds": float}

``crc`` says whether the file stores a CRC, which MindSpore then checks
(``load_checkpoint(..., crc_check=True)``); a file without one is loaded
plainly, so only a full parse vouches for it. Anything MindSpore or its C++
layer prints goes to stderr, never into the protocol.
"""
from __future__ import annotations

import json
import os
import struct
import sys
import time

# A .ckpt saved with crc_check=True ends in b"crc_num" and 10 digits (see
# trainer_bridge/ckptmeta.py); a .safetensors one keeps "crc_num" in __metadata__.
CRC_MARK = b"crc_num"
CKPT_TRAILER = 17


def has_crc(path: str, fmt: str) -> bool:
    with open(path, "rb") as f:
        if fmt == "safetensors":
            (n,) = struct.unpack("<Q", f.read(8))
            meta = json.loads(f.read(n)).get("__metadata__") or {}
            return "crc_num" in meta
        size = os.fstat(f.fileno()).st_size
        if size < CKPT_TRAILER:
            return False
        f.seek(size - CKPT_TRAILER)
        return f.read(len(CRC_MARK)) == CRC_MARK


def load(ms, path: str, fmt: str) -> dict:
    """Load one file completely; the result line for it."""
    started = time.monotonic()
    crc = False
    try:
        crc = has_crc(path, fmt)
        params = ms.load_checkpoint(path, crc_check=crc, format=fmt)
    # MindSpore reports a bad file with ValueError, RuntimeError, TypeError or
    # OSError depending on where the parse fails; every one is this file's verdict.
    except Exception as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {e}"
        if crc and _loads_without_crc(ms, path, fmt):
            error = ("CRC mismatch: the contents no longer match the CRC MindSpore stored when "
                     "it saved the file")
        return {"ok": False, "error": error, "crc": crc, "params": None,
                "seconds": round(time.monotonic() - started, 3)}
    return {"ok": True, "error": None, "crc": crc, "params": len(params),
            "seconds": round(time.monotonic() - started, 3)}


def _loads_without_crc(ms, path: str, fmt: str) -> bool:
    """Whether the file parses when its CRC is ignored: tells a CRC mismatch from damage."""
    try:
        ms.load_checkpoint(path, format=fmt)
    except Exception:  # noqa: BLE001  (any failure means: not only the CRC)
        return False
    return True


def main() -> None:
    items = json.load(sys.stdin)
    # Keep the protocol on a private copy of stdout; fd 1 goes to stderr so
    # that prints from MindSpore's C++ layer cannot corrupt it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import mindspore as ms

    for item in items:
        out.write(json.dumps(load(ms, item["path"], item["format"])) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
