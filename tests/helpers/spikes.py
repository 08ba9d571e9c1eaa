"""The loss-spike detector replayed over a finished run's history files, or a recorded curve (issue 34:
no false alarm)."""

from __future__ import annotations

import json
from pathlib import Path

from app.run.spikes import Detection, Detector, Params
from trainer_bridge.rundir import runfiles


def replay(run_dir: Path, ranks: int, params: Params | None = None) -> tuple[list[Detection], int]:
    """Every history line of every rank, in time order, through a fresh detector with ``params``
    (the defaults): (its detections, the samples with a loss it judged)."""
    lines = []
    for r in range(ranks):
        path = runfiles.history_path(run_dir, r)
        for rotated in (Path(f"{path}.1"), Path(path)):
            if rotated.exists():
                for raw in rotated.read_text().splitlines():
                    if raw.strip():
                        lines.append((json.loads(raw), r))
    lines.sort(key=lambda x: x[0]["time"])
    det = Detector(params, world=ranks)
    judged = 0
    for line, r in lines:
        judged += line.get("loss") is not None
        det.observe(r, line, line["time"])
    return det.take(), judged


def replay_curve(
    ranks: list[list[float]], stride: int, offset: int, params: Params | None = None
) -> list[Detection]:
    """Every rank's loss at every ``stride``-th step from ``offset``, as heartbeats would sample a curve
    recorded step by step (``tests/data/curves``), through a fresh detector: its detections."""
    det = Detector(params, world=len(ranks))
    for step in range(offset, len(ranks[0]), stride):
        for rank, losses in enumerate(ranks):
            det.observe(rank, {"global_step": step + 1, "loss": losses[step], "launch": "a"}, 0.0)
    return det.take()
