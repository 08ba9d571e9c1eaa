"""Checkpoint sets as the tests write them: small real MindSpore files, bridge sets, damaged ones."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import nn

from app.audit import AuditLog
from app.checkpoints import retention as rt
from app.checkpoints.service import CheckpointService
from app.checkpoints.verify import Verifier
from tests.helpers import ckptcraft
from trainer_bridge.rundir import runfiles

# A weight with one NaN, as a step whose loss went NaN leaves it.
NAN_WEIGHT = struct.pack("<4f", 1.0, float("nan"), 2.0, 3.0)


def nan_set(run_dir: Path, step: int, ranks=(0, 1), name: str = "net-1_{s}.ckpt") -> None:
    """A complete set at ``step`` whose weights are not finite; ``name`` "net-1_{s}_breakpoint.ckpt" is
    MindSpore's exception_save (the newest file on disk after a NaN raised in ``Model.train``)."""
    for r in ranks:
        body = ckptcraft.ckpt(
            ckptcraft.entry("w", ckptcraft.tensor([4], "Float32", NAN_WEIGHT)), global_step=step
        )
        ckptcraft.write(run_dir / f"ckpt/rank_{r}" / name.format(s=step), body)


class Small(nn.Cell):
    """Two Dense layers: big enough to have real tensors, small enough to be quick."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(16, 12)
        self.fc2 = nn.Dense(12, 3)

    def construct(self, x):
        return self.fc2(self.fc1(x))


def save_small(path, append_dict=None, fmt="ckpt", **kwargs) -> Path:
    """Save a fresh ``Small`` at ``path`` with MindSpore and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    ms.save_checkpoint(
        Small(), str(path), append_dict=dict(append_dict) if append_dict else None, format=fmt, **kwargs
    )
    return path


class _Samples:
    """16 random samples; GeneratorDataset wants ``__getitem__`` and arrays, not numpy scalars."""

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(16, 16)).astype(np.float32)
        self.y = rng.integers(0, 3, 16).astype(np.int32)

    def __getitem__(self, i):
        return self.x[i], np.asarray(self.y[i])

    def __len__(self):
        return len(self.x)


STEPS_PER_EPOCH = 8


BRIDGE = "checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt"


DAMAGED = "damaged/rank_{rank}/net-{E}_{S}.ckpt"


def bridge_id(global_step: int) -> str:
    return f"{BRIDGE}#g{global_step}"


def save_bridge_set(run: Path, global_step: int, ranks=(0, 1)) -> list[Path]:
    """Rank files exactly as the bridge saves them on a stop (a net without optimizer, so
    ``global_step`` may go into ``append_dict``)."""
    epoch, step = divmod(global_step - 1, STEPS_PER_EPOCH)
    paths = []
    for r in ranks:
        paths.append(
            save_small(
                runfiles.checkpoint_path(run, r, epoch + 1, step + 1),
                {
                    "epoch_num": epoch + 1,
                    "step_num": global_step,
                    "batch_num": STEPS_PER_EPOCH,
                    "global_step": global_step,
                    "rankwatch_request_id": f"req-{global_step}",
                    "rankwatch_rank": r,
                    "rankwatch_world_size": len(ranks),
                },
            )
        )
    return paths


def write_damaged(run: Path, series: str, name: str, global_step: int) -> None:
    """Rank 0 good; rank 1 truncated, 2 empty, 3 random bytes, 4 JSON renamed .ckpt."""
    epoch, step = divmod(global_step - 1, STEPS_PER_EPOCH)
    good = save_small(
        run / series / "rank_0" / name,
        {
            "epoch_num": epoch + 1,
            "step_num": global_step,
            "batch_num": STEPS_PER_EPOCH,
            "global_step": global_step,
        },
    )
    bad = {
        1: good.read_bytes()[:300],
        2: b"",
        3: b"\x93" + os.urandom(2000),
        4: json.dumps({"GracefulExit": 1}).encode(),
    }
    for r, content in bad.items():
        path = run / series / f"rank_{r}" / name
        path.parent.mkdir(parents=True)
        path.write_bytes(content)


OLD = time.time() - 3600  # files older than any settle time


def periodic(
    run_dir: Path,
    step: int,
    ranks=(0, 1),
    mtime: float = OLD,
    extra=b"",
    name: tuple[int, int] | None = None,
    **extras,
) -> None:
    """``ckpt/rank_{r}/net-1_{step}.ckpt`` for each rank: a ModelCheckpoint-like periodic set.

    ``name``: (epoch, step in epoch) for the file name instead, as ModelCheckpoint names a
    save at the same point as the bridge's (``net-3_4`` beside ``rankwatch-3_4``).
    """
    for r in ranks:
        body = ckptcraft.ckpt(
            ckptcraft.entry("w", ckptcraft.tensor([4], "Float32", b"\0" * 16)) + extra,
            *(ckptcraft.scalar_int(k, v) for k, v in extras.items()),
            global_step=step,
        )
        epoch, in_epoch = name or (1, step)
        p = ckptcraft.write(run_dir / f"ckpt/rank_{r}/net-{epoch}_{in_epoch}.ckpt", body)
        os.utime(p, (mtime, mtime))


def sid(step: int) -> str:
    return f"ckpt/rank_{{rank}}/net-{{E}}_{{S}}.ckpt#g{step}"


CONFIG = {
    "RETENTION_MODE": "off",
    "RETENTION_KEEP": 3,
    "RETENTION_EVERY": 0,
    "RETENTION_SETTLE_S": 30.0,
    "RETENTION_TMP_AGE_S": 600.0,
}


def retention(run_dir: Path, **config) -> rt.Retention:
    service = CheckpointService(
        str(run_dir), AuditLog(run_dir / "rankwatch/audit.sqlite3"), scan_s=0.0, verifier=Verifier(None, None)
    )
    return rt.Retention(service, CONFIG | config)
