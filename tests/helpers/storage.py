"""A directory of a run on a tiny tmpfs of its own, so that a test can fill it (ENOSPC) or make it read-only.

Needs root and a working ``mount -t tmpfs``: ``small_tmpfs`` skips the test otherwise.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@contextmanager
def small_tmpfs(directory: Path, size: str) -> Iterator[Path]:
    """``directory`` (made if missing) as a tmpfs of ``size`` (``mount``'s, e.g. ``2m``); unmounted after."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    done = mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        mount("-o", "remount,rw", str(directory))
        if subprocess.run(["umount", str(directory)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)


def fill(directory: Path) -> Path:
    """Write zeros into ``directory`` until the file system is full."""
    filler = directory / "filler.bin"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler
