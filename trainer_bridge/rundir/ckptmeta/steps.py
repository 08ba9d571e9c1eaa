"""Which step a checkpoint holds: from its ``append_dict`` values, else from its file name."""

from __future__ import annotations

import os
import re
from typing import Any

_NAME_RE = re.compile(r"^(?P<prefix>.+)-(?P<epoch>\d+)_(?P<step>\d+)\.(?:ckpt|safetensors)$")


# The MindIO TTP docs say tft_, MindSpore 2.10's code writes ttp_.
TTP_STEP_DIR_RE = re.compile(r"^(?:tft|ttp)_saved_checkpoints-step_(?P<global_step>\d+)$")


def steps_from_name(path: str | os.PathLike) -> tuple[int | None, int | None, int | None]:
    """``(epoch, step_in_epoch, global_step)`` from a path, each None if absent.

    ``{prefix}-{epoch}_{step}.ckpt`` is ModelCheckpoint's name (TTP's
    ``ttp_rank_{r}-{E}_{S}.ckpt`` and the bridge's follow it); a TTP
    ``tft_saved_checkpoints-step_{G}`` directory up to two levels above the
    file gives the global step.
    """
    path = os.fspath(path)
    name = os.path.basename(path)
    m = _NAME_RE.match(name)
    epoch, step = (int(m["epoch"]), int(m["step"])) if m else (None, None)
    global_step = None
    parent = os.path.dirname(path)
    for _ in range(2):
        parent, part = os.path.split(parent)
        g = TTP_STEP_DIR_RE.match(part)
        if g:
            global_step = int(g["global_step"])
            break
    return epoch, step, global_step


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _resolve_step(
    path: str, scalars: dict, fmt: str
) -> tuple[int | None, int | None, int | None, str | None]:
    """Epoch, step in epoch and global step: the contents first, the name for gaps.

    MindSpore's callbacks store ``epoch_num``, ``step_num`` (cumulative, not
    within the epoch), ``batch_num`` (steps per epoch) and ``global_step``.
    A one-element ``global_step`` is also what an optimizer keeps, and what
    ``OnRequestExit`` itself reports as the global step.
    """
    if fmt == "mindir":
        return None, None, None, None
    epoch = _as_int(scalars.get("epoch_num"))
    step_num = _as_int(scalars.get("step_num"))
    batch_num = _as_int(scalars.get("batch_num"))
    global_step = _as_int(scalars.get("global_step"))
    if global_step is None:
        global_step = step_num
    step = (step_num - 1) % batch_num + 1 if step_num and batch_num and batch_num > 0 else None
    from_contents = global_step is not None or (epoch is not None and step is not None)
    n_epoch, n_step, n_global = steps_from_name(path)
    epoch = epoch if epoch is not None else n_epoch
    step = step if step is not None else n_step
    global_step = global_step if global_step is not None else n_global
    if from_contents:
        return epoch, step, global_step, "contents"
    if epoch is not None or step is not None or global_step is not None:
        return epoch, step, global_step, "name"
    return None, None, None, None
