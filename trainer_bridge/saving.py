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

import itertools
import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path

from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.ckptindex import Index, resume_set
from trainer_bridge.rundir.ckptpaths import ORIGIN_BRIDGE

__all__ = [
    "ResumePoint",
    "Served",
    "agree_resume",
    "append_fields",
    "data_position",
    "find_resume_point",
    "load_state",
    "own_resume_points",
    "save_state",
    "served_requests",
]


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint set a job resumes from: its global step and this rank's file."""

    global_step: int
    epoch: int | None
    path: Path
    set_id: str | None = None


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
    return ResumePoint(cset.global_step, cset.epoch, Path(cset.file_for(rank).abspath), cset.id)


def own_resume_points(index: Index, rank: int, unhealthy: Container[str] = ()) -> dict[int, ResumePoint]:
    """The bridge's healthy sets that hold rank ``rank``'s readable file, by global step, newest first.

    Where nodes keep their run directories on local disks, a node sees only
    its own ranks' files and no set looks complete there: each rank offers
    the sets its own file is in, and the ranks agree (``agree_resume``).
    """
    points: dict[int, ResumePoint] = {}
    for s in index.sets:  # newest first
        if s.origin != ORIGIN_BRIDGE or s.id in unhealthy or s.global_step is None or s.global_step in points:
            continue
        own = s.file_for(rank)
        if own is not None:
            points[s.global_step] = ResumePoint(s.global_step, s.epoch, Path(own.abspath), s.id)
    return points


def agree_resume(
    vote_sum: Callable[[float, float, float], tuple[float, float, float]],
    rank: int,
    world: int,
    points: dict[int, ResumePoint],
) -> ResumePoint | None:
    """The newest set whose file every rank holds, agreed over ``vote_sum``; None for a fresh start.

    ``points`` is this rank's ``own_resume_points``. Rank 0 offers its steps,
    newest first, one per round; in the next round every rank votes whether
    it holds the step offered, and the first step all ``world`` ranks hold is
    the set. Every rank sees the same sums, so all run the same rounds (at
    most one more than rank 0's sets) and decide alike, whether the ranks
    share one run directory or each node keeps its own. The collective sums
    float32s, exact below 2**24: a step travels as two parts below 2**22
    (steps up to 2**44), and a vote is at most ``world``.
    """
    offers = list(points) if rank == 0 else []
    asked: int | None = None
    for i in itertools.count():  # ends once rank 0 runs out of offers
        offer = offers[i] + 1 if i < len(offers) else 0  # + 1: step 0 is an offer, 0 is none
        have = 1.0 if asked in points else 0.0
        low, votes, high = vote_sum(float(offer % _PART), have, float(offer // _PART))
        if asked is not None and round(votes) == world:
            return points[asked]
        offered = round(high) * _PART + round(low)
        if offered == 0:  # rank 0 has nothing left to offer: no set every rank holds
            return None
        asked = offered - 1


_PART = 2**22


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


def save_state(cells, path: Path, append: dict, global_step: int | None = None) -> None:
    """Save ``cells``' parameters with ``append`` into ``path`` (one cell as itself, as before).

    ``global_step``: the value to save for a ``global_step`` Parameter instead
    of its own. The dying gasp saves while the training thread is blocked in
    the gradient AllReduce, and an optimizer's ``global_step`` increment does
    not depend on the gradients: in graph mode it may already have run for
    the step whose update never came, so the file would name a step its
    weights never reached (and a resume would skip that step's data).
    """
    import mindspore as ms

    path.parent.mkdir(parents=True, exist_ok=True)
    if len(cells) == 1 and global_step is None:
        obj = cells[0]
    else:
        obj = [{"name": p.name, "data": _at_step(p, global_step)} for p in _parameters(cells)]
    ms.save_checkpoint(obj, str(path), append_dict=append)


def _at_step(p, global_step: int | None):
    """``p``, or for the optimizer's ``global_step`` a tensor like it holding ``global_step``."""
    if global_step is None or p.name != "global_step":
        return p
    import mindspore as ms
    import numpy as np

    return ms.Tensor(np.full(p.shape, global_step, dtype=p.asnumpy().dtype))


def load_state(path: Path, cells) -> list[str]:
    """Load ``path`` into ``cells``; return the names of their parameters it did not have."""
    import mindspore as ms

    params = ms.load_checkpoint(str(path))
    missing: list[str] = []
    for cell in cells:
        not_loaded, _ = ms.load_param_into_net(cell, params)
        missing += [n for n in not_loaded if n not in missing]
    return missing
