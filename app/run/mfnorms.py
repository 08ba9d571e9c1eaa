"""MindFormers' ``abnormal_global_norm.json``: the steps whose global norm passed its threshold (issue 34).

MindFormers' ``TrainingStateMonitor`` (``check_for_global_norm``) writes
``{"<global step>": [norm, ...]}`` under its output directory and reloads in
process; the dashboard reads it, bounded and validated, and the spike
detector (``app/run/spikes.py``) reports each step once as ``grad_norm``.
"""

from __future__ import annotations

import json
import math
import os

from app.run.spikes import MAX_NORMS_STEPS, _number
from trainer_bridge.rundir import safeio

# Where it may be: the run directory, or MindFormers' default output directory in it.
MINDFORMERS_NORMS = ("abnormal_global_norm.json", "output/abnormal_global_norm.json")
MAX_NORMS_BYTES = 64 * 1024


def read_mindformers(run_dir: str | os.PathLike) -> tuple[dict[int, float], str | None]:
    """MindFormers' ``{"<global step>": [norm, ...]}``, bounded and validated: ({step: largest norm}, why refused)."""
    for rel in MINDFORMERS_NORMS:
        try:
            data = safeio.read_regular(os.path.join(run_dir, rel), MAX_NORMS_BYTES)
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            return {}, f"{rel}: {e}"
        try:
            obj = json.loads(data)
        except (ValueError, RecursionError) as e:
            return {}, f"{rel}: not JSON: {str(e)[:100]}"
        if not isinstance(obj, dict):
            return {}, f"{rel}: not an object"
        out: dict[int, float] = {}
        for key, values in list(obj.items())[:MAX_NORMS_STEPS]:
            if not (isinstance(key, str) and key.isdigit() and len(key) <= 16):
                return {}, f"{rel}: key {key[:20]!r} is not a global step"
            seq = values if isinstance(values, list) else [values]
            nums = [n for n in (_number(v) for v in seq[:100]) if n is not None]
            if not nums:
                return {}, f"{rel}: step {key}: no number"
            out[int(key)] = max(nums, key=lambda n: math.inf if math.isnan(n) else n)
        return out, None
    return {}, None
