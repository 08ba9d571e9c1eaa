"""Bytes under a run directory (the landing page's "Disk used"), measured incrementally.

A run's tree is walked with descriptors (``safedirs.open_subdir``, ``O_NOFOLLOW``):
symlinks are neither followed nor counted, entries that cannot be read or
vanish mid-walk are skipped, and a directory met twice (a bind mount) is
counted once. The figure is the sum of the regular files' sizes (``st_size``).

**Incremental.** Each directory's listing (its subdirectories and the sum of
its files' sizes) is kept, keyed by its (device, inode, mtime): while the key
holds it is not listed again, so a walk costs one ``fstat`` per directory.
A file that grows in place (a log, a history file) does not change its
directory's mtime, so every directory is listed again at most every
``recheck_s`` (a live run's files grow; an idle run's do not, and its row is
kept while its directories do not change: ``app/runs/rows.py``). What is
kept costs one small record per directory, not per file.

**Bounded.** One walk looks at ``max_entries`` entries at most; past that the
figure is a lower bound and ``truncated`` says so.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from trainer_bridge.rundir import safedirs

MAX_ENTRIES = 200_000
# A live run's files grow in place: every directory is read again this often.
RECHECK_S = 30.0
# An open run's row is asked for by every page on the landing page: one walk serves them all this long.
MIN_INTERVAL_S = 5.0


@dataclass(frozen=True)
class _Dir:
    key: tuple
    files_bytes: int
    subdirs: tuple[str, ...]


class DiskUsage:
    """The bytes under one run directory; ``measure`` brings them up to date."""

    def __init__(
        self,
        *,
        max_entries: int = MAX_ENTRIES,
        recheck_s: float = RECHECK_S,
        min_interval_s: float = MIN_INTERVAL_S,
    ):
        self.max_entries = max_entries
        self.recheck_s = recheck_s
        self.min_interval_s = min_interval_s
        self.truncated = False
        self._dirs: dict[str, _Dir] = {}
        self._listed_at: float | None = None
        self._last: tuple[float, str, int | None] | None = None  # (when, of which directory, bytes)

    def measure(self, run_dir: str | os.PathLike | None, now: float) -> int | None:
        """The bytes of the regular files under ``run_dir``; None if it cannot be opened."""
        if run_dir is None:
            return None
        run_dir = os.fspath(run_dir)
        if (
            self._last is not None
            and self._last[1] == run_dir
            and 0 <= now - self._last[0] < self.min_interval_s
        ):
            return self._last[2]
        total = self._measure(run_dir, now)
        self._last = (now, run_dir, total)
        return total

    def _measure(self, run_dir: str, now: float) -> int | None:
        try:
            fd = safedirs.open_root_nofollow(run_dir)
        except OSError:
            self._dirs = {}
            return None
        full = self._listed_at is None or now - self._listed_at >= self.recheck_s
        walk = _Walk(self._dirs, {}, self.max_entries, reuse=not full)
        try:
            total = walk.dir(fd, "")
        except OSError:
            return None
        finally:
            os.close(fd)
        self._dirs = walk.kept
        self.truncated = walk.budget <= 0
        if full:
            self._listed_at = now
        return total


class _Walk:
    """One walk of a run's tree, reusing ``old`` listings whose key held (if ``reuse``)."""

    def __init__(self, old: dict[str, _Dir], kept: dict[str, _Dir], budget: int, *, reuse: bool):
        self.old = old
        self.kept = kept
        self.budget = budget
        self.reuse = reuse
        self.seen: set[tuple[int, int]] = set()

    def dir(self, fd: int, rel: str) -> int:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if ident in self.seen:
            return 0
        self.seen.add(ident)
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        listing = self.old.get(rel)
        if not (self.reuse and listing is not None and listing.key == key):
            listing = self._list(fd, key)
            if listing is None:
                return 0
        else:
            self.budget -= len(listing.subdirs)
        if self.budget > 0:
            self.kept[rel] = listing
        total = listing.files_bytes
        for name in listing.subdirs:
            if self.budget <= 0:
                break
            try:
                sub = safedirs.open_subdir(fd, name)
            except OSError:
                continue  # gone, unreadable, or replaced by a symlink since it was listed
            try:
                total += self.dir(sub, f"{rel}/{name}" if rel else name)
            except OSError:
                continue
            finally:
                os.close(sub)
        return total

    def _list(self, fd: int, key: tuple) -> _Dir | None:
        files_bytes, subdirs = 0, []
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    if self.budget <= 0:
                        break
                    self.budget -= 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        subdirs.append(entry.name)
                    elif stat.S_ISREG(st.st_mode):
                        files_bytes += st.st_size
        except OSError:
            return None
        return _Dir(key, files_bytes, tuple(subdirs))
