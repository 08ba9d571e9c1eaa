"""Open and remove files under the run directory without following a symlink anywhere.

Checking a path (``realpath``, ``is_symlink``) and then using it is a race:
anything that can write the run directory can swap a directory for a
symlink in between (``renameat2(RENAME_EXCHANGE)`` makes the window
reliable), and the open or the unlink then lands outside. So every path
below the run directory is walked here one component at a time, each
directory opened relative to its parent's descriptor with ``O_NOFOLLOW``
(a symlink anywhere fails with ``ELOOP`` or ``ENOTDIR``), and the last step
(open, unlink, rmdir) is made relative to the parent's descriptor. What is
opened or removed is therefore inside the run directory at the moment it
happens, whatever the path looked like a moment before.

The run directory itself is the operator's choice and is trusted, symlinks
in its own path included. Download, delete and deep verify go through here.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(ValueError):
    """A relative path that could leave the run directory (absolute, ``..``, empty parts)."""


def parts(rel: str) -> list[str]:
    """The components of a path relative to the run directory; UnsafePath if it could leave it."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        raise UnsafePath(f"{rel!r} is not a path relative to the run directory")
    items = rel.split("/")
    if any(p in ("", ".", "..") for p in items):
        raise UnsafePath(f"{rel!r} has an empty, '.' or '..' component")
    return items


@contextmanager
def parent_fd(root: str, rel: str) -> Iterator[tuple[int, str]]:
    """(a descriptor of ``rel``'s directory, reached without following a symlink; its last name)."""
    *dirs, name = parts(rel)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for d in dirs:
            child = os.open(d, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        yield fd, name
    finally:
        os.close(fd)


def open_file(root: str, rel: str) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``rel`` under ``root``, and its stat.

    OSError with ``ELOOP``/``ENOTDIR`` when a component is a symlink, and
    ``EINVAL`` when the file is not a regular file (a FIFO, a device).
    Non-blocking, so a FIFO named like a checkpoint cannot hang the caller.
    """
    with parent_fd(root, rel) as (dir_fd, name):
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def unlink(root: str, rel: str) -> None:
    """Remove the file ``rel`` (its directory entry: a read-only file goes too; a symlink as itself)."""
    with parent_fd(root, rel) as (dir_fd, name):
        os.unlink(name, dir_fd=dir_fd)


def rmdir(root: str, rel: str) -> None:
    """Remove the directory ``rel`` if it is empty."""
    with parent_fd(root, rel) as (dir_fd, name):
        os.rmdir(name, dir_fd=dir_fd)


def rmtree(root: str, rel: str, max_entries: int = 100_000) -> int:
    """Remove the directory ``rel`` and everything in it; the number of entries removed.

    Each level is opened relative to its parent's descriptor with
    ``O_NOFOLLOW`` and emptied through that descriptor, so a directory inside
    swapped for a symlink is removed as the link itself (``unlink``), never
    followed. A name that is already gone counts as removed. OSError for
    anything else (or more than ``max_entries`` entries: not a leftover).
    """
    with parent_fd(root, rel) as (dir_fd, name):
        count = _empty(dir_fd, name, [0], max_entries)
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        return count + 1


def _empty(parent: int, name: str, seen: list[int], limit: int) -> int:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        return 0
    removed = 0
    try:
        for entry in os.scandir(fd):
            seen[0] += 1
            if seen[0] > limit:
                raise OSError(errno.EFBIG, f"more than {limit} entries")
            if entry.is_dir(follow_symlinks=False):
                removed += _empty(fd, entry.name, seen, limit)
                try:
                    os.rmdir(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
            else:
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except FileNotFoundError:
                    pass
            removed += 1
    finally:
        os.close(fd)
    return removed


def why(e: OSError) -> str:
    """The reason to show for a refused open or unlink."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symlink or a non-directory is in its path (not followed)"
    return (e.strerror or str(e)).lower()
