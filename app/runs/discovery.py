"""The runs under a root: found incrementally, never following a symlink out of it.

A run is a directory below ROOT (down to ``RUNS_DEPTH`` levels; ROOT itself
is never one) that holds any of: Rankwatch's state directory
(``rankwatch/``), msrun worker logs (``<LOG_DIR>/worker_N.log``, ``LOG_DIR``
relative to the run, by default ``msrun_logs``), or a ``graceful_exit.json``.
A run's own subdirectories are not searched for more runs.

**The run id** is the run's path relative to ROOT, with ``/`` between
components (``app/runs/ids.py`` puts it in a URL).

**Incremental.** Each directory is opened (relative to its parent's
descriptor, ``O_NOFOLLOW``: ``trainer_bridge.rundir.safedirs.open_subdir``) and
``fstat``-ed; its listing is read again only when its (device, inode,
mtime) changed, so an unchanged tree costs one open and one ``fstat`` per
directory, never a ``scandir``. New runs appear on the next scan and deleted
ones go.

**Live.** A run is live while one of its heartbeats (``rankwatch/rank_N.json``)
or worker logs was written within ``RUN_IDLE_S``: the newest ``mtime`` among
them. An empty file, or one dated in the future (past ``FUTURE_SLACK_S``),
is no evidence of life: anyone who writes ROOT can date a file ahead (issue
32, P6). ``RunEntry.evidence`` counts the files that are. A live run's files
are ``stat``-ed every scan; an idle one's only when one of its directories
changed or every ``IDLE_RECHECK_S`` (an append to a log does not touch its
directory).

**Bounded and never stopped.** A scan reads at most ``max_entries`` entries
of any one directory (then says which directory was cut short): the budget
is per directory, so one neighbour's flood of files hides nothing of anyone
else's (issue 32, P5). A known run is never dropped because a scan was cut
short, nor while something keeps it (``scan(keep=...)``: a run with a
watcher), until its own directory is gone. Symlinks (loops included), names
that are not UTF-8, unreadable directories and directories deleted mid-scan
are skipped with a reason, kept (at most ``MAX_SKIPPED``) for the API; none
of them ends a scan.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from app.run.heartbeats import HEARTBEAT_NAME
from app.run.logmode import DEFAULT_DIR
from app.run.logmode.reader import WORKER_NAME
from trainer_bridge.rundir import safedirs, safeio
from trainer_bridge.rundir.runfiles import FLAG_NAME, STATE_DIR

DEFAULT_DEPTH = 3
DEFAULT_IDLE_S = 300.0
# Entries one scan reads of any one directory: 100,000 empty directories fit; a
# directory of millions is cut short (and says so) rather than stalling the dashboard.
MAX_ENTRIES = 500_000
# A heartbeat or log dated more than this ahead of the dashboard's clock is no evidence of life.
FUTURE_SLACK_S = 2.0
MAX_SKIPPED = 1000
# Heartbeats or worker logs stat-ed per run for liveness (a 4,096-rank job's).
MAX_ACTIVITY_FILES = 8192
IDLE_RECHECK_S = 30.0

STATE, LOGS, FLAG = "state", "logs", "flag"


@dataclass(frozen=True)
class RunEntry:
    """One run found under the root."""

    id: str
    path: str
    markers: tuple[str, ...]
    last_activity: float | None
    live: bool
    # Changes whenever one of the run's directories (itself, rankwatch/, the
    # log directory) changed: a cache of anything read from the run is valid while it holds.
    signature: tuple
    checked_at: float
    # The non-empty heartbeats and worker logs, not dated in the future, that make it live.
    evidence: int = 0
    # The run directory's (device, inode) when it was found: its pin (``pin_holds``).
    ident: tuple = ()

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "markers": list(self.markers),
            "last_activity": self.last_activity,
            "live": self.live,
        }


@dataclass(frozen=True)
class Skipped:
    path: str
    reason: str

    def to_dict(self) -> dict:
        return {"path": self.path, "reason": self.reason}


@dataclass
class _Listing:
    """What a directory's entries say, valid while its (dev, ino, mtime) key holds."""

    key: tuple
    subdirs: list[str] = field(default_factory=list)
    markers: frozenset = frozenset()
    has_log_dir: bool = False
    names: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    entries: int = 0


def _key(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _open_parts(fd: int, parts: list[str]) -> int:
    """A descriptor of the directory ``parts`` below ``fd``, each step ``O_NOFOLLOW``."""
    cur = fd
    for p in parts:
        nxt = safedirs.open_subdir(cur, p)
        if cur != fd:
            os.close(cur)
        cur = nxt
    return cur if cur != fd else os.dup(fd)


def _exists(fd: int, rel: str) -> bool:
    """Whether the directory ``rel`` below ``fd`` is there, reached without following a symlink."""
    try:
        os.close(_open_parts(fd, rel.split("/")))
    except OSError:
        return False
    return True


def pin_holds(root: str, rel: str, ident: tuple) -> bool:
    """Whether ``rel`` below ``root``, walked without following a symlink, is still the directory
    ``ident`` (device, inode) that discovery found (issue 32, P2): a run directory renamed away
    and replaced (by a symlink to elsewhere, or another directory) is not the run any more."""
    if not ident:
        return False
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        cur = _open_parts(fd, rel.split("/"))
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        st = os.fstat(cur)
    finally:
        os.close(cur)
    return (st.st_dev, st.st_ino) == tuple(ident)


def _reason(e: OSError) -> str:
    if isinstance(e, FileNotFoundError):
        return "deleted during the scan"
    if isinstance(e, PermissionError):
        return "unreadable (permission denied)"
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return "replaced by a symlink or a file during the scan (not followed)"
    return f"unreadable ({safeio.why(e)})"


class Discovery:
    """The runs under ``root``; ``scan()`` brings them up to date (one thread at a time)."""

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        depth: int = DEFAULT_DEPTH,
        log_dir: str = "",
        idle_s: float = DEFAULT_IDLE_S,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.time,
        on_enter: Callable[[str], None] | None = None,
    ):
        self.root = os.fspath(root)
        self.depth = depth
        # An absolute LOG_DIR names one directory, not one per run: only worker logs below a run count.
        self.log_parts = (
            [] if os.path.isabs(log_dir or "") else [p for p in (log_dir or DEFAULT_DIR).split("/") if p]
        )
        if any(p in (".", "..") for p in self.log_parts):
            self.log_parts = []
        self.idle_s = idle_s
        self.max_entries = max_entries
        self.clock = clock
        # Called with a directory's id just before it is opened (tests delete one there).
        self.on_enter = on_enter
        self.runs: dict[str, RunEntry] = {}
        self.skipped: list[Skipped] = []
        self.truncated = False
        self.cut: list[str] = []  # the directories the last scan read only in part
        self.error: str | None = None
        self.scanned_at: float | None = None
        self.entries_seen = 0
        self._listings: dict[str, _Listing] = {}
        self._lock = threading.Lock()

    # -- the scan ---------------------------------------------------------------

    def scan(self, keep: Iterable[str] = ()) -> dict[str, RunEntry]:
        """Walk the root once (reusing every listing whose directory did not change); the runs.

        A run known before and not found now stays known while its directory is there if
        the scan was cut short or ``keep`` names it (a run with a watcher).
        """
        with self._lock:
            now = self.clock()
            self._entries = 0
            self._found: dict[str, RunEntry] = {}
            self._skipped: list[Skipped] = []
            self._next_listings: dict[str, _Listing] = {}
            self._seen: set[tuple[int, int]] = set()
            self._truncated = False
            self._cut: list[str] = []
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as e:
                # The root is the operator's choice (trusted, symlinks in its path included).
                self.error = f"cannot read the runs root {self.root}: {safeio.why(e)}"
                self.runs, self.skipped, self._listings = {}, [], {}
                self.scanned_at = now
                return self.runs
            try:
                self._walk(fd, "", 0, now)
                keep = set(keep)
                for rid, prev in self.runs.items():
                    if rid not in self._found and (self._truncated or rid in keep) and _exists(fd, rid):
                        self._found[rid] = prev
            finally:
                os.close(fd)
            self.error = None
            self.runs = self._found
            self.skipped = self._skipped
            self.truncated = self._truncated
            self.cut = self._cut
            self._listings = self._next_listings
            self.entries_seen = self._entries
            self.scanned_at = now
            return self.runs

    def _skip(self, path: str, reason: str) -> None:
        if len(self._skipped) < MAX_SKIPPED:
            self._skipped.append(Skipped(path, reason))

    def _walk(self, fd: int, rel: str, depth: int, now: float) -> None:
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        if ident in self._seen:
            # Only a bind mount can do this (symlinks are never followed).
            self._skip(rel, "a directory loop (the same directory twice): not followed")
            return
        self._seen.add(ident)
        listing = self._listing(fd, rel, _key(st))
        if listing is None:
            return
        if depth > 0:
            markers = set(listing.markers)
            log_names: list[str] = []
            log_key = None
            if listing.has_log_dir:
                log_key, log_names = self._log_listing(fd, rel)
                if any(WORKER_NAME.fullmatch(n) for n in log_names):
                    markers.add(LOGS)
            if markers:
                self._found[rel] = self._run(
                    fd, rel, listing, tuple(sorted(markers)), log_key, log_names, now
                )
                return
        # A run's own entries (a checkpoint's symlink) are not the scan's business.
        for s in listing.skipped:
            self._skip(s.path, s.reason)
        if depth >= self.depth:
            return
        for name in listing.subdirs:
            child = _join(rel, name)
            if self.on_enter is not None:
                self.on_enter(child)
            if self._unchanged_leaf(fd, name, child):
                continue
            try:
                cfd = safedirs.open_subdir(fd, name)
            except OSError as e:
                self._skip(child, _reason(e))
                continue
            try:
                self._walk(cfd, child, depth + 1, now)
            except OSError as e:
                self._skip(child, _reason(e))
            finally:
                os.close(cfd)

    def _unchanged_leaf(self, fd: int, name: str, rel: str) -> bool:
        """Whether ``rel`` is a directory with nothing to look at whose key held: one ``stat``, no open.

        A root of many empty (or run-less) directories then costs one system
        call per directory on each scan. Anything else is opened and walked.
        """
        old = self._listings.get(rel)
        if old is None or old.subdirs or old.markers or old.has_log_dir:
            return False
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        if not stat.S_ISDIR(st.st_mode) or _key(st) != old.key or (st.st_dev, st.st_ino) in self._seen:
            return False
        self._seen.add((st.st_dev, st.st_ino))
        self._entries += old.entries
        self._next_listings[rel] = old
        for s in old.skipped:
            self._skip(s.path, s.reason)
        return True

    def _listing(self, fd: int, rel: str, key: tuple) -> _Listing | None:
        """The directory's listing: the last one if its key holds, else read now (bounded)."""
        old = self._listings.get(rel)
        if old is not None and old.key == key:
            self._entries += old.entries
            self._next_listings[rel] = old
            return old
        listing = _Listing(key)
        markers = set()
        cut = False
        log_first = self.log_parts[0] if self.log_parts else None
        try:
            with os.scandir(fd) as it:
                for entry in it:
                    if listing.entries >= self.max_entries:
                        # A partial listing is not kept: the next scan reads it again.
                        self._truncated = cut = True
                        if len(self._cut) < MAX_SKIPPED:
                            self._cut.append(rel or ".")
                        break
                    listing.entries += 1
                    name = entry.name
                    try:
                        name.encode("utf-8")
                    except UnicodeEncodeError:
                        listing.skipped.append(
                            Skipped(_join(rel, repr(name)[1:-1]), "name is not valid UTF-8")
                        )
                        continue
                    try:
                        if entry.is_symlink():
                            listing.skipped.append(Skipped(_join(rel, name), "a symlink: not followed"))
                            continue
                        is_dir = entry.is_dir(follow_symlinks=False)
                        is_file = not is_dir and entry.is_file(follow_symlinks=False)
                    except OSError:
                        continue
                    listing.names.append(name)
                    if is_dir and name == STATE_DIR:
                        markers.add(STATE)
                    elif is_file and name == FLAG_NAME:
                        markers.add(FLAG)
                    if is_dir and name == log_first:
                        listing.has_log_dir = True
                    if is_dir:
                        listing.subdirs.append(name)
        except OSError as e:
            self._skip(rel or ".", _reason(e))
            return None
        self._entries += listing.entries
        listing.markers = frozenset(markers)
        listing.subdirs.sort()
        if not cut:
            self._next_listings[rel] = listing
        return listing

    def _sub_listing(self, fd: int, rel: str, parts: list[str]) -> tuple[tuple | None, list[str]]:
        """(the key, the entry names) of the directory ``parts`` below ``fd``, cached like any listing."""
        try:
            cur = _open_parts(fd, parts)
        except OSError:
            return None, []
        try:
            key = _key(os.fstat(cur))
            sub = _join(rel, "/".join(parts))
            old = self._listings.get(sub)
            if old is not None and old.key == key:
                self._next_listings[sub] = old
                return key, old.names
            names: list[str] = []
            with os.scandir(cur) as it:
                for n, entry in enumerate(it):
                    if n >= MAX_ACTIVITY_FILES:
                        break
                    names.append(entry.name)
            self._next_listings[sub] = _Listing(key, names=names)
            return key, names
        except OSError:
            return None, []
        finally:
            os.close(cur)

    def _log_listing(self, fd: int, rel: str) -> tuple[tuple | None, list[str]]:
        return self._sub_listing(fd, rel, self.log_parts)

    # -- liveness ---------------------------------------------------------------

    def _run(
        self, fd: int, rel: str, listing: _Listing, markers: tuple, log_key, log_names: list[str], now: float
    ) -> RunEntry:
        state_key, state_names = (None, [])
        if STATE in markers:
            state_key, state_names = self._sub_listing(fd, rel, [STATE_DIR])
        signature = (listing.key, state_key, log_key)
        prev = self.runs.get(rel)
        if (
            prev is not None
            and prev.signature == signature
            and not prev.live
            and now - prev.checked_at < IDLE_RECHECK_S
        ):
            last, checked, evidence = prev.last_activity, prev.checked_at, prev.evidence
        else:
            (last, evidence), checked = self._activity(fd, state_names, log_names, now), now
        live = last is not None and now - last <= self.idle_s
        return RunEntry(
            id=rel,
            path=os.path.join(self.root, rel),
            markers=markers,
            last_activity=last,
            live=live,
            signature=signature,
            checked_at=checked,
            evidence=evidence if live else 0,
            ident=listing.key[:2],
        )

    def _activity(
        self, fd: int, state_names: list[str], log_names: list[str], now: float
    ) -> tuple[float | None, int]:
        """(The newest mtime among the run's heartbeats and worker logs, how many count).

        Regular, non-empty files only, and none dated past ``now + FUTURE_SLACK_S``.
        """
        newest, count = None, 0
        for parts, names, pattern in (
            ([STATE_DIR], state_names, HEARTBEAT_NAME),
            (self.log_parts, log_names, WORKER_NAME),
        ):
            wanted = [n for n in names if pattern.fullmatch(n)]
            if not wanted:
                continue
            try:
                dfd = _open_parts(fd, parts)
            except OSError:
                continue
            try:
                for name in wanted[:MAX_ACTIVITY_FILES]:
                    try:
                        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    except OSError:
                        continue
                    if not stat.S_ISREG(st.st_mode) or st.st_size == 0 or st.st_mtime > now + FUTURE_SLACK_S:
                        continue
                    count += 1
                    if newest is None or st.st_mtime > newest:
                        newest = st.st_mtime
            finally:
                os.close(dfd)
        return newest, count

    # -- what the API shows -----------------------------------------------------

    def status(self) -> dict:
        """The last scan: when, how much, what was skipped and why."""
        return {
            "root": self.root,
            "scanned_at": self.scanned_at,
            "runs": len(self.runs),
            "live": sum(1 for r in self.runs.values() if r.live),
            "entries_seen": self.entries_seen,
            "truncated": self.truncated,
            "cut_short": list(self.cut),
            "error": self.error,
            "skipped": [s.to_dict() for s in self.skipped],
        }
