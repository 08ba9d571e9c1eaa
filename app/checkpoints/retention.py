"""Checkpoint retention: which sets to keep, which to delete, and deleting them safely.

The plan is a pure function of the index, the policy and what the ranks are
doing (``app.checkpoints.retention_plan.plan``); applying it deletes through
``CheckpointService.remove_set`` (``trainer_bridge.rundir.safeio``'s descriptor walk), so the
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

import os
import stat
import threading
import time
from collections.abc import Callable, Mapping

from app.checkpoints import finite, target
from app.checkpoints.retention_plan import (
    MODES,
    Activity,
    Entry,
    Plan,
    Policy,
    Temp,
    _gib,
    disk,
    find_temps,
    local_index,
    override_path,
    plan,
    policy_for,
    read_override,
)
from app.errors import CheckpointRefused, NoRunDir
from trainer_bridge.rundir import ckpthealth, rollbacks, runfiles, safedirs, safeio, schema

__all__ = [
    "MODES",
    "Activity",
    "Entry",
    "Plan",
    "Policy",
    "Retention",
    "Temp",
    "disk",
    "find_temps",
    "interrupted",
    "journal_path",
    "plan",
    "policy_for",
    "read_journal",
]

JOURNAL_NAME = "retention_journal.json"
# Deletions per batch: the journal naming them stays within the run-file reader's bound.
MAX_BATCH = 100
JOURNAL_BUDGET = runfiles.MAX_FILE_BYTES // 2


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
        # Under --runs, the registry's pin check (issue 32, P2): asked again before every journal
        # write and every delete, so a directory swapped during a plan deletes nothing through it.
        self.guard: Callable[[], bool] | None = None
        self._finite_memo: dict = {}  # the rollback target's tensor verdicts, by file (finite.Reader)

    def _pin_lost(self) -> bool:
        return self.guard is not None and not self.guard()

    def policy(self) -> Policy:
        return policy_for(self.service.run_dir, self.config)

    def plan(self, world: int, heartbeats: Mapping[int, dict | None], force: bool = False) -> Plan:
        if self.service.run_dir is None:
            raise NoRunDir()
        index = self.service.index(world, force)
        errors: list[str] = []
        temps = find_temps(self.service.run_dir, errors, index)
        policy, activity, now = self.policy(), Activity.of(heartbeats), self.clock()
        pending, _ = rollbacks.read_request(self.service.run_dir)
        before = pending.first_step if pending is not None else None
        aim = self._rollback_target(index, pending)
        proven = None
        if any(f.host is not None for s in index.sets for f in s.files):
            # Agents listed some of these files: only what this disk alone proves may go (P3).
            local = local_index(index)
            unhealthy = ckpthealth.unhealthy(self.service.run_dir, local)
            mine = plan(
                local,
                policy,
                activity,
                now=now,
                unhealthy=unhealthy,
                rollback_before=before,
                rollback_target=aim,
            )
            proven = frozenset(e.id for e in mine.deletions)
        return plan(
            index,
            policy,
            activity,
            now=now,
            unhealthy=ckpthealth.unhealthy(self.service.run_dir, index),
            temps=temps,
            proven=proven,
            rollback_before=before,
            rollback_target=aim,
        )

    def _rollback_target(self, index, pending: rollbacks.Request | None) -> str | None:
        """The set a pending rollback goes back to, as the page names it: kept whatever its age.

        The newest candidates alone are not enough: when NaN weights or the
        detector's record pass all of them over, the target is older still.
        """
        if pending is None:
            return None
        lines, _ = rollbacks.read_lines(self.service.run_dir)
        reader = finite.Reader(target.DASHBOARD_SCAN_BYTES, self._finite_memo)
        choice = target.rollback_target(
            index, self.service.run_dir, pending.first_step, target.MARGIN_STEPS, lines, tensors=reader
        )
        return choice.set_id

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
                raise CheckpointRefused(
                    "the retention plan changed since it was shown (a set appeared, changed or went "
                    "away); reload it and apply the new one",
                )
            run_dir = self.service.run_dir
            done, failed = [], []
            # First what an interrupted run left: its sets that are gone now were deleted whole
            # but never audited; those still here are partial, and go first.
            present = {e.id for e in p.entries}
            held = []
            left = read_journal(run_dir)
            for item in left:
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
            if left and not gone and not self._pin_lost():
                # Nothing to delete now: the journal keeps only the partial sets still here. Left as it
                # was, the sets audited above would stay named in it for ever (found by the kill -9 test).
                _write_journal(run_dir, held)
            for batch in _batches(gone):
                if self._pin_lost():
                    failed.extend(e.id for e in batch)
                    continue
                journal = held + [
                    {"id": e.id, "kind": e.kind, "bytes": e.bytes, "why": e.why, "who": who} for e in batch
                ]
                # Written before the first unlink: a kill -9 from here on leaves a named reason.
                _write_journal(run_dir, journal)
                for e in batch:
                    if self._pin_lost():
                        ok, errs, outcome = False, [], "not deleted: the run's directory was replaced"
                    else:
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
                    if ok and not self._pin_lost():
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
                raise CheckpointRefused(f"{error}; fix or remove it before pinning")
            fields = current.to_dict() if current is not None else {}
            pins = [p for p in fields.get("pinned", []) if p != set_id] + ([set_id] if pinned else [])
            try:
                obj = schema.build(schema.RetentionFile, **(fields | {"pinned": pins}))
            except schema.SchemaError as e:
                raise CheckpointRefused(f"cannot pin: {e}") from None
            safedirs.makedirs(run_dir, runfiles.STATE_DIR)
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
        root = safedirs.anchor(run_dir)
        try:
            if _is_file(run_dir, e.id):
                safeio.unlink(root, e.id)
            else:
                safedirs.rmtree(root, e.id)
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
        if self.service.run_dir is None:
            return None
        index = self.service.index(world, wait=False)  # the watcher's tick: never waits for an agent
        newest = index.newest_complete
        if newest is None or newest.id == self._auto_seen:
            return None  # every tick but one per new set ends here, without reading retention.json
        self._auto_seen = newest.id
        policy = self.policy()
        result: dict = {}
        if policy.mode == "dry_run":
            p = self.plan(world, heartbeats)
            if p.deletions and alert is not None:
                alert(
                    f"retention-dry:{p.hash}",
                    "retention_dry_run",
                    f"retention (dry run) would delete {len(p.deletions)} {'set' if len(p.deletions) == 1 else 'sets'}, "
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
                    f"retention deleted {len(result['deleted'])} {'set' if len(result['deleted']) == 1 else 'sets'}, freeing {_gib(result['frees_bytes'])}"
                    + (f"; {len(result['failed'])} failed" if result["failed"] else ""),
                )
        # Whatever the mode: after a new set (and what retention freed), will the next save fit?
        result["disk"] = disk(self.service.run_dir, self.service.index(world))
        if result["disk"]["low"] and alert is not None:
            alert(f"retention-disk:{newest.id}", "checkpoint_disk_low", result["disk"]["warning"])
        return result


def _is_file(run_dir: str, rel: str) -> bool:
    try:
        with safeio.parent_fd(safedirs.anchor(run_dir), rel) as (fd, name):
            return not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False
