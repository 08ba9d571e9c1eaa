"""The checkpoint browser's model: index the run directory, and act on one set.

``CheckpointService`` owns one ``MetaCache`` for the dashboard's life, so a
re-scan opens only new or changed files and costs a ``stat`` for the rest.
It re-scans at most every ``CHECKPOINT_SCAN_S`` seconds, whoever asks (the
watcher's tick, an API read, a connecting client), and regroups only the
sets whose files appeared, changed or went away (``ckptgroup``), whether
the files are this directory's or the agents'. It remembers what the pages
were last sent (``app/checkpoints/indexbody.py``), so that the watcher pushes
only when a set changed, and then only that set.

World size: a set is complete when every rank of the *job* has a readable
file in it, so the job's world size (``job.json``, else the heartbeats) is
used when known; without a job, each layout counts up to its highest rank.

Indexing and the layouts are ``trainer_bridge.rundir.ckptindex``'s; this module adds
what the dashboard needs around them: the API body, which sets are
protected from deletion, how to resume from a set, the download check and
the delete itself. It never imports mindspore (``verify`` loads files in a
subprocess).
"""

from __future__ import annotations

import errno
import os
import re
import threading
import time
from collections import ChainMap
from collections.abc import Callable, Mapping
from typing import BinaryIO

from app.audit import AuditLog
from app.checkpoints import resume
from app.checkpoints.indexbody import IndexPushes, IndexView
from app.checkpoints.resume import bridge_default
from app.checkpoints.retention import Retention
from app.checkpoints.verify import Verifier
from app.errors import (
    NO_RUN_DIR,
    BadRequest,
    CheckpointRefused,
    FileElsewhere,
    Forbidden,
    NoRunDir,
    NotFound,
    SetBusy,
    SetNotFound,
)
from trainer_bridge.rundir import ckptgroup, ckptindex, safedirs, safeio
from trainer_bridge.rundir.ckptindex import CheckpointFile, CheckpointSet, Index
from trainer_bridge.rundir.ckptmeta import MetaCache

# What ``remote`` gives without agents: nothing, and the same object every time (nothing changed).
_NO_AGENTS: tuple = ({}, [], ())


class CheckpointService:
    """The run directory's checkpoint index, kept fresh, plus the actions on a set.

    ``world`` arguments are the job's world size as ``RunState.heartbeats``
    gives it (0 when unknown). Methods are safe to call from the watcher's
    thread and request threads at once.
    """

    def __init__(
        self,
        run_dir: str | None,
        audit: AuditLog,
        *,
        scan_s: float,
        verifier: Verifier,
        config: Mapping | None = None,
        remote: Callable[[bool], tuple] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_dir = run_dir
        self.audit = audit
        self.scan_s = scan_s
        self.verifier = verifier
        self.cache = MetaCache()
        self._clock = clock
        self._lock = threading.Lock()
        self.delete_lock = threading.Lock()
        self._index: Index | None = None
        self._scanned: tuple[float, int] | None = None  # (monotonic time, world) of the scan
        self.pushes = IndexPushes()  # what the pages were last sent of the index
        self._poll_lock = threading.Lock()
        # ckpthealth.unhealthy's answers by set while the set is unchanged (``poll``'s, under its lock).
        self._health: dict = {}
        # With agents and no shared filesystem: (wait) -> (the other nodes' files, errors, and the
        # paths changed since the last call: ``Listings.files``'s ``Remote``; without them, all may
        # have) (HubSource.checkpoint_files; ``wait``: a request may wait for a node's first listing).
        self.remote = remote
        self._remote_seen: tuple | None = None  # what ``remote`` last gave, and this directory's files then
        self._local_seen: tuple | None = None
        self._local_files: dict[str, CheckpointFile] = {}  # this directory's, as last merged
        self._grouping = ckptgroup.Grouping()  # the merged index, regrouped where paths changed
        self._polled: Index | None = None  # the index ``poll`` last looked at
        # The retention plan and its automatic mode, over this index (``config``: the RETENTION_* settings).
        self.retention = Retention(self, config) if config is not None else None

    # -- the index -------------------------------------------------------------------

    def index(self, world: int, force: bool = False, *, wait: bool = True) -> Index:
        """The index, re-scanned first if it is older than ``scan_s``, the world changed, or ``force``.

        ``wait`` False (the watcher's tick): with agents, never wait for a node's listing, nor
        for a request's scan, which may be waiting for one: the last index is taken instead.
        """
        if not self._lock.acquire(blocking=wait or self._index is None):
            return self._index
        try:
            now = self._clock()
            if (
                force
                or self._index is None
                or self._scanned[1] != world
                or now - self._scanned[0] >= self.scan_s
            ):
                self._index = self._scan(world, wait)
                self._scanned = (now, world)
            return self._index
        finally:
            self._lock.release()

    def _scan(self, world: int, wait: bool = True) -> Index:
        if self.remote is None and self.run_dir is None:
            return Index("", time.time(), None, (), (), (NO_RUN_DIR,))
        return self._merged(world, wait)

    def _merged(self, world: int, wait: bool) -> Index:
        """This directory's files and every agent's (if any), grouped together (a set spans the nodes).

        A file this dashboard holds itself is served from here, so it wins over an agent's listing of it.
        """
        scanned_at = time.time()
        files, errors = ckptindex.walk(self.run_dir, self.cache) if self.run_dir else ([], [])
        remote = self.remote(wait) if self.remote is not None else _NO_AGENTS
        # The agents' listings come back as the very same object while none changed: with this
        # directory's files and the world unchanged too, the last grouping stands. Otherwise
        # (``Listings.files``) they name the paths that changed, and only their sets are grouped
        # again: at 12,500 hosts, grouping every node's files costs far more than the walk here.
        seen = (world, files, errors)
        if remote is self._remote_seen and seen == self._local_seen and self._index is not None:
            return self._index
        theirs, their_errors, *rest = remote
        changed = (
            set() if remote is self._remote_seen else (set(rest[0]) if rest and rest[0] is not None else None)
        )
        if not isinstance(theirs, Mapping):
            theirs, changed = {f.path: f for f in theirs}, None
        here = {f.path: f for f in files}
        before = self._local_files
        if changed is not None:
            changed |= {p for p in here.keys() | before.keys() if here.get(p) != before.get(p)}
        self._remote_seen, self._local_seen, self._local_files = remote, seen, here
        return self._grouping.index(
            os.fspath(self.run_dir) if self.run_dir else "",
            ChainMap(here, theirs),
            changed,
            world or None,
            errors + their_errors,
            scanned_at,
        )

    def body(self, world: int) -> dict:
        """The body of ``GET /api/checkpoints`` (and of the ``checkpoints`` event)."""
        return self._view(self.index(world), world).body()

    def whole(self, world: int, pushing: bool) -> dict:
        """The body a page starts from (it connects, or missed a push), with the version of the
        last push it includes; ``pushing`` False (a dashboard that does not lead, whose versions
        are not the ones the pages get): no version, and the page takes the next delta as it comes."""
        version = self.pushes.version
        return self.body(world) | {"version": version if pushing else None}

    def poll(self, world: int) -> tuple[str, dict] | None:
        """What to push if the index changed since the last poll: (event, payload), else None.

        The watcher calls this every tick and pushes what it returns; a route
        that changed the files (delete) calls it to push at once. The first
        push is the whole index; later ones, only the sets that changed
        (``app/checkpoints/indexbody.py``).
        """
        index = self.index(world, wait=False)
        with self._poll_lock:
            # The same index as last time (nothing was re-grouped): nothing can have changed.
            if index is self._polled:
                return None
            self._polled = index
            return self.pushes.take(self._view(index, world, self._health))

    def resend(self) -> None:
        """The next poll pushes the whole index (the pages may have missed the last push)."""
        with self._poll_lock:
            self._polled = None
            self.pushes.forget()

    def _view(self, index: Index, world: int, health: dict | None = None) -> IndexView:
        return IndexView(index, world, self.run_dir, self.verifier, health)

    def find(self, set_id: str, world: int, force: bool = False) -> tuple[Index, CheckpointSet]:
        if self.run_dir is None:
            raise NoRunDir()
        index = self.index(world, force)
        found = next((s for s in index.sets if s.id == set_id), None)
        if found is None:
            raise SetNotFound(set_id)
        return index, found

    # -- download --------------------------------------------------------------------

    def open_file(self, rel: str, world: int) -> tuple[BinaryIO, str, int]:
        """Open a checkpoint file the index lists, by its path relative to the run directory.

        Only listed files are served, so nothing else in the run directory
        (the audit database, the job's data) can be fetched. ``safeio.parts``
        refuses ``..`` and absolute paths (a 400 that says so); the file is then
        opened through ``trainer_bridge.rundir.safeio``, one directory at a time
        without following a symlink, so no symlink, placed before or swapped in
        after any check, can redirect it. Returns (the open file, its name for
        the download, its size).
        """
        if self.run_dir is None:
            raise NoRunDir()
        try:
            safeio.parts(rel)
        except safeio.UnsafePath as e:
            raise BadRequest(str(e)) from None
        index = self.index(world)
        known = {f.path: f for s in index.sets for f in s.files} | {f.path: f for f in index.other_files}
        if rel not in known:
            raise NotFound(
                f"{rel!r} is not a checkpoint file of this run "
                "(only the files GET /api/checkpoints lists can be downloaded)",
            )
        local_only([known[rel]], "downloaded")
        try:
            fd, st = safeio.open_file(safedirs.anchor(self.run_dir), rel)
        except OSError as e:
            refusal = Forbidden if e.errno in (errno.EPERM, errno.EACCES) else NotFound
            raise refusal(f"cannot open {rel!r}: {safeio.why(e)}") from None
        # A file name may hold control characters (a newline), which no header can carry.
        return os.fdopen(fd, "rb"), re.sub(r"[\x00-\x1f\x7f]", "_", rel.rsplit("/", 1)[-1]), st.st_size

    # -- delete ----------------------------------------------------------------------

    def delete(
        self, set_id: str, world: int, *, who: str, remote_addr: str | None, reason: str, force: bool
    ) -> dict:
        """Delete every file of a set and the rank directories it leaves empty; audit it.

        The newest complete set, and the set the bridge would resume from,
        are refused (409) unless ``force``: deleting them changes where the
        job can resume. A set being verified is refused too. Files are
        removed by their directory entry, so MindSpore's read-only (0400)
        files go as well. A file that cannot be removed is reported, and
        the others are still removed.
        """
        with self.delete_lock:
            index, cset = self.find(set_id, world, force=True)
            detail = {
                "set": cset.id,
                "origin": cset.origin,
                "global_step": cset.global_step,
                "files": [f.path for f in cset.files],
                "force": force,
            }
            protected = self._protection(index, cset)
            if protected and not force:
                why = f'{protected}; send "force": true to delete it anyway'
                self.audit.record(
                    "delete",
                    who=who,
                    remote_addr=remote_addr,
                    reason=reason,
                    outcome=f"refused: {protected}",
                    detail=detail,
                )
                raise CheckpointRefused(why)
            local_only(cset.files, "deleted")
            if self.verifier.running(cset.id):
                raise SetBusy("a deep verify of this set is running; delete it when it ends")
            deleted, failed, dirs = self.remove_set(cset)
            self.verifier.forget(cset.id)
            outcome = (
                f"deleted: {_files(len(deleted))}"
                if not failed
                else f"partial: deleted {len(deleted)} of {_files(len(cset.files))}"
            )
            self.audit.record(
                "delete",
                who=who,
                remote_addr=remote_addr,
                reason=reason,
                outcome=outcome,
                detail=detail | {"failed": failed, "removed_dirs": dirs},
            )
            self.index(world, force=True)
        return {"set": cset.id, "deleted": deleted, "failed": failed, "removed_dirs": dirs}

    @staticmethod
    def _protection(index: Index, cset: CheckpointSet) -> str | None:
        newest = index.newest_complete
        if newest is not None and cset.id == newest.id:
            return "this is the newest complete set: the newest step every rank can resume from"
        default = bridge_default(index)
        if default is not None and cset.id == default.id:
            return "the bridge resumes from this set on an unchanged relaunch"
        return None

    def remove_set(self, cset: CheckpointSet) -> tuple[list[str], list[dict], list[str]]:
        """Unlink each file of the set, lowest rank first, and the per-rank directories it leaves empty.

        Lowest rank first (``CheckpointSet.files``' order): the first unlink
        makes the set partial for every reader, so no interruption can leave
        it looking complete (``app/checkpoints/retention.py``).

        Through ``trainer_bridge.rundir.safeio``: each unlink is made on a descriptor of the
        file's own directory reached without following a symlink, so a
        directory swapped for a symlink since the scan cannot make it remove
        a file outside the run directory.
        """
        root = safedirs.anchor(self.run_dir)
        deleted, failed, dirs = [], [], set()
        for f in cset.files:
            if f.host is not None:
                failed.append({"path": f.path, "error": f"on host {f.host}: delete it on that node"})
                continue
            try:
                safeio.unlink(root, f.path)
            except OSError as e:
                if e.errno != errno.ENOENT:  # a file already gone is what a delete wants
                    failed.append({"path": f.path, "error": safeio.why(e)})
                    continue
            except safeio.UnsafePath as e:
                failed.append({"path": f.path, "error": str(e)})
                continue
            deleted.append(f.path)
            dirs.update(self._prune_dirs(root, f, cset.layout))
        return deleted, failed, sorted(dirs)

    @staticmethod
    def _prune_dirs(root: str, f: CheckpointFile, layout: str) -> list[str]:
        """Remove the file's per-rank and per-step directories if they are now empty.

        Only directories that the layout names with a placeholder (``rank_{rank}``,
        TTP's ``…-step_{G}``) are candidates: a series' own directory
        (``checkpoints/``) stays. ``rmdir`` removes only empty directories,
        so a concurrent save into one is never lost.
        """
        removed = []
        parts = f.path.split("/")[:-1]
        templates = layout.split("/")[:-1]
        for depth in range(len(parts), 0, -1):
            if "{" not in templates[depth - 1]:
                break
            rel = "/".join(parts[:depth])
            try:
                safedirs.rmdir(root, rel)
            except OSError:
                break  # not empty (or gone, or swapped): leave it and everything above
            removed.append(rel)
        return removed

    # -- resume ----------------------------------------------------------------------

    def resume(self, set_id: str, world: int, heartbeats: Mapping[int, dict | None]) -> dict:
        """How to resume from a set: the relaunch command and the code that loads it (``resume.advice``)."""
        index, cset = self.find(set_id, world)
        return resume.advice(self.run_dir, index, cset, heartbeats)


def local_only(files, action: str) -> None:
    """FileElsewhere unless every file is on this dashboard's disk (an agent listed the others)."""
    hosts = sorted({f.host for f in files if f.host is not None})
    if hosts:
        raise FileElsewhere(
            f"{_files(sum(1 for f in files if f.host is not None))} of this are on host {', '.join(hosts[:8])}"
            f"{' and others' if len(hosts) > 8 else ''}, not on this dashboard's disk: they can be "
            f"{action} only there (listed through the node's agent)"
        )


def _files(n: int) -> str:
    return f"{n} file" if n == 1 else f"{n} files"
