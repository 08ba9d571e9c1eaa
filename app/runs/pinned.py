"""A run directory under ``--runs ROOT`` held by its descriptor (issue 32, P2).

Discovery finds a run by walking ROOT without following a symlink, and
pins it by (device, inode). A neighbour who can write ROOT can still
rename the run's directory and put a symlink to OUT at its name between
any check and any use: an engine that joined names to ``ROOT/name`` would
then write the stop flag, the audit database or a retention delete in OUT.

So a run's engines never get ``ROOT/name``. ``pin`` walks to the directory
from ROOT's descriptor (``O_NOFOLLOW`` at every level), checks that it is
the very directory discovery pinned, and keeps that descriptor open; the
engines get ``/proc/self/fd/N`` as their run directory. The kernel
resolves that name through the open descriptor to that directory itself,
never through ROOT's names, so a rename or a symlink put at the run's name
afterwards redirects nothing: every read, write and delete below it (each
walked on from there by ``trainer_bridge.rundir.safeio`` without following
a symlink) lands in the directory that was pinned, or fails. SQLite alone
turns that path back into the directory's path as text before it opens the
audit database (``app.audit.connect_pinned`` checks the path it opened;
``docs/security.md`` says what remains). The registry still checks, before each
request and each watcher tick, that ROOT's name leads to the pinned
directory: one that changed identity is a new run, and the old one's
engines are dropped.

The descriptor is closed when the last reference to the path goes (the
engines and the registry hold it), never while an engine could still use
the number: a number closed and reused would name another file.
"""

from __future__ import annotations

import os

from trainer_bridge.rundir import safedirs, safeio


class Replaced(OSError):
    """The run's name no longer leads (without a symlink) to the directory discovery pinned."""


class PinnedPath(str):
    """``/proc/self/fd/N`` for a run directory's open descriptor; closes it when it goes.

    A ``str`` so every engine takes it as a run directory unchanged;
    ``logical`` is ``ROOT/name`` as found, ``ident`` the pin.
    """

    fd: int
    ident: tuple[int, int]
    logical: str

    def __del__(self) -> None:
        fd = self.__dict__.pop("fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def holds(self) -> bool:
        """Whether the descriptor is still the pinned directory (always, unless it was closed)."""
        try:
            st = os.fstat(self.fd)
        except (OSError, AttributeError):
            return False
        return (st.st_dev, st.st_ino) == tuple(self.ident)


def pin(root: str, rel: str, ident: tuple) -> PinnedPath:
    """The run directory ``rel`` below ``root``, opened by descriptor; ``Replaced`` unless it is ``ident``."""
    if not ident:
        raise Replaced(f"{rel}: no pin")
    root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = root_fd
        for part in safeio.parts(rel):
            nxt = safedirs.open_subdir(fd, part)
            if fd != root_fd:
                os.close(fd)
            fd = nxt
    except OSError as e:
        if fd != root_fd:
            os.close(fd)
        raise Replaced(f"{rel}: {safeio.why(e)}") from None
    finally:
        os.close(root_fd)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != tuple(ident):
            raise Replaced(f"{rel}: another directory than the one found")
        path = PinnedPath(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    path.fd, path.ident, path.logical = fd, (st.st_dev, st.st_ino), os.path.join(root, rel)
    return path
