"""The checkpoint index as the pages get it: whole (``body``), then only the sets that changed.

``IndexView`` makes the body of ``GET /api/checkpoints`` from an index, set by
set: each set's own fields (``CheckpointSet.to_dict``), what the dashboard
adds to them (``extras``: the launch series, the notes, the health, the
deep verify) and the summary around them.

``IndexPushes`` is what the checkpoint pages were last sent, for the
``checkpoints`` and ``checkpoints_delta`` events (``app/push.py``'s rules,
as ``RankPushes`` for the rank table). The first push, or one after
``forget``, is the whole body; after it, a delta with the sets added (whole,
with their files), the sets whose files changed (their own fields, and the
files added or changed, ``files_changed``, and the paths gone,
``files_removed``), the sets whose extras alone changed (their id and those
fields), the ids of the sets gone, and the summary fields that changed,
``order`` (the sets' ids, newest first) among them. Which sets changed is
told by the grouping (``trainer_bridge/rundir/ckptgroup.py`` keeps every set
no changed path is in as the very same object, and every unchanged file),
so only the others' files are compared: at 12,500 hosts the index holds a
million files, a new set on one host is one set, and a host adding its
files to a set all hosts save is that host's files.

Each push has a version, one more than the last; a delta names the version it
applies to (``base``). A page that holds another version missed a push, and
asks for the whole index (``checkpoints_index``); so does a page that
connects. ``apply_delta`` is how a page applies one (``static/js/checkpoints.js``
does the same).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping
from typing import Any

from app.checkpoints import target
from app.checkpoints.resume import TTP_NOTE, bridge_default, ranks_text
from app.checkpoints.retention import interrupted
from app.push import CHECKPOINTS_DELTA_EVENT, CHECKPOINTS_EVENT, changed_fields
from trainer_bridge.rundir import ckpthealth, rollbacks
from trainer_bridge.rundir.ckptindex import CheckpointFile, CheckpointSet, Index
from trainer_bridge.rundir.ckptpaths import ORIGIN_TTP

BRIDGE_DEFAULT_NOTE = (
    "The bridge resumes from this set when the job is relaunched unchanged "
    "(the newest complete graceful-stop set)."
)
# Summary fields that change at every scan or push and tell nothing of the index: sent with every delta.
_ALWAYS = ("now", "scanned_at")
# A changed set's files in a delta: those added or changed, and the paths gone.
_FILE_CHANGES = ("files_changed", "files_removed")


class IndexView:
    """One index as the API and the pages show it (``verifier``: each set's deep verify; ``health``:
    ``ckpthealth.unhealthy``'s memo, kept by the caller between indexes)."""

    def __init__(self, index: Index, world: int, run_dir: str | None, verifier, health: dict | None = None):
        self.index = index
        self.world = world
        self.now = time.time()
        self.verifier = verifier
        self.unhealthy = ckpthealth.unhealthy(run_dir, index, memo=health)
        # The sets a loss-spike rollback went back past: rankwatch launch never resumes one
        # (target.left_behind); the bridge alone does not know them, so its ★ may fall on one.
        self.left = target.left_behind(index, rollbacks.read_lines(run_dir)[0]) if run_dir else {}
        self.default = bridge_default(index, self.unhealthy)
        self.deleting = interrupted(run_dir)
        self.series = _launch_series([s.layout for s in index.sets])

    def set_dict(self, s: CheckpointSet, extras: dict | None = None) -> dict:
        """A set as the body lists it, with its files."""
        return s.to_dict(self.now) | (self.extras(s) if extras is None else extras)

    def extras(self, s: CheckpointSet) -> dict:
        """What the dashboard adds to a set's own fields (none of them is its files)."""
        unhealthy = self.unhealthy.get(s.id)
        notes = _notes(s, self.default)
        if unhealthy:
            notes.append(f"unhealthy: {unhealthy}; the bridge does not resume from it")
        if s.id in self.left:
            notes.append(
                f"{self.left[s.id]}: its weights are the spike's; rankwatch launch never resumes from it"
                + ("; pin an older set to relaunch by hand" if self.default is s else "")
            )
        if s.id in self.deleting:
            notes.append(
                "being deleted by retention (interrupted): partial on purpose; the next retention run finishes it"
            )
        return {
            "series": self.series.get(s.layout),
            "notes": notes,
            "unhealthy": unhealthy,
            "verify": self.verifier.status(s.id),
        }

    def summary(self) -> dict:
        """The body's fields but its sets."""
        index, default = self.index, self.default
        # The newest complete set with no evidence against its weights: a NaN breakpoint save is
        # often the newest file on disk, and the ★ must not send anyone there.
        newest = next(
            (
                s
                for s in sorted(index.sets, key=lambda s: -(s.global_step or 0))
                if s.complete
                and s.global_step is not None
                and s.id not in self.unhealthy
                and s.id not in self.left
            ),
            None,
        )
        return {
            **index.head_dict(),
            "now": self.now,
            "bridge_resume": default.id if default else None,
            # The ★ of the page and the CLI: what an unchanged relaunch resumes from, else the
            # newest complete set (a periodic set beside the stop's own got it: issue 33).
            "star": default.id if default else (newest.id if newest else None),
            "newest_healthy": newest.id if newest else None,
            "total_bytes": sum(s.bytes for s in index.sets),
            "world_size_source": "job" if self.world else "layout",
        }

    def body(self) -> dict:
        """The body of ``GET /api/checkpoints`` (and of the ``checkpoints`` event)."""
        summary = self.summary()
        return {**summary, "sets": [self.set_dict(s) for s in self.index.sets]}


def _notes(s: CheckpointSet, default: CheckpointSet | None) -> list[str]:
    notes = []
    if default is not None and s.id == default.id:
        notes.append(BRIDGE_DEFAULT_NOTE)
    if s.origin == ORIGIN_TTP:
        notes.append(TTP_NOTE)
    if s.ranks_corrupt:
        notes.append(f"unreadable file on {ranks_text(s.ranks_corrupt, True)}: see each file's reason")
    if s.ranks_missing:
        notes.append(
            f"no readable file for {ranks_text(s.ranks_missing, True)}: those ranks cannot resume from this set"
        )
    return notes


def _file_changes(old: CheckpointSet, new: CheckpointSet) -> tuple[list[CheckpointFile], list[str]] | None:
    """(the files of ``new`` that ``old`` lacks or holds otherwise, the paths ``new`` lacks), or None:
    the same files and world (the set was regrouped, or scanned afresh, to the same)."""
    before = {f.path: f for f in old.files}
    changed = [f for f in new.files if (b := before.pop(f.path, None)) is not f and b != f]
    if not changed and not before and new.world_size == old.world_size:
        return None
    return changed, sorted(before)


class IndexPushes:
    """What the checkpoint pages were last sent of the index; ``take`` makes the next push."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.version = 0
        # set id -> (the set as last pushed, its extras as pushed)
        self._sets: dict[str, tuple[CheckpointSet, dict]] = {}
        self._summary: dict = {}
        self._whole = True

    def forget(self) -> None:
        """Push the whole index next: the pages may have missed the last push (a new leader)."""
        with self._lock:
            self._whole = True

    def take(self, view: IndexView) -> tuple[str, dict] | None:
        """(CHECKPOINTS_EVENT, the whole body), (CHECKPOINTS_DELTA_EVENT, the changes), or None."""
        with self._lock:
            if self._whole:
                self._whole = False
                self._sets.clear()
                body = view.summary()
                body["sets"] = []
                for s in view.index.sets:
                    extras = view.extras(s)
                    self._sets[s.id] = (s, extras)
                    body["sets"].append(view.set_dict(s, extras))
                self._summary = _compared(body) | {"order": [s.id for s in view.index.sets]}
                self.version += 1
                return CHECKPOINTS_EVENT, body | {"version": self.version}
            return self._delta(view)

    def _delta(self, view: IndexView) -> tuple[str, dict] | None:
        changed = []
        for s in view.index.sets:
            extras = view.extras(s)
            held = self._sets.get(s.id)
            self._sets[s.id] = (s, extras)
            if held is None:
                changed.append(view.set_dict(s, extras))
                continue
            files = _file_changes(held[0], s) if held[0] is not s else None
            if files is not None:
                # Its own fields (its ranks, size, age follow its files) and the files that changed.
                entry = s.to_dict(view.now, files=False) | extras
                entry["files_changed"] = [f.to_dict() for f in files[0]]
                entry["files_removed"] = files[1]
                changed.append(entry)
                continue
            diff = changed_fields(held[1], extras)
            if diff:
                changed.append({"id": s.id, **diff})
        ids = {s.id for s in view.index.sets}
        removed = sorted(self._sets.keys() - ids)
        for gone in removed:
            del self._sets[gone]
        summary = view.summary()
        now = _compared(summary) | {"order": [s.id for s in view.index.sets]}
        fields = changed_fields(self._summary, now)
        self._summary = now
        if not (changed or removed or fields):
            return None
        base, self.version = self.version, self.version + 1
        delta: dict[str, Any] = {"version": self.version, "base": base, **{k: summary[k] for k in _ALWAYS}}
        if fields:
            delta["summary"] = fields
        if changed:
            delta["sets"] = changed
        if removed:
            delta["removed"] = removed
        return CHECKPOINTS_DELTA_EVENT, delta


def _compared(body: Mapping) -> dict:
    return {k: v for k, v in body.items() if k not in _ALWAYS and k != "sets"}


def apply_delta(whole: dict, delta: dict) -> dict | None:
    """``whole`` (a ``checkpoints`` body, as a page holds it) with ``delta`` applied; None if the
    page missed a push and must ask for the whole index (its ``version`` is not ``delta``'s base).
    A delta the whole index includes already (it was asked for meanwhile) changes nothing.

    A whole index without a version (sent by a dashboard that does not lead: ``app/watcher.py``)
    takes the next delta as it comes; its sets are replaced by id, so nothing is applied twice.
    """
    version = whole.get("version")
    if version is not None and delta["version"] <= version:
        return whole
    if version is not None and delta["base"] != version:
        return None
    sets = {s["id"]: s for s in whole["sets"]}
    for gone in delta.get("removed", ()):
        sets.pop(gone, None)
    for s in delta.get("sets", ()):
        old = sets.get(s["id"], {})
        new = old | {k: v for k, v in s.items() if k not in _FILE_CHANGES}
        if "files_changed" in s:
            files = {f["path"]: f for f in old.get("files", ())}
            for gone in s["files_removed"]:
                files.pop(gone, None)
            files.update((f["path"], f) for f in s["files_changed"])
            # A set's files are in ckptindex's order: lowest rank first, then by path.
            new["files"] = sorted(files.values(), key=lambda f: (f["rank"], f["path"]))
        sets[s["id"]] = new
    fields = dict(delta.get("summary", {}))
    order = fields.pop("order", None) or [s["id"] for s in whole["sets"]]
    out = whole | fields | {k: delta[k] for k in _ALWAYS} | {"version": delta["version"]}
    out["sets"] = [sets[i] for i in order if i in sets]
    return out


# ModelCheckpoint's file name: PREFIX-EPOCH_STEP.ckpt; on a name collision (a relaunch into
# the same directory) MindSpore saves as PREFIX_1, PREFIX_2, ... (ckptindex's layout: -{E}_{S}).
_SERIES_RE = re.compile(r"^(?P<base>.+?)(?:_(?P<n>\d+))?-\{E\}_\{S\}(?P<ext>\.\w+)$")


def _launch_series(layouts: list[str]) -> dict[str, dict]:
    """Layouts that are one series saved by successive launches, labelled by launch.

    ``lenet``, ``lenet_1``, ``lenet_2`` in one directory are not three models but
    three launches: ``{layout: {"base": "lenet", "launch": 1..3, "launches": 3}}``
    for each, so the page can say so instead of listing look-alike duplicates.
    """
    groups: dict[tuple, dict[int, str]] = {}
    for layout in set(layouts):
        head, _, name = layout.rpartition("/")
        m = _SERIES_RE.match(name)
        if m:
            n = int(m["n"]) if m["n"] else 0
            groups.setdefault((head, m["base"], m["ext"]), {})[n] = layout
    out = {}
    for (_, base, _), members in groups.items():
        if 0 not in members or len(members) < 2:
            continue  # "resnet_50" alone is a name, not a relaunch
        order = sorted(members)
        for i, n in enumerate(order):
            out[members[n]] = {"base": base, "launch": i + 1, "launches": len(order)}
    return out
