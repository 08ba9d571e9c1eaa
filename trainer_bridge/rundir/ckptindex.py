"""Find the checkpoints under a run directory and group them into sets.

A *set* is the checkpoints the ranks of one job saved at one step; it is
*complete* when every rank 0..world_size-1 has a readable file in it, which
is what a resume needs. The dashboard lists sets (``GET /api/checkpoints``)
and the bridge resumes from the newest complete one. Like ``ckptmeta``, this
module must not import mindspore.

Which file is a checkpoint, and its origin, rank and layout, is read from
its path (``ckptpaths``, whose docstring lists the layouts recognised).
Files are grouped first by *layout*: the path with its rank, step and epoch
replaced by placeholders, so two ModelCheckpoint series in one directory
(``train-…`` and ``train_1-…``) stay apart. Within a layout, files with the
same global step form a set; without a global step, the same ``(epoch,
step)`` from the name; without either, the layout alone. A file whose
contents cannot be read borrows the global step of its readable peers with
the same name, so a corrupt rank shows up in the set it belongs to.

``.mindir`` files are listed in ``other_files`` but never make up sets.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Container
from dataclasses import dataclass

from trainer_bridge.rundir import safedirs
from trainer_bridge.rundir.ckptmeta import (
    CheckpointMeta,
    MetaCache,
    steps_from_name,
)
from trainer_bridge.rundir.ckptpaths import ORIGIN_BRIDGE, classify, walk_tree

SET_FORMATS = ("ckpt", "safetensors")


@dataclass(frozen=True)
class CheckpointFile:
    """One checkpoint file: where it is, which rank saved it, what it holds."""

    path: str  # relative to the run directory, with "/" separators
    abspath: str
    rank: int
    origin: str
    layout: str
    meta: CheckpointMeta
    # The node that holds it when an agent listed it (``app/agent/ask.py``); None: this run directory.
    host: str | None = None

    @property
    def ok(self) -> bool:
        return self.meta.ok

    def to_dict(self) -> dict:
        m = self.meta
        return {
            **({"host": self.host} if self.host is not None else {}),
            "path": self.path,
            "rank": self.rank,
            "bytes": m.bytes,
            "format": m.format,
            "mtime": m.mtime,
            "epoch": m.epoch,
            "step": m.step,
            "global_step": m.global_step,
            "status": m.status,
            "reason": m.reason,
            "step_source": m.step_source,
        }


@dataclass(frozen=True)
class CheckpointSet:
    """The files the ranks of one layout saved at one step.

    ``ranks_missing`` lists every rank below ``world_size`` without a
    readable file, including those whose file is corrupt (``ranks_corrupt``).
    ``epoch``/``step``/``global_step`` are None when no file told them.
    """

    id: str
    origin: str
    layout: str
    epoch: int | None
    step: int | None
    global_step: int | None
    world_size: int
    files: tuple[CheckpointFile, ...]
    ranks_present: tuple[int, ...]
    ranks_missing: tuple[int, ...]
    ranks_corrupt: tuple[int, ...]
    bytes: int
    mtime: float

    @property
    def complete(self) -> bool:
        return not self.ranks_missing

    def file_for(self, rank: int) -> CheckpointFile | None:
        """Rank ``rank``'s readable file in this set (the newest, if several)."""
        ok = [f for f in self.files if f.rank == rank and f.ok]
        return max(ok, key=lambda f: f.meta.mtime) if ok else None

    def to_dict(self, now: float | None = None, files: bool = True) -> dict:
        """As the API lists it; ``files`` False: without its files (a push sends the changed ones)."""
        now = time.time() if now is None else now
        out = {
            "id": self.id,
            "origin": self.origin,
            "layout": self.layout,
            "epoch": self.epoch,
            "step": self.step,
            "global_step": self.global_step,
            "world_size": self.world_size,
            "complete": self.complete,
            "ranks_present": list(self.ranks_present),
            "ranks_missing": list(self.ranks_missing),
            "ranks_corrupt": list(self.ranks_corrupt),
            "bytes": self.bytes,
            "mtime": self.mtime,
            "age_s": round(max(0.0, now - self.mtime), 3),
        }
        if files:
            out["files"] = [f.to_dict() for f in self.files]
        return out


@dataclass(frozen=True)
class Index:
    """The result of one ``scan``: sets newest step first, plus everything else seen."""

    run_dir: str
    scanned_at: float
    world_size: int | None
    sets: tuple[CheckpointSet, ...]
    other_files: tuple[CheckpointFile, ...]
    errors: tuple[str, ...]

    @property
    def newest_complete(self) -> CheckpointSet | None:
        return next((s for s in self.sets if s.complete), None)

    @property
    def file_count(self) -> int:
        return sum(len(s.files) for s in self.sets) + len(self.other_files)

    def to_dict(self) -> dict:
        """The body of ``GET /api/checkpoints``."""
        return self.head_dict() | {"sets": [s.to_dict(self.scanned_at) for s in self.sets]}

    def head_dict(self) -> dict:
        """``to_dict`` but its sets (a push sends the sets that changed)."""
        newest = self.newest_complete
        return {
            "run_dir": self.run_dir,
            "scanned_at": self.scanned_at,
            "world_size": self.world_size,
            "file_count": self.file_count,
            "newest_complete": newest.id if newest else None,
            "other_files": [f.to_dict() | {"origin": f.origin} for f in self.other_files],
            "errors": list(self.errors),
        }


def scan(run_dir: str | os.PathLike, world_size: int | None = None, cache: MetaCache | None = None) -> Index:
    """Index every checkpoint under ``run_dir``; never raises for bad files or directories.

    ``world_size`` sets how many ranks a complete set needs; without it each
    layout uses its highest rank + 1. Pass the same ``cache`` to repeated
    scans so unchanged files are only stat'ed.
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"scan: world_size must be at least 1, got {world_size}")
    scanned_at = time.time()
    files, errors = walk(run_dir, cache)
    return build_index(os.fspath(run_dir), files, world_size, errors, scanned_at)


def walk(
    run_dir: str | os.PathLike, cache: MetaCache | None = None
) -> tuple[list[CheckpointFile], list[str]]:
    """(every checkpoint-like file under ``run_dir``, what could not be read): the walk half of ``scan``.

    An agent lists its node's files with it; ``build_index`` groups them.
    """
    cache = cache if cache is not None else MetaCache()
    root = safedirs.anchor(run_dir)
    errors: list[str] = []
    if not os.path.isdir(root):
        errors.append(f"run directory {os.fspath(run_dir)!r} does not exist or is not a directory")
        return [], errors
    files = []
    for rel_parts, abspath, st in walk_tree(root, errors):
        meta = cache.read(abspath, st)
        origin, rank, layout = classify(rel_parts)
        files.append(CheckpointFile("/".join(rel_parts), abspath, rank, origin, layout, meta))
    return files, errors


def build_index(
    run_dir: str,
    files: list[CheckpointFile],
    world_size: int | None,
    errors: list[str] | tuple[str, ...] = (),
    scanned_at: float | None = None,
) -> Index:
    """Group ``files`` into sets: the grouping half of ``scan``, also fed every node's files by a hub."""
    in_sets = [f for f in files if f.meta.format in SET_FORMATS]
    others = sorted((f for f in files if f.meta.format not in SET_FORMATS), key=lambda f: f.path)
    sets = _group(in_sets, world_size)
    return Index(
        run_dir,
        time.time() if scanned_at is None else scanned_at,
        world_size,
        tuple(sets),
        tuple(others),
        tuple(errors),
    )


def listing(f: CheckpointFile) -> dict:
    """What an agent tells a hub about one of its files (``from_listing`` makes it a file again)."""
    m = f.meta
    return {
        "path": f.path,
        "format": m.format,
        "bytes": m.bytes,
        "mtime": m.mtime,
        "status": m.status,
        "reason": m.reason,
        "epoch": m.epoch,
        "step": m.step,
        "global_step": m.global_step,
        "step_source": m.step_source,
    }


def from_listing(entry: dict, host: str) -> CheckpointFile:
    """A file another node listed (``listing``'s fields, already checked): rank, origin and layout
    come from its path here, as for a local file; it has no local path (``abspath`` is empty)."""
    parts = entry["path"].split("/")
    origin, rank, layout = classify(parts)
    meta = CheckpointMeta(
        path=entry["path"],
        format=entry["format"],
        bytes=entry["bytes"],
        mtime=entry["mtime"],
        status=entry["status"],
        reason=entry["reason"],
        epoch=entry["epoch"],
        step=entry["step"],
        global_step=entry["global_step"],
        step_source=entry["step_source"],
    )
    return CheckpointFile(entry["path"], "", rank, origin, layout, meta, host)


def _group(files: list[CheckpointFile], world_size: int | None) -> list[CheckpointSet]:
    by_layout: dict[tuple[str, str], list[CheckpointFile]] = defaultdict(list)
    for f in files:
        by_layout[(f.origin, f.layout)].append(f)
    sets = []
    for (origin, layout), group in by_layout.items():
        world = world_size or max(f.rank for f in group) + 1
        members = _members(group)
        sets.extend(_make_set(origin, layout, key, fs, world) for key, fs in members.items())
    sets.sort(key=_order, reverse=True)
    return sets


def _members(group) -> dict[tuple, list[CheckpointFile]]:
    """The files of one layout by the key of their set (``set_key``)."""
    # The global step each file name stands for, learnt from readable files,
    # so a corrupt file joins its peers' set.
    name_to_global = {}
    for f in group:
        if f.meta.global_step is None:
            continue
        name_steps = steps_from_name(f.path)[:2]
        if f.ok and None not in name_steps:
            name_to_global.setdefault(name_steps, f.meta.global_step)
    members: dict[tuple, list[CheckpointFile]] = defaultdict(list)
    for f in group:
        members[set_key(f, name_to_global)].append(f)
    return members


def set_key(f: CheckpointFile, name_to_global: dict | None = None) -> tuple:
    """The key of ``f``'s set within its layout: its global step, else (with ``name_to_global``,
    its layout's files' name -> global step) its name's, else its epoch and step."""
    g = f.meta.global_step
    if g is None and name_to_global:
        g = name_to_global.get(steps_from_name(f.path)[:2])
    if g is not None:
        return ("g", g)
    if f.meta.epoch is not None or f.meta.step is not None:
        return ("e", f.meta.epoch, f.meta.step)
    return ("?",)


def _make_set(origin: str, layout: str, key: tuple, files: list[CheckpointFile], world: int) -> CheckpointSet:
    files = sorted(files, key=lambda f: (f.rank, f.path))
    informed = [f for f in files if f.ok and (f.meta.epoch is not None or f.meta.step is not None)]
    source = informed[0].meta if informed else files[0].meta
    global_step = key[1] if key[0] == "g" else None
    if key[0] == "g":
        set_id = f"{layout}#g{global_step}"
    elif key[0] == "e":
        set_id = f"{layout}#e{key[1]}s{key[2]}"
    else:
        set_id = f"{layout}#unknown"
    ok_ranks = {f.rank for f in files if f.ok}
    return CheckpointSet(
        id=set_id,
        origin=origin,
        layout=layout,
        epoch=source.epoch,
        step=source.step,
        global_step=global_step,
        world_size=world,
        files=tuple(files),
        ranks_present=tuple(sorted(ok_ranks)),
        ranks_missing=tuple(r for r in range(world) if r not in ok_ranks),
        ranks_corrupt=tuple(sorted({f.rank for f in files} - ok_ranks)),
        bytes=sum(f.meta.bytes for f in files),
        mtime=max(f.meta.mtime for f in files),
    )


def _order(s: CheckpointSet) -> tuple:
    """Newest step first; sets without any step go last, newest file first."""
    known = s.global_step is not None or s.epoch is not None or s.step is not None
    return (known, _or(s.global_step), _or(s.epoch), _or(s.step), s.mtime)


def _or(v: int | None) -> int:
    return -1 if v is None else v


def resume_set(index: Index, step: int | None = None, unhealthy: Container[str] = ()) -> CheckpointSet | None:
    """The set a relaunch resumes from: the bridge's choice (``saving.find_resume_point``), and the dashboard's answer.

    Sets in ``unhealthy`` (ids: ``ckpthealth.unhealthy``) are passed over
    when no step is pinned. A pinned step that names no complete set is a
    ValueError, raised alike on every rank before any collective.
    """
    complete = [s for s in index.sets if s.complete]
    if step is None:
        cset = next((s for s in complete if s.origin == ORIGIN_BRIDGE and s.id not in unhealthy), None)
    else:
        # Healthy first: MindSpore's exception save can hold the same global step as a periodic set.
        matches = sorted(
            (s for s in complete if s.global_step == step),
            key=lambda s: (s.id in unhealthy, s.origin != ORIGIN_BRIDGE),
        )
        if not matches:
            have = sorted({s.global_step for s in complete if s.global_step is not None})
            raise ValueError(
                f"GracefulExitBridge: resume_step={step}, but {index.run_dir} has no "
                f"checkpoint set complete across {index.world_size} ranks at that global step "
                f"(complete sets: {have or 'none'})"
            )
        cset = matches[0]
    return cset
