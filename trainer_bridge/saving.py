"""Save and resume: the bridge's checkpoint set, its ``append_dict`` fields, which set to resume.

The choices are pure and import no MindSpore (the dashboard and the unit
tests use them); only ``save_state`` and ``load_state`` import it, when called.

What the bridge saves is "the state": the cells a front end names, the
callback's ``train_network`` (weights, optimizer state and the optimizer's
``global_step``, all reachable from it), or the loop's ``network`` and
``optimizer``. Either way one file per rank per stop, at
``runfiles.checkpoint_path`` (``RUN/checkpoints/rank_{r}/rankwatch-{E}_{S}.ckpt``,
``ModelCheckpoint``'s naming, ``S`` within the epoch).
"""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path

from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.ckptindex import ORIGIN_BRIDGE, CheckpointSet, Index

__all__ = [
    "ResumePoint",
    "Served",
    "append_fields",
    "data_position",
    "find_resume_point",
    "load_state",
    "resume_set",
    "save_state",
    "served_requests",
]


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint set a job resumes from: its global step and this rank's file."""

    global_step: int
    epoch: int | None
    path: Path


@dataclass(frozen=True)
class Served:
    """Stop requests the run directory shows were already served (llnl/scr#13).

    ``request_ids``: every request id stored in a bridge checkpoint (the ranks
    saved for it, so it must not stop a relaunch). ``last_saved_at``: when the
    newest bridge checkpoint was written; a bare ``{"GracefulExit": 1}``
    without an id that is older than it was served too.
    """

    request_ids: frozenset
    last_saved_at: float | None

    def covers(self, flag: runfiles.Flag, flag_mtime: float) -> bool:
        if flag.request_id is not None:
            return flag.request_id in self.request_ids
        return self.last_saved_at is not None and flag_mtime <= self.last_saved_at


NOTHING_SERVED = Served(frozenset(), None)


def served_requests(index: Index) -> Served:
    files = [f for s in index.sets if s.origin == ORIGIN_BRIDGE for f in s.files if f.ok]
    ids = {f.meta.extras.get("rankwatch_request_id") for f in files}
    return Served(
        frozenset(i for i in ids if isinstance(i, str)), max((f.meta.mtime for f in files), default=None)
    )


def find_resume_point(
    index: Index, rank: int, step: int | None = None, unhealthy: Container[str] = ()
) -> ResumePoint | None:
    """The set to resume from: the newest complete bridge set, or the one pinned at ``step``.

    ``index`` is a ``ckptindex.scan`` of the run directory with the job's
    world size. A pinned step must name a complete set (any layout, the
    bridge's own first); anything else is a ValueError, raised alike on every
    rank before any collective, because all read the same files.
    """
    cset = resume_set(index, step, unhealthy)
    if cset is None:
        return None
    return ResumePoint(cset.global_step, cset.epoch, Path(cset.file_for(rank).abspath))


def resume_set(index: Index, step: int | None = None, unhealthy: Container[str] = ()) -> CheckpointSet | None:
    """The set a relaunch resumes from (``find_resume_point``'s choice; the dashboard asks it too).

    Sets in ``unhealthy`` (ids: ``ckpthealth.unhealthy``) are passed over
    when no step is pinned. A pinned step that names no complete set is a
    ValueError (see ``find_resume_point``).
    """
    complete = [s for s in index.sets if s.complete]
    if step is None:
        cset = next((s for s in complete if s.origin == ORIGIN_BRIDGE and s.id not in unhealthy), None)
    else:
        matches = sorted(
            (s for s in complete if s.global_step == step), key=lambda s: s.origin != ORIGIN_BRIDGE
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


def data_position(global_step: int, per_epoch: int) -> tuple[int, int]:
    """``(epochs finished, steps of the next epoch finished)`` after ``global_step`` steps.

    Training resumes in epoch index ``[0]`` (0-based), skipping its first ``[1]`` batches.
    """
    return divmod(global_step, per_epoch) if per_epoch > 0 else (0, 0)


def checkpoint_file(run_dir, rank: int, epoch: int, global_step: int, per_epoch: int | None) -> Path:
    """This rank's file for a stop after ``global_step`` (the name carries the step within the epoch)."""
    per_epoch = per_epoch or 1
    return runfiles.checkpoint_path(run_dir, rank, epoch, (global_step - 1) % per_epoch + 1)


def append_fields(
    *,
    epoch: int,
    global_step: int,
    per_epoch: int | None,
    request_id: str,
    rank: int,
    world: int,
    param_names,
    loss: float | None = None,
) -> dict:
    """The ``append_dict`` of a bridge checkpoint (README "Checkpoints the bridge writes")."""
    append = {
        "epoch_num": epoch,
        "step_num": global_step,
        "batch_num": per_epoch or 1,
        "rankwatch_request_id": request_id,
        "rankwatch_rank": rank,
        "rankwatch_world_size": world,
    }
    # MindSpore optimizers keep a `global_step` Parameter, saved with the
    # network. Adding the key again (as OnRequestExit does) replaces that
    # shape-(1,) tensor with a scalar, and the file no longer loads.
    if "global_step" not in param_names:
        append["global_step"] = global_step
    if loss is not None:
        # The set's health evidence (trainer_bridge/rundir/ckpthealth.py): 0 flags weights saved after a NaN.
        append["rankwatch_loss_finite"] = int(math.isfinite(loss))
    return append


def _parameters(cells) -> list:
    """Every Parameter of ``cells``, once each by name (an optimizer also holds the network's)."""
    seen, params = set(), []
    for cell in cells:
        for p in cell.get_parameters():
            if p.name not in seen:
                seen.add(p.name)
                params.append(p)
    return params


def param_names(cells) -> set[str]:
    return {p.name for p in _parameters(cells)}


def save_state(cells, path: Path, append: dict) -> None:
    """Save ``cells``' parameters with ``append`` into ``path`` (one cell as itself, as before)."""
    import mindspore as ms

    path.parent.mkdir(parents=True, exist_ok=True)
    if len(cells) == 1:
        obj = cells[0]
    else:
        obj = [{"name": p.name, "data": p} for p in _parameters(cells)]
    ms.save_checkpoint(obj, str(path), append_dict=append)


def load_state(path: Path, cells) -> list[str]:
    """Load ``path`` into ``cells``; return the names of their parameters it did not have."""
    import mindspore as ms

    params = ms.load_checkpoint(str(path))
    missing: list[str] = []
    for cell in cells:
        not_loaded, _ = ms.load_param_into_net(cell, params)
        missing += [n for n in not_loaded if n not in missing]
    return missing
