"""Load checkpoint files fully with MindSpore, in a process of its own.

``app.checkpoints.verify`` runs this file as a script (not as ``-m app...``,
so that it imports neither Flask nor the dashboard): the dashboard itself
never imports mindspore, and a file that crashes the loader takes down only
this process.

Protocol. The dashboard passes one end of a Unix socket pair as the first
argument. Over it, for each file, comes one message: a JSON object
``{"path", "format"}`` with the file's open descriptor attached
(``SCM_RIGHTS``); an empty message ends the work. For each file one JSON line
goes to stdout, as its load ends::

    {"ok": bool, "error": str | null, "crc": bool, "params": int | null, "seconds": float}

The descriptor, not the path, is what gets loaded. The dashboard opened it
without following a symlink anywhere below the run directory
(``app/safeio.py``), but MindSpore's ``load_checkpoint`` takes a path,
resolves it (``realpath``) and opens it again, and the path could lead
outside by then. So the two places where MindSpore opens a checkpoint (its
file-system hook for ``.ckpt``, the data adapter for ``.safetensors``) are
given an ``open`` that hands out the descriptor instead; ``pin_opens``
checks that both exist and refuses to load at all if a MindSpore version
moved them. The path only serves MindSpore's own checks (it must exist).

Memory. Before each load the address space is limited (``RLIMIT_AS``) to
what this process uses already, plus ``HEADROOM``, plus ``PER_BYTE`` times
the file's size: a loader that believes a 64-byte file holding a
40000x40000 tensor fails with a MemoryError (or dies) instead of taking
the machine's memory. (Measured here: importing mindspore maps about
0.86 GB; loading a 200 MB file peaks at 0.39 GB more, about twice its size.)

``crc`` says whether the file stores a CRC, which MindSpore then checks
(``load_checkpoint(..., crc_check=True)``); a file without one is loaded
plainly, so only a full parse vouches for it. Anything MindSpore or its C++
layer prints goes to stderr, never into the protocol.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import sys
import time

# A .ckpt saved with crc_check=True ends in b"crc_num" and 10 digits (see
# trainer_bridge/rundir/ckptmeta.py); a .safetensors one keeps "crc_num" in __metadata__.
CRC_MARK = b"crc_num"
CKPT_TRAILER = 17
SAFETENSORS_MAX_HEADER = 100 * 1000 * 1000
HEADROOM = 512 * 1024 * 1024
PER_BYTE = 3
MAX_MESSAGE = 64 * 1024

_pinned: dict = {"fd": None, "check": lambda: False}


def has_crc(fd: int, fmt: str) -> bool:
    if fmt == "safetensors":
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return False
        (n,) = struct.unpack("<Q", head)
        if n > SAFETENSORS_MAX_HEADER:
            return False
        try:
            header = json.loads(os.pread(fd, n, 8))
        except (ValueError, RecursionError):
            return False
        meta = header.get("__metadata__") if isinstance(header, dict) else None
        return isinstance(meta, dict) and "crc_num" in meta
    size = os.fstat(fd).st_size
    return size >= CKPT_TRAILER and os.pread(fd, len(CRC_MARK), size - CKPT_TRAILER) == CRC_MARK


def pin_opens() -> None:
    """Make MindSpore read checkpoints from the pinned descriptor, whatever path it opens."""
    import builtins

    import mindspore.train.serialization as serialization
    from mindspore.parallel import data_access_adapter

    real_open = builtins.open

    def pinned_open(file, mode="r", *args, **kwargs):
        fd = _pinned["fd"]
        if fd is not None and isinstance(file, str) and file.endswith((".ckpt", ".safetensors")):
            if mode not in ("r", "rb"):
                raise PermissionError(f"verify opens checkpoints read-only, not with mode {mode!r}")
            f = os.fdopen(os.dup(fd), "rb")
            f.seek(0)
            return f
        return real_open(file, mode, *args, **kwargs)

    fs = getattr(serialization, "_ckpt_fs", None)
    ensure = getattr(serialization, "_ensure_ckpt_fs_initialized", None)
    if fs is None or ensure is None or not hasattr(data_access_adapter, "FileDataAccessAdapter"):
        raise RuntimeError(
            "this MindSpore version opens checkpoints where the verify cannot pin them to the file it "
            "checked; refusing to load by path"
        )
    # MindSpore registers its file system lazily, at the first load, which
    # would put the plain open back: register it now, then replace it.
    ensure()
    fs.open = pinned_open
    data_access_adapter.open = pinned_open  # the module's global, which its adapter calls
    _pinned["check"] = lambda: fs.open is pinned_open and data_access_adapter.open is pinned_open


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def limit_memory(size: int) -> int:
    """Limit this process's address space for loading a file of ``size`` bytes; the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + HEADROOM + PER_BYTE * size
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return limit


def load(ms, path: str, fd: int, fmt: str) -> dict:
    """Load one file completely, from ``fd``; the result line for it."""
    started = time.monotonic()
    crc = False
    limit = 0
    _pinned["fd"] = fd
    try:
        if not _pinned["check"]():
            raise RuntimeError(
                "MindSpore's file opening is no longer pinned to the checked file; not loading"
            )
        crc = has_crc(fd, fmt)
        limit = limit_memory(os.fstat(fd).st_size)
        params = ms.load_checkpoint(path, crc_check=crc, format=fmt)
    # MindSpore reports a bad file with ValueError, RuntimeError, TypeError or
    # OSError depending on where the parse fails, and wraps a MemoryError in a
    # ValueError("Unknown Error!"); every one is this file's verdict.
    except Exception as e:  # noqa: BLE001
        if _caused_by(e, MemoryError):
            return _failed(
                f"MemoryError: loading it needs more memory than a file of its size can justify "
                f"(limit {limit / 2**30:.2f} GiB): its header claims more than the file holds",
                crc,
                started,
            )
        error = f"{type(e).__name__}: {e}"
        if "Unknown Error" in error and limit:
            # MindSpore's C++ loader turns a failed allocation into this.
            error += (
                f" (loaded under a memory limit of {limit / 2**30:.2f} GiB sized from the file: "
                "a header that claims more than the file holds fails this way)"
            )
        if crc and _loads_without_crc(ms, path, fmt):
            error = (
                "CRC mismatch: the contents no longer match the CRC MindSpore stored when it saved the file"
            )
        return _failed(error, crc, started)
    finally:
        _pinned["fd"] = None
    return {
        "ok": True,
        "error": None,
        "crc": crc,
        "params": len(params),
        "seconds": round(time.monotonic() - started, 3),
    }


def _caused_by(e: BaseException, kind: type) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, kind):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _failed(error: str, crc: bool, started: float) -> dict:
    return {
        "ok": False,
        "error": error,
        "crc": crc,
        "params": None,
        "seconds": round(time.monotonic() - started, 3),
    }


def _loads_without_crc(ms, path: str, fmt: str) -> bool:
    """Whether the file parses when its CRC is ignored: tells a CRC mismatch from damage."""
    try:
        ms.load_checkpoint(path, format=fmt)
    except Exception:  # noqa: BLE001  (any failure means: not only the CRC)
        return False
    return True


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    # Keep the protocol on a private copy of stdout; fd 1 goes to stderr so
    # that prints from MindSpore's C++ layer cannot corrupt it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import mindspore as ms

    pin_opens()
    while True:
        message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
        if not message:
            break
        item = json.loads(message)
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            result = _failed("the dashboard sent no open file", False, time.monotonic())
        else:
            try:
                result = load(ms, item["path"], fds[0], item["format"])
            finally:
                os.close(fds[0])
        out.write(json.dumps(result) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
