"""Which checkpoint sets are unhealthy, from the files alone (no MindSpore).

Two kinds of evidence, shown per set by the checkpoint browser and honoured
by the bridge's resume (``ckptindex.resume_set`` passes over these sets):

* MindFormers' ``health_ckpts.json`` (its ``CheckpointMonitor`` with
  ``use_checkpoint_health_monitor``, written by rank 0): a list of
  ``{"is_health": 0 | 1, "ckpt_name": "<rank 0's file name>"}``, 0 healthy.
  It is looked for in the run directory and in every directory above a
  set's files, up to the run directory.
* MindSpore's exception save (``CheckpointConfig(exception_save=True)``):
  ``Model.train`` saves ``{prefix}-{E}_{S}_breakpoint.ckpt`` when a step
  raised, so the weights are whatever the failed step left.
* The bridge's own ``append_dict`` flag ``rankwatch_loss_finite``: 0 when the
  rank's last loss before the save was NaN or infinite. One rank's 0 flags
  the set.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from trainer_bridge.rundir import runfiles, safedirs
from trainer_bridge.rundir.ckptindex import CheckpointSet, Index

HEALTH_FILE = "health_ckpts.json"
# A health record is ~60 bytes a save: this is tens of thousands of saves.
MAX_HEALTH_BYTES = 4 << 20
LOSS_FLAG = "rankwatch_loss_finite"
EXCEPTION_SUFFIX = "_breakpoint.ckpt"


def health_records(run_dir: str, index: Index) -> dict[str, int]:
    """``{file name: is_health}`` from every ``health_ckpts.json`` near the sets (bad files skipped)."""
    root = safedirs.anchor(run_dir)
    dirs = {""}
    for s in index.sets:
        for f in s.files[:1]:
            parts = f.path.split("/")[:-1]
            dirs.update("/".join(parts[:i]) for i in range(len(parts) + 1))
    records: dict[str, int] = {}
    for d in sorted(dirs):
        path = os.path.join(root, d, HEALTH_FILE)
        if os.path.islink(path):
            continue
        try:
            data = json.loads(runfiles.read_capped(path, MAX_HEALTH_BYTES))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(data, list):
            continue
        for item in data:
            if isinstance(item, dict) and isinstance(item.get("ckpt_name"), str):
                h = item.get("is_health")
                if isinstance(h, int) and not isinstance(h, bool):
                    records[os.path.basename(item["ckpt_name"])] = h
    return records


def unhealthy(
    run_dir: str | None,
    index: Index,
    records: Mapping[str, int] | None = None,
    memo: dict[str, tuple[CheckpointSet, str | None]] | None = None,
) -> dict[str, str]:
    """``{set id: why}`` for every set with evidence that its weights are bad.

    ``memo`` (the caller's, kept between calls): each set's answer by set id, taken again for a set
    that is the very same object (``ckptgroup`` keeps the sets no path of changed), so a hub does not
    look at every file of every set each time its index changes. Not used while health records
    exist: they may name any file.
    """
    if not run_dir:
        return {}
    records = health_records(run_dir, index) if records is None else records
    memo = memo if memo is not None and not records else None
    out: dict[str, str] = {}
    for s in index.sets:
        held = memo.get(s.id) if memo is not None else None
        if held is not None and held[0] is s:
            why = held[1]
        else:
            why = _why(s, records)
            if memo is not None:
                memo[s.id] = (s, why)
        if why:
            out[s.id] = why
    if memo is not None and len(memo) > len(index.sets):
        for gone in memo.keys() - {s.id for s in index.sets}:
            del memo[gone]
    return out


def _why(s: CheckpointSet, records: Mapping[str, int]) -> str | None:
    for f in s.files:
        if records:
            h = records.get(f.path.rsplit("/", 1)[-1])
            if h is not None and h != 0:
                return f"MindFormers' {HEALTH_FILE} marks {f.path} unhealthy (is_health={h})"
        if f.path.endswith(EXCEPTION_SUFFIX):
            return "saved by MindSpore's exception_save after a step raised (*_breakpoint.ckpt)"
        if f.meta.extras and f.meta.extras.get(LOSS_FLAG) == 0 and f.ok:
            return f"rank {f.rank}'s loss was NaN or infinite when it saved"
    return None
