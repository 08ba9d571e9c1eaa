"""Checkpoint retention: which sets to keep, which to delete, and deleting them safely.

The plan is a pure function of the index (``trainer_bridge.ckptindex``), the
policy and what the ranks are doing (``plan``); applying it deletes through
``CheckpointService.remove_set`` (``trainer_bridge.safeio``'s descriptor walk), so the
browser's delete, the policy, the page's Apply and ``rankwatch checkpoints
gc`` all remove files the same way (docs/checkpoints.md, "Retention").

Why a set can never look complete while it is being deleted: its files go
lowest rank first (``CheckpointSet.files`` is sorted by rank), so the first
unlink leaves rank 0 missing and every index from then on reports the set
partial. The highest rank goes last, so a layout without a known world size
keeps counting the same ranks. Before the first unlink the set's id is
written to ``RUN/rankwatch/retention_journal.json``; the page shows a set
named there as "being deleted by retention", and the next apply finishes
it (a partial set older than the newest complete one is collected anyway).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from app.errors import ApiError
from trainer_bridge import ckpthealth, runfiles, safeio, saving, schema
from trainer_bridge.ckptindex import MAX_DEPTH, ORIGIN_BRIDGE, CheckpointSet, Index

MODES = ("off", "dry_run", "on")
OVERRIDE_NAME = "retention.json"
JOURNAL_NAME = "retention_journal.json"
# Leftovers of saves that never finished: MindIO TTP, NeMo, Orbax.
TEMP_RE = re.compile(
    r"^(?:(?:tft|ttp)_saved_checkpoints-step_\d+_tmp|.+-unfinished|.+\.orbax-checkpoint-tmp.*)$"
)
# Free space must exceed the next save (the newest complete set's size) by this fraction.
DISK_MARGIN = 0.10
MAX_TEMP = 10_000
# Deletions per apply: the journal naming them stays within the run-file reader's bound.
MAX_BATCH = 100
JOURNAL_BUDGET = runfiles.MAX_FILE_BYTES // 2


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


def plan(
    index: Index,
    policy: Policy,
    activity: Activity,
    *,
    now: float,
    unhealthy: Mapping[str, str] | None = None,
    temps: tuple[Temp, ...] = (),
) -> Plan:
    """Decide every set's fate. Pure: the same inputs give the same plan and hash.

    ``index.sets`` is newest step first. The keep rules win over every
    delete; a set is deleted only when a newer complete set exists and
    nothing says a rank may still be writing it.
    """
    unhealthy = unhealthy or {}
    pinned = set(policy.pinned)
    resume = saving.resume_set(index, unhealthy=unhealthy)
    healthy = next((s for s in index.sets if s.complete and s.id not in unhealthy), None)
    newer_complete = False  # a complete set newer than the one at hand was seen
    complete_seen = 0
    entries = []
    for s in index.sets:
        keep = None
        if s.id in pinned:
            keep = "kept: pinned"
        elif resume is not None and s.id == resume.id:
            keep = "kept: the bridge resumes from it"
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


def find_temps(run_dir: str, errors: list[str]) -> tuple[Temp, ...]:
    """The leftover temporary directories and markers under ``run_dir`` (symlinks not followed)."""
    root = os.path.realpath(run_dir)
    found: list[Temp] = []
    stack = [(root, ())]
    while stack and len(found) < MAX_TEMP:
        path, rel = stack.pop()
        try:
            with os.scandir(path) as it:
                entries = list(it)
        except OSError:
            continue
        for e in entries:
            if not rel and e.name == runfiles.STATE_DIR:
                continue
            try:
                if e.is_symlink():
                    continue
                is_dir = e.is_dir(follow_symlinks=False)
                if TEMP_RE.match(e.name):
                    found.append(
                        Temp(
                            "/".join(rel + (e.name,)),
                            _du(e.path) if is_dir else e.stat().st_size,
                            e.stat(follow_symlinks=False).st_mtime,
                        )
                    )
                elif is_dir and len(rel) < MAX_DEPTH:
                    stack.append((e.path, rel + (e.name,)))
            except OSError as err:
                errors.append(f"cannot stat {'/'.join(rel + (e.name,))}: {safeio.why(err)}")
    return tuple(sorted(found, key=lambda t: t.path))


def _du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _ranks(ranks) -> str:
    ranks = list(ranks)
    return ", ".join(map(str, ranks[:12])) + (f" and {len(ranks) - 12} more" if len(ranks) > 12 else "")


def disk(run_dir: str, index: Index) -> dict:
    """Bytes per run, free space of the checkpoint filesystem, and whether the next save fits."""
    newest = index.newest_complete
    where = os.path.dirname(newest.files[0].abspath) if newest else run_dir
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


def journal_path(run_dir: str) -> str:
    return os.path.join(runfiles.state_dir(run_dir), JOURNAL_NAME)


def read_journal(run_dir: str | None) -> list[dict]:
    """The entries a retention run was deleting when it stopped (it removes each as it is done)."""
    if not run_dir:
        return []
    data = runfiles.read_json_or_none(journal_path(run_dir))
    items = data.get("sets") if isinstance(data, dict) else None
    if not isinstance(items, list):
        return []
    return [
        i
        for i in items
        if isinstance(i, dict)
        and isinstance(i.get("id"), str)
        and i.get("kind") in ("set", "temp")
        and isinstance(i.get("bytes"), int)
    ]


def interrupted(run_dir: str | None) -> set[str]:
    """Ids of the sets an interrupted retention run had started to delete."""
    return {i["id"] for i in read_journal(run_dir) if i["kind"] == "set"}


def _batches(entries: list[Entry]):
    """The deletions in groups whose journal stays within the run-file reader's bound."""
    batch, size = [], 0
    for e in entries:
        cost = len(e.id) + len(e.why) + 100
        if batch and (len(batch) >= MAX_BATCH or size + cost > JOURNAL_BUDGET):
            yield batch
            batch, size = [], 0
        batch.append(e)
        size += cost
    if batch:
        yield batch


def _write_journal(run_dir: str, items: list[dict]) -> None:
    # Walked from the run directory, following no symlink: a swapped ``rankwatch/`` cannot redirect it.
    rel = f"{runfiles.STATE_DIR}/{JOURNAL_NAME}"
    if items:
        runfiles.atomic_write_json(journal_path(run_dir), {"sets": items, "at": time.time()}, root=run_dir)
    else:
        try:
            safeio.unlink(run_dir, rel)
        except FileNotFoundError:
            pass


class Retention:
    """The plan for the service's run, applying it, and the automatic mode's tick."""

    def __init__(self, service, config: Mapping, clock: Callable[[], float] = time.time):
        self.service = service
        self.config = config
        self.clock = clock
        policy_for(None, config)  # a bad RETENTION_MODE fails at start
        self._auto_seen: str | None = None
        self._lock = threading.Lock()

    def policy(self) -> Policy:
        return policy_for(self.service.run_dir, self.config)

    def plan(self, world: int, heartbeats: Mapping[int, dict | None], force: bool = False) -> Plan:
        if self.service.run_dir is None:
            raise ApiError(409, "the dashboard was started without a run directory (--run-dir)")
        index = self.service.index(world, force)
        errors: list[str] = []
        temps = find_temps(self.service.run_dir, errors)
        return plan(
            index,
            self.policy(),
            Activity.of(heartbeats),
            now=self.clock(),
            unhealthy=ckpthealth.unhealthy(self.service.run_dir, index),
            temps=temps,
        )

    def body(self, world: int, heartbeats: Mapping[int, dict | None]) -> dict:
        """The body of ``GET /api/checkpoints/retention``."""
        p = self.plan(world, heartbeats)
        index = self.service.index(world)
        return p.to_dict() | {
            "disk": disk(self.service.run_dir, index),
            "interrupted": sorted(interrupted(self.service.run_dir)),
            "unhealthy": p.health,
        }

    def apply(
        self,
        expected_hash: str | None,
        world: int,
        heartbeats: Mapping[int, dict | None],
        *,
        who: str,
        remote_addr: str | None = None,
    ) -> dict:
        """Delete what the plan says; 409 if it is not the plan ``expected_hash`` names.

        ``expected_hash`` None applies the current plan (the policy's own run).
        """
        with self._lock, self.service.delete_lock:
            p = self.plan(world, heartbeats, force=True)
            if expected_hash is not None and p.hash != expected_hash:
                raise ApiError(
                    409,
                    "the retention plan changed since it was shown (a set appeared, changed or went "
                    "away); reload it and apply the new one",
                )
            run_dir = self.service.run_dir
            done, failed = [], []
            # First what an interrupted run left: its sets that are gone now were deleted whole
            # but never audited; those still here are partial, and go first.
            present = {e.id for e in p.entries}
            held = []
            for item in read_journal(run_dir):
                if item["id"] in present:
                    held.append(item)
                    continue
                self.service.audit.record(
                    "delete",
                    who=str(item.get("who", who))[:200],
                    reason=f"retention: {str(item.get('why', ''))[:500]}",
                    outcome="deleted (an interrupted retention run finished it before it stopped)",
                    detail={
                        "set": item["id"],
                        "kind": item["kind"],
                        "bytes": item["bytes"],
                        "finished_by": who,
                    },
                )
            first = {i["id"] for i in held}
            gone = sorted(p.deletions, key=lambda e: e.id not in first)
            held = [i for i in held if i["id"] not in {e.id for e in gone}]  # partial, but not deletable now
            for batch in _batches(gone):
                journal = held + [
                    {"id": e.id, "kind": e.kind, "bytes": e.bytes, "why": e.why, "who": who} for e in batch
                ]
                # Written before the first unlink: a kill -9 from here on leaves a named reason.
                _write_journal(run_dir, journal)
                for e in batch:
                    ok, errs, outcome = self._delete(run_dir, e)
                    self.service.audit.record(
                        "delete",
                        who=who,
                        remote_addr=remote_addr,
                        reason=f"retention: {e.why}",
                        outcome=outcome,
                        detail={"set": e.id, "kind": e.kind, "rule": e.why, "bytes": e.bytes, "errors": errs},
                    )
                    (done if ok else failed).append(e.id)
                    if ok:
                        journal = [i for i in journal if i["id"] != e.id]
                        _write_journal(run_dir, journal)
            self.service.index(world, force=True)
        return {
            "hash": p.hash,
            "deleted": done,
            "failed": failed,
            "frees_bytes": sum(e.bytes for e in gone if e.id in done),
        }

    def pin(
        self, set_id: str, pinned: bool, world: int, *, who: str, remote_addr: str | None, reason: str
    ) -> dict:
        """Pin or unpin a set (``retention.json``'s ``pinned``); audited. Pinned sets are never deleted."""
        run_dir = self.service.run_dir
        with self._lock:
            if pinned:
                self.service.find(set_id, world)  # only a listed set can be pinned (404 otherwise)
            current, error = read_override(run_dir)
            if error:
                raise ApiError(409, f"{error}; fix or remove it before pinning")
            fields = current.to_dict() if current is not None else {}
            pins = [p for p in fields.get("pinned", []) if p != set_id] + ([set_id] if pinned else [])
            try:
                obj = schema.build(schema.RetentionFile, **(fields | {"pinned": pins}))
            except schema.SchemaError as e:
                raise ApiError(409, f"cannot pin: {e}") from None
            safeio.makedirs(run_dir, runfiles.STATE_DIR)
            runfiles.atomic_write_bytes(override_path(run_dir), obj.to_json(), root=run_dir)
            self.service.audit.record(
                "pin",
                who=who,
                remote_addr=remote_addr,
                reason=reason,
                outcome="pinned" if pinned else "unpinned",
                detail={"set": set_id},
            )
        return {"set": set_id, "pinned": pinned, "pins": pins}

    def _delete(self, run_dir: str, e: Entry) -> tuple[bool, list, str]:
        """Delete one plan entry: (done, errors, the audit outcome). Already gone is done."""
        if e.kind == "set":
            deleted, errs, _ = self.service.remove_set(e.set)
            return (
                not errs,
                errs,
                (f"deleted: {len(deleted)} file(s)" if not errs else f"partial: {len(errs)} failed"),
            )
        root = os.path.realpath(run_dir)
        try:
            if _is_file(run_dir, e.id):
                safeio.unlink(root, e.id)
            else:
                safeio.rmtree(root, e.id)
        except FileNotFoundError:
            return True, [], "deleted (already gone)"
        except (OSError, safeio.UnsafePath) as err:
            return False, [{"path": e.id, "error": str(err)}], f"failed: {err}"
        return True, [], "deleted"

    def tick(
        self, world: int, heartbeats: Mapping[int, dict | None], alert: Callable | None = None
    ) -> dict | None:
        """Once per new complete set: apply the plan (``on``) or report it (``dry_run``), check the disk.

        Called by the watcher's leader after its checkpoint poll. Never raises
        for the files; returns what it did, or None.
        """
        policy = self.policy()
        if self.service.run_dir is None:
            return None
        index = self.service.index(world)
        newest = index.newest_complete
        if newest is None or newest.id == self._auto_seen:
            return None
        self._auto_seen = newest.id
        result: dict = {}
        if policy.mode == "dry_run":
            p = self.plan(world, heartbeats)
            if p.deletions and alert is not None:
                alert(
                    f"retention-dry:{p.hash}",
                    "retention_dry_run",
                    f"retention (dry run) would delete {len(p.deletions)} set(s), "
                    f"freeing {_gib(p.frees_bytes)}",
                )
            if p.deletions:
                self.service.audit.record(
                    "delete",
                    who="policy",
                    reason="retention (dry run)",
                    outcome=f"dry run: would delete {len(p.deletions)}, freeing {p.frees_bytes} bytes",
                    detail={"sets": [(e.id, e.why, e.bytes) for e in p.deletions[:MAX_BATCH]]},
                )
            result["dry_run"] = p.to_dict()
        elif policy.mode == "on":
            result = self.apply(None, world, heartbeats, who="policy")
            if result["deleted"] and alert is not None:
                alert(
                    f"retention:{result['hash']}",
                    "retention_applied",
                    f"retention deleted {len(result['deleted'])} set(s), freeing {_gib(result['frees_bytes'])}"
                    + (f"; {len(result['failed'])} failed" if result["failed"] else ""),
                )
        # Whatever the mode: after a new set (and what retention freed), will the next save fit?
        result["disk"] = disk(self.service.run_dir, self.service.index(world))
        if result["disk"]["low"] and alert is not None:
            alert(f"retention-disk:{newest.id}", "checkpoint_disk_low", result["disk"]["warning"])
        return result


def _is_file(run_dir: str, rel: str) -> bool:
    try:
        with safeio.parent_fd(os.path.realpath(run_dir), rel) as (fd, name):
            return not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
