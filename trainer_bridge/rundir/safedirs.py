"""The run directory's directories, by the rules of ``safeio``: made, opened, pinned, scanned and removed.

Each is walked from its root one component at a time with ``O_NOFOLLOW``
(``safeio.parent_fd``), so a directory swapped for a symlink is refused or
removed as the link itself, never followed. ``anchor`` and ``shown`` say
which root to walk from and which name to show for it. Files inside them
are opened, written and unlinked by ``safeio``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from trainer_bridge.rundir.safeio import DIR_FLAGS, parent_fd


def makedirs(root: str | os.PathLike, rel: str) -> None:
    """Make the directory ``rel`` under ``root`` and its parents, following no symlink."""
    with parent_fd(root, rel + "/x", create=True):
        pass


def scan_regular(folder: str | os.PathLike, limit: int) -> tuple[list[os.DirEntry], bool]:
    """(the regular files among the first ``limit`` entries of ``folder``, whether entries were left).

    Symlinks, FIFOs, sockets, devices and directories are skipped (their
    ``lstat``, not their target's). Bounded, so a directory of a million
    junk names costs ``limit`` entries, not a million.
    """
    out: list[os.DirEntry] = []
    with os.scandir(folder) as it:
        for n, entry in enumerate(it):
            if n >= limit:
                return out, True
            try:
                if entry.is_file(follow_symlinks=False):
                    out.append(entry)
            except OSError:
                continue
    return out, False


def open_dir(root: str | os.PathLike, rel: str, *, create: bool = False) -> int:
    """A descriptor of the directory ``rel`` under ``root`` (``root`` itself for ``""``), walked as above."""
    if rel in ("", "."):
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    with parent_fd(root, rel, create=create) as (dir_fd, name):
        if create:
            try:
                os.mkdir(name, 0o777, dir_fd=dir_fd)
            except FileExistsError:
                pass
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)


def open_subdir(dir_fd: int, name: str) -> int:
    """A descriptor of the directory ``name`` in the open directory ``dir_fd``, never through a symlink.

    OSError with ``ELOOP``/``ENOTDIR`` for a symlink or a non-directory (a
    walk of a tree: one step of ``parent_fd``'s, for a caller that keeps
    the parent open across many children).
    """
    return os.open(name, DIR_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)


@contextmanager
def pinned_dir(root: str | os.PathLike, rel: str, *, create: bool = False) -> Iterator[str]:
    """A path naming the directory ``rel`` under ``root`` as walked now (``/proc/self/fd/N``).

    For a call that takes a path (``scandir``, SQLite, which opens a
    database's ``-wal`` and ``-shm`` beside it by name): the directory is
    pinned by its descriptor, so one swapped for a symlink cannot redirect it.
    """
    fd = open_dir(root, rel, create=create)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


# pinned_dir's paths, and app/runs/pinned.py's run directories: names the kernel resolves through
# an open descriptor, to the very directory it holds.
PINNED_PREFIX = "/proc/self/fd/"


def anchor(path: str | os.PathLike) -> str:
    """The root to walk from: ``realpath(path)``, but a path pinned to a descriptor as it is.

    ``realpath`` of ``/proc/self/fd/N`` is the directory's *current name*,
    which a rename and a symlink put there can lead elsewhere by the time
    it is opened: a pinned run directory must be walked from its descriptor.
    """
    p = os.fspath(path)
    return p if p.startswith(PINNED_PREFIX) else os.path.realpath(p)


def shown(path: str | os.PathLike) -> str:
    """The name to show for a run directory: a pinned one's as it was found, not ``/proc/self/fd/N``."""
    return getattr(path, "logical", None) or os.fspath(path)


def open_root_nofollow(path: str | os.PathLike) -> int:
    """A descriptor of the directory ``path``, not through a symlink at its last name.

    A pinned path (``/proc/self/fd/N``) is itself a link, the kernel's, to
    the very directory held: it is opened through it.
    """
    p = os.fspath(path)
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    return os.open(p, flags if p.startswith(PINNED_PREFIX) else flags | os.O_NOFOLLOW)


def rmdir(root: str | os.PathLike, rel: str) -> None:
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
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
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
