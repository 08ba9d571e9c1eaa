"""The retention plan: which checkpoint sets to keep, which to delete, and why (pure).

``plan`` is a function of the index (``trainer_bridge.rundir.ckptindex``), the
policy (settings over the run's ``rankwatch/retention.json``) and what the
ranks are doing; ``app.checkpoints.retention`` applies it. Also here: the
leftovers of unfinished saves, and whether the next save fits on the disk.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from trainer_bridge.rundir import runfiles, safedirs, safeio, schema
from trainer_bridge.rundir.ckptindex import CheckpointSet, Index, build_index, resume_set
from trainer_bridge.rundir.ckptpaths import ORIGIN_BRIDGE
from trainer_bridge.rundir.listing import first_of

MODES = ("off", "dry_run", "on")
OVERRIDE_NAME = "retention.json"
# Leftovers of saves that never finished: MindIO TTP, NeMo, Orbax.
TEMP_RE = re.compile(
    r"^(?:(?:tft|ttp)_saved_checkpoints-step_\d+_tmp|.+-unfinished|.+\.orbax-checkpoint-tmp.*)$"
)
# Free space must exceed the next save (the newest complete set's size) by this fraction.
DISK_MARGIN = 0.10
MAX_TEMP = 10_000


@dataclass(frozen=True)
class Policy:
    """The retention rules in force for one run (settings, then ``rankwatch/retention.json``)."""

    mode: str = "off"
    keep: int = 3
    every: int = 0
    settle_s: float = 30.0
    tmp_age_s: float = 3600.0
    pinned: tuple[str, ...] = ()
    source: str = "settings"
    errors: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "keep": self.keep,
            "every": self.every,
            "settle_s": self.settle_s,
            "tmp_age_s": self.tmp_age_s,
            "pinned": list(self.pinned),
            "source": self.source,
            "errors": list(self.errors),
        }


def override_path(run_dir: str) -> str:
    return os.path.join(runfiles.state_dir(run_dir), OVERRIDE_NAME)


def read_override(run_dir: str | None) -> tuple[schema.RetentionFile | None, str | None]:
    """The run's override file, validated: (the file or None, why it was refused or None)."""
    if not run_dir:
        return None, None
    try:
        return schema.load(schema.RetentionFile, override_path(run_dir)), None
    except FileNotFoundError:
        return None, None
    except (OSError, schema.SchemaError) as e:
        return None, f"rankwatch/{OVERRIDE_NAME} ignored: {e}"


def policy_for(run_dir: str | None, config: Mapping) -> Policy:
    """The policy in force: the settings, with the run's ``retention.json`` over them."""
    mode = config.get("RETENTION_MODE", "off")
    if mode not in MODES:
        raise ValueError(f"setting RETENTION_MODE must be one of {', '.join(MODES)}, not {mode!r}")
    fields = {
        "mode": mode,
        "keep": int(config.get("RETENTION_KEEP", 3)),
        "every": int(config.get("RETENTION_EVERY", 0)),
        "settle_s": float(config.get("RETENTION_SETTLE_S", 30.0)),
        "tmp_age_s": float(config.get("RETENTION_TMP_AGE_S", 3600.0)),
    }
    override, error = read_override(run_dir)
    if override is not None:
        for name in ("mode", "keep", "every"):
            if getattr(override, name) is not None:
                fields[name] = getattr(override, name)
        fields["pinned"] = tuple(override.pinned)
        fields["source"] = f"settings + rankwatch/{OVERRIDE_NAME}"
    return Policy(**fields, errors=(error,) if error else ())


@dataclass(frozen=True)
class Activity:
    """What the ranks are doing, from their heartbeats: the facts that hold deletions back."""

    saving: tuple[int, ...] = ()  # ranks in the stop's `saving` stage (or state)
    training: bool = False  # some rank still trains

    @classmethod
    def of(cls, heartbeats: Mapping[int, dict | None]) -> Activity:
        saving, training = [], False
        for rank, hb in heartbeats.items():
            if not isinstance(hb, dict):
                continue
            stop = hb.get("stop") if isinstance(hb.get("stop"), dict) else {}
            if hb.get("state") == "saving" or stop.get("stage") == "saving":
                saving.append(rank)
            training = training or hb.get("state") in ("starting", "training", "stopping", "saving")
        return cls(tuple(sorted(saving)), training)


@dataclass(frozen=True)
class Temp:
    """A leftover temporary directory or marker of an unfinished save."""

    path: str  # relative to the run directory
    bytes: int
    mtime: float


@dataclass(frozen=True)
class Entry:
    kind: str  # "set" | "temp"
    id: str
    global_step: int | None
    action: str  # "keep" | "delete"
    why: str
    bytes: int
    identity: tuple  # what the hash covers: the files as they were seen
    set: CheckpointSet | None = None
    temp: Temp | None = None

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "id": self.id,
            "global_step": self.global_step,
            "action": self.action,
            "why": self.why,
            "bytes": self.bytes,
        }


@dataclass(frozen=True)
class Plan:
    policy: Policy
    entries: tuple[Entry, ...]
    hash: str
    health: dict = field(default_factory=dict)

    @property
    def deletions(self) -> list[Entry]:
        return [e for e in self.entries if e.action == "delete"]

    @property
    def frees_bytes(self) -> int:
        return sum(e.bytes for e in self.deletions)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.to_dict(),
            "hash": self.hash,
            "sets": [e.to_dict() for e in self.entries],
            "frees_bytes": self.frees_bytes,
        }


def _held(s: CheckpointSet, activity: Activity, settle_s: float, now: float) -> str | None:
    """Why ``s`` may still be being written (so it must not be deleted now), or None."""
    if activity.saving:
        return f"held: rank(s) {_ranks(activity.saving)} are saving"
    fresh = [f for f in s.files if now - f.meta.mtime < settle_s]
    if fresh:
        return f"held: {fresh[0].path} changed less than {settle_s:g} s ago (may still be written)"
    if not s.complete and activity.training:
        # An asynchronous save can finish an older set after a newer one: wait for the job.
        return "held: not complete, and the ranks still train (collected once they stop)"
    return None


# The sets kept while a rollback is pending: the target is the newest of them whose tensors are finite.
ROLLBACK_CANDIDATES = 3


def plan(
    index: Index,
    policy: Policy,
    activity: Activity,
    *,
    now: float,
    unhealthy: Mapping[str, str] | None = None,
    temps: tuple[Temp, ...] = (),
    proven: frozenset[str] | None = None,
    rollback_before: int | None = None,
    rollback_target: str | None = None,
) -> Plan:
    """Decide every set's fate. Pure: the same inputs give the same plan and hash.

    ``index.sets`` is newest step first. The keep rules win over every
    delete; a set is deleted only when a newer complete set exists and
    nothing says a rank may still be writing it. ``proven``, when given, is
    the sets whose deletion this disk alone proves (the plan of the local
    files only, ``local_index``): any other is kept, whatever an agent's
    listing says (issue 32, P3). ``rollback_before``: a loss-spike rollback
    is pending from that global step (``rankwatch/rollback.json``): the
    newest ``ROLLBACK_CANDIDATES`` complete healthy sets older than it are
    kept, since ``rankwatch launch`` is about to pick its target among them,
    and so is ``rollback_target``, the set it would pick as the dashboard
    names it (``target.rollback_target``), wherever it lies.
    """
    unhealthy = unhealthy or {}
    pinned = set(policy.pinned)
    resume = resume_set(index, unhealthy=unhealthy)
    # The newest complete set that is healthy and settled: a set still being written (a file
    # changed within the settle time) may yet fail, so it never stands in for the last good one.
    healthy = next(
        (
            s
            for s in index.sets
            if s.complete
            and s.id not in unhealthy
            and all(now - f.meta.mtime >= policy.settle_s for f in s.files)
        ),
        None,
    )
    candidates = (
        set()
        if rollback_before is None
        else {
            s.id
            for s in [
                s
                for s in index.sets
                if s.complete
                and s.id not in unhealthy
                and s.global_step is not None
                and s.global_step < rollback_before
            ][:ROLLBACK_CANDIDATES]
        }
    )
    newer_complete = False  # a complete set newer than the one at hand was seen
    complete_seen = 0
    entries = []
    for s in index.sets:
        keep = None
        if s.id in pinned:
            keep = "kept: pinned"
        elif resume is not None and s.id == resume.id:
            keep = "kept: the bridge resumes from it"
        elif s.id == rollback_target:
            keep = f"kept: the target of the loss-spike rollback pending from global step {rollback_before}"
        elif s.id in candidates:
            keep = f"kept: a loss-spike rollback from global step {rollback_before} is pending (a possible target)"
        elif healthy is not None and s.id == healthy.id:
            keep = "kept: newest complete healthy"
        elif s.origin == ORIGIN_BRIDGE:
            keep = "kept: graceful-stop set"
        elif s.complete and complete_seen < policy.keep:
            keep = f"kept: newest {policy.keep} complete"
        elif policy.every and s.global_step is not None and s.global_step % policy.every == 0 and s.complete:
            keep = f"kept: milestone (global step a multiple of {policy.every})"
        elif not newer_complete:
            keep = (
                "kept: no newer complete set"
                if s.complete
                else "kept: not complete yet (may still be written)"
            )
        if keep is None:
            keep = _held(s, activity, policy.settle_s, now)
        if keep is None and proven is not None and s.id not in proven:
            keep = "kept: only an agent's listing shows the newer sets; this disk does not prove them"
        why = keep or (
            f"delete: older than the newest {policy.keep} complete sets"
            if s.complete
            else "delete: partial, older than the newest complete set"
        )
        if s.id in unhealthy:
            why += f" (unhealthy: {unhealthy[s.id]})"
        # A file that changes changes the set's size or newest mtime (a write sets it to now).
        identity = (len(s.files), s.bytes, s.mtime, len(s.ranks_missing))
        entries.append(
            Entry("set", s.id, s.global_step, "keep" if keep else "delete", why, s.bytes, identity, s)
        )
        if s.complete:
            newer_complete = True
            complete_seen += 1
    for t in temps:
        age = now - t.mtime
        old = age >= policy.tmp_age_s and not activity.saving
        why = (
            f"delete: leftover of an unfinished save, untouched for {age:.0f} s"
            if old
            else f"kept: temporary, younger than {policy.tmp_age_s:g} s or a rank is saving"
        )
        entries.append(
            Entry("temp", t.path, None, "delete" if old else "keep", why, t.bytes, (t.mtime,), temp=t)
        )
    h = hashlib.sha256(json.dumps(policy.to_dict()).encode())
    for e in entries:
        h.update(repr((e.kind, e.id, e.action, e.identity)).encode())
    digest = h.hexdigest()[:32]
    return Plan(policy, tuple(entries), digest, dict(unhealthy))


def local_index(index: Index) -> Index:
    """``index`` with only the files on this dashboard's disk: an agent's listing (``host``
    set) is a claim from Redis, and a remote listing can never cause a local delete."""
    files = [f for s in index.sets for f in s.files if f.host is None]
    files += [f for f in index.other_files if f.host is None]
    return build_index(index.run_dir, files, index.world_size, index.errors, index.scanned_at)


def leftover_dirs(index: Index) -> set[str]:
    """Where the checkpoint layouts put the leftovers of unfinished saves (relative, "" the run
    directory): each local checkpoint file's directory and the directories above its per-rank and
    per-step ones (``ckpt/`` for ``ckpt/rank_{rank}/…``, where TTP's ``…-step_N_tmp`` sits)."""
    dirs = set()
    for s in index.sets:
        for f in s.files:
            if f.host is not None:
                continue  # another node's file: nothing of it is on this disk
            parts = f.path.split("/")[:-1]
            templates = f.layout.split("/")[:-1]
            dirs.add("/".join(parts))
            for depth in range(len(parts), 0, -1):
                if depth > len(templates) or "{" not in templates[depth - 1]:
                    break
                dirs.add("/".join(parts[: depth - 1]))
    return dirs


def find_temps(run_dir: str, errors: list[str], index: Index) -> tuple[Temp, ...]:
    """The leftover temporary directories and markers of unfinished saves (symlinks not followed).

    Looked for only directly in ``leftover_dirs``: an ``…-unfinished`` data set or note elsewhere
    in the run directory is not a checkpoint's. Each is dated by the newest mtime inside it, so
    a directory still being written into is never old (issue 32, P9).
    """
    root = safedirs.anchor(run_dir)
    found: list[Temp] = []
    for rel in sorted(leftover_dirs(index)):
        if len(found) >= MAX_TEMP:
            break
        if rel.split("/")[0] == runfiles.STATE_DIR:
            continue
        try:
            with safedirs.pinned_dir(root, rel) as here, os.scandir(here) as it:
                for e in itertools.islice(it, MAX_TEMP):
                    if TEMP_RE.match(e.name):
                        path = f"{rel}/{e.name}" if rel else e.name
                        temp = _leftover(e, path, errors)
                        if temp is not None:
                            found.append(temp)
        except (OSError, safeio.UnsafePath):
            continue
    return tuple(sorted(found, key=lambda t: t.path))


def _leftover(e: os.DirEntry, path: str, errors: list[str]) -> Temp | None:
    try:
        st = e.stat(follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            return None
        if stat.S_ISDIR(st.st_mode):
            size, newest = _du(e.path)
            return Temp(path, size, max(newest, st.st_mtime))
        return Temp(path, st.st_size, st.st_mtime)
    except OSError as err:
        errors.append(f"cannot stat {path}: {safeio.why(err)}")
        return None


# Entries looked at inside one leftover; past it the leftover counts as written just now (kept).
MAX_TEMP_ENTRIES = 100_000


def _du(path: str) -> tuple[int, float]:
    """(bytes, newest mtime) of everything under ``path``, symlinks not followed."""
    total, newest, seen = 0, 0.0, 0
    for dirpath, dirs, files in os.walk(path):
        for name in files + dirs:
            seen += 1
            if seen > MAX_TEMP_ENTRIES:
                return total, float("inf")
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if not stat.S_ISDIR(st.st_mode):
                total += st.st_size
    return total, newest


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return first_of(ranks, 12)


def disk(run_dir: str, index: Index) -> dict:
    """Bytes per run, free space of the checkpoint filesystem, and whether the next save fits."""
    newest = index.newest_complete
    # A file another node's agent listed has no path here (abspath empty): this directory's disk then.
    where = (
        next((os.path.dirname(f.abspath) for f in newest.files if f.abspath), run_dir) if newest else run_dir
    )
    try:
        st = os.statvfs(where)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    except OSError:
        free = total = None
    need = int(newest.bytes * (1 + DISK_MARGIN)) if newest else None
    low = free is not None and need is not None and free < need
    return {
        "run_bytes": sum(s.bytes for s in index.sets),
        "free_bytes": free,
        "fs_bytes": total,
        "next_save_bytes": need,
        "low": low,
        "warning": (
            f"free space on the checkpoint filesystem ({_gib(free)}) is less than the next save "
            f"needs ({_gib(need)}: the newest complete set plus {DISK_MARGIN:.0%}); the next save would "
            "fail mid-write"
            if low
            else None
        ),
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"
