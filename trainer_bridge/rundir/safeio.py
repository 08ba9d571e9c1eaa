"""Every open, write and unlink of a run-directory file, on both sides: never blocking, never followed.

The run directory is shared, and anything that can write it can leave a
FIFO, a socket, a device node, a directory or a symlink where a file is
expected. A plain ``open`` of a FIFO blocks until a writer comes (for ever),
a device may never end, and a symlink leads outside. So every reader here
opens with ``O_NONBLOCK | O_NOFOLLOW``, checks ``S_ISREG`` on the open
descriptor (``fstat``, so nothing can be swapped in between) and reads at
most a bound; anything else is ``NotRegular``, whose message says only
"not a regular file" (it never tells whether a symlink's target exists).

Checking a path (``realpath``, ``is_symlink``) and then using it is a race:
anything that can write the run directory can swap a directory for a
symlink in between (``renameat2(RENAME_EXCHANGE)`` makes the window
reliable), and the open or the unlink then lands outside. So every write,
create and unlink below a root is walked one component at a time, each
directory opened relative to its parent's descriptor with ``O_NOFOLLOW``
(a symlink anywhere fails with ``ELOOP`` or ``ENOTDIR``), and the last step
(open, create, rename, unlink, rmdir) is made relative to the parent's
descriptor. What is written or removed is therefore inside the root at the
moment it happens, whatever the path looked like a moment before.

The root itself (the run directory) is the operator's choice and is
trusted, symlinks in its own path included. This module imports only the
standard library: the dashboard and the bridge both use it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
# Creating: O_NONBLOCK too, so a FIFO put where a file is appended to fails
# (ENXIO) instead of waiting for a reader.
_APPEND_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(ValueError):
    """A relative path that could leave the root (absolute, ``..``, empty parts)."""


class NotRegular(OSError):
    """Something other than a regular file (FIFO, socket, device, directory, symlink) where one is expected."""

    def __init__(self, what: str = "not a regular file"):
        super().__init__(errno.EINVAL, what)


class FileTooLarge(ValueError):
    """A run-directory file larger than any the bridge or the dashboard writes."""


def parts(rel: str) -> list[str]:
    """The components of a path relative to the root; UnsafePath if it could leave it."""
    if not isinstance(rel, str) or not rel or "\0" in rel or rel.startswith("/"):
        raise UnsafePath(f"{rel!r} is not a path relative to the run directory")
    items = rel.split("/")
    if any(p in ("", ".", "..") for p in items):
        raise UnsafePath(f"{rel!r} has an empty, '.' or '..' component")
    return items


def relative(root: str | os.PathLike, path: str | os.PathLike) -> str:
    """``path`` (built by joining names to ``root``) relative to ``root``; UnsafePath if it is not below."""
    rel = os.path.relpath(os.fspath(path), os.fspath(root))
    parts(rel)
    return rel


@contextmanager
def parent_fd(root: str | os.PathLike, rel: str, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """(a descriptor of ``rel``'s directory, reached without following a symlink; its last name).

    ``create`` makes the missing directories on the way (each by ``mkdir``
    relative to its parent's descriptor, then opened with ``O_NOFOLLOW``).
    """
    *dirs, name = parts(rel)
    fd = _walk(root, dirs, create)
    try:
        yield fd, name
    finally:
        os.close(fd)


def _walk(root: str | os.PathLike, dirs: list[str], create: bool) -> int:
    """A descriptor of ``root/dirs...``, each step opened with ``O_NOFOLLOW``; the caller closes it."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for d in dirs:
            if create:
                try:
                    os.mkdir(d, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            child = os.open(d, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_regular(fd: int) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise NotRegular()
    return st


def _open_checked(
    path: str | os.PathLike, flags: int, mode: int = 0o644, *, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
    """``os.open`` with ``flags`` (which hold O_NONBLOCK and O_NOFOLLOW), then the regular-file check."""
    try:
        fd = os.open(path, flags, mode, dir_fd=dir_fd)
    except OSError as e:
        # ELOOP: a symlink; ENXIO: a socket (or a FIFO open for writing).
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise NotRegular() from None
        raise
    try:
        return fd, _check_regular(fd)
    except BaseException:
        os.close(fd)
        raise


def open_regular(path: str | os.PathLike, *, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``path`` and its stat; never blocks.

    ``NotRegular`` for a FIFO, socket, device, directory or a symlink (not
    followed); other OSErrors as ``open`` raises them (``FileNotFoundError``).
    The descriptor stays non-blocking, which changes nothing for a regular file.
    """
    return _open_checked(path, READ_FLAGS, dir_fd=dir_fd)


def open_file(root: str | os.PathLike, rel: str) -> tuple[int, os.stat_result]:
    """``open_regular`` of ``rel`` under ``root``, walked without following a symlink anywhere.

    OSError with ``ELOOP``/``ENOTDIR`` when a directory on the way is a
    symlink, ``NotRegular`` when the file is not a regular one.
    """
    with parent_fd(root, rel) as (dir_fd, name):
        return open_regular(name, dir_fd=dir_fd)


def read_fd(fd: int, size: int, limit: int, name: str) -> bytes:
    """At most ``limit`` bytes of the open file; FileTooLarge if it holds (or grows to) more."""
    if size > limit:
        raise FileTooLarge(f"{name} is {size} bytes, more than the {limit} allowed")
    chunks, total = [], 0
    while total <= limit:
        chunk = os.read(fd, limit + 1 - total)
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    if total > limit:
        raise FileTooLarge(f"{name} grew past the {limit} bytes allowed while being read")
    return b"".join(chunks)


def read_regular(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` (FileTooLarge beyond); never blocks."""
    fd, st = open_regular(path)
    try:
        return read_fd(fd, st.st_size, limit, Path(path).name)
    finally:
        os.close(fd)


def read_tail(path: str | os.PathLike, nbytes: int) -> tuple[bytes, int]:
    """(the last ``nbytes`` of the regular file ``path``, the offset they start at)."""
    fd, st = open_regular(path)
    try:
        start = max(0, st.st_size - nbytes)
        return os.pread(fd, nbytes, start), start
    finally:
        os.close(fd)


def read_at(path: str | os.PathLike, offset: int, nbytes: int) -> bytes:
    """``nbytes`` of the regular file ``path`` from ``offset`` (fewer at its end)."""
    fd, _ = open_regular(path)
    try:
        return os.pread(fd, nbytes, offset)
    finally:
        os.close(fd)


def append(root: str | os.PathLike, rel: str, data: bytes) -> int:
    """Append ``data`` to the regular file ``rel`` under ``root`` (created if absent); its new size."""
    with parent_fd(root, rel) as (dir_fd, name):
        return _append_at(dir_fd, name, data)


def _append_at(dir_fd: int, name: str, data: bytes) -> int:
    fd, _ = _open_checked(name, _APPEND_FLAGS, dir_fd=dir_fd)
    try:
        os.set_blocking(fd, True)
        os.write(fd, data)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def write_atomic(root: str | os.PathLike, rel: str, data: bytes, *, fsync: bool = True) -> None:
    """Replace ``rel`` under ``root`` with ``data`` so readers never see a partial file.

    The temporary file is created (``O_EXCL | O_NOFOLLOW``) and renamed in
    the target's own directory, reached by the walk, because ``rename`` is
    only atomic within one file system. Missing directories are made.
    Whatever was at the name (a FIFO, a symlink) is replaced as an entry,
    never opened or followed; a directory is first renamed aside.
    """
    with parent_fd(root, rel, create=True) as (dir_fd, name):
        _write_atomic_at(dir_fd, name, data, fsync, f".{name}.{os.urandom(6).hex()}.tmp")


def _write_atomic_at(dir_fd: int, name: str, data: bytes, fsync: bool, tmp: str) -> None:
    fd = os.open(
        tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
    )
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except IsADirectoryError:
            # A directory put at a file's name would block this write for
            # ever (the stop flag: every stop): moved aside, kept, hidden.
            _move_aside(dir_fd, name)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


class HeldDir:
    """The directory ``rel`` under ``root``, walked to once and then written relative to its descriptor.

    For the bridge's reporter, which writes a heartbeat every second
    on every rank: through a held directory that is four syscalls (create,
    write, close, rename) where the walk and a fresh random name make nine,
    and on a shared file system every one is a metadata operation.
    The descriptor is walked to again every ``refresh_s`` and after any
    error, so a directory removed or swapped for a symlink is written again
    (or refused) within that time. Not thread-safe: one writer at a time.
    """

    def __init__(self, root: str | os.PathLike, rel: str, *, refresh_s: float = 10.0, clock=time.monotonic):
        self.root, self.dirs = root, parts(rel)
        self.refresh_s, self._clock = refresh_s, clock
        self._fd: int | None = None
        self._due = 0.0
        # Temporary names from a generator seeded once: no getrandom per write.
        self._names = random.Random(os.urandom(16))

    def write_atomic(self, name: str, data: bytes, *, fsync: bool = False) -> None:
        """``write_atomic`` of ``name`` in this directory."""
        tmp = f".{name}.{self._names.getrandbits(48):012x}.tmp"
        self._at(_write_atomic_at, name, data, fsync, tmp)

    def append(self, name: str, data: bytes) -> int:
        """``append`` to ``name`` in this directory; its new size."""
        return self._at(_append_at, name, data)

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, both in this directory (FileNotFoundError if ``src`` is gone)."""
        self._name(dst)
        self._at(lambda fd, a, b: os.replace(a, b, src_dir_fd=fd, dst_dir_fd=fd), src, dst)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _name(self, name: str) -> None:
        if len(parts(name)) != 1:
            raise UnsafePath(f"{name!r} is not a name in {'/'.join(self.dirs)}")

    def _at(self, action, name: str, *args):
        self._name(name)
        now = self._clock()
        if self._fd is None or now >= self._due:
            self.close()
            self._fd = _walk(self.root, self.dirs, create=True)
            self._due = now + self.refresh_s
        try:
            return action(self._fd, name, *args)
        except OSError:
            self.close()  # walk again next time: the directory may be what changed
            raise


def open_lock(root: str | os.PathLike, rel: str) -> int:
    """A descriptor for ``flock`` on the regular file ``rel`` (created if absent); NotRegular otherwise."""
    with parent_fd(root, rel, create=True) as (dir_fd, name):
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
        fd, _ = _open_checked(name, flags, 0o600, dir_fd=dir_fd)
    return fd


# In bounded_flock's sentence when the lock was only busy: a caller that expects company
# (two observers of one stop's end) may take that as no problem.
LOCK_HELD = "held by another process"


@contextmanager
def bounded_flock(
    root: str | os.PathLike, rel: str, wait_s: float, poll_s: float = 0.05
) -> Iterator[str | None]:
    """Hold an exclusive ``flock`` on ``rel`` under ``root``, waiting at most ``wait_s``; never blocks.

    Yields None while held, or a sentence saying why it is not (a lock file
    that is not a regular file, or one another process held throughout):
    the caller goes on without it. ``LOCK_NB`` in a short retry loop, never
    a blocking ``flock``, because whoever can write the directory can hold
    the lock for ever.
    """
    fd, problem = None, None
    try:
        fd = open_lock(root, rel)
    except (OSError, UnsafePath) as e:
        problem = f"no usable lock file {rel} ({why(e) if isinstance(e, OSError) else e})"
    deadline = time.monotonic() + wait_s
    while fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(poll_s)
                continue
            problem = f"the lock {rel} was {LOCK_HELD} for {wait_s:g} s"
        except OSError as e:
            problem = f"the lock {rel} could not be taken ({why(e)})"
        os.close(fd)
        fd = None
    try:
        yield problem
    finally:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def check_absent_or_regular(dir_path: str | os.PathLike, names: tuple[str, ...]) -> None:
    """NotRegular (naming the file) if any of ``names`` in ``dir_path`` exists and is not a regular file."""
    for name in names:
        try:
            st = os.lstat(os.path.join(dir_path, name))
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(f"{name} is not a regular file (a symlink, FIFO, device or directory)")


def _move_aside(dir_fd: int, name: str) -> str:
    """Rename ``name`` (whatever it is) to a hidden name beside it; returns that name."""
    aside = f".{name}.not-a-file-{os.urandom(4).hex()}"
    os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return aside


def unlink(root: str | os.PathLike, rel: str) -> None:
    """Remove the file ``rel`` (its directory entry: a read-only file goes too; a symlink as itself)."""
    with parent_fd(root, rel) as (dir_fd, name):
        os.unlink(name, dir_fd=dir_fd)


def why(e: OSError) -> str:
    """The reason to show for a refused open or unlink (never whether a symlink's target exists)."""
    if isinstance(e, NotRegular):
        return e.strerror
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "a symlink or a non-directory is in its path (not followed)"
    return (e.strerror or str(e)).lower()
