"""The loss-spike policy in force for one run: the settings, with ``rankwatch/spikes.json`` over them.

The dashboard's detector (``app/run/spikes.py``, ``app/incidents/spikes.py``)
resolves them here; ``skip_batches`` reaches
``rankwatch launch`` in the rollback request, whose own budget and margin
are its options (``rollbacks.SupervisorSettings``). The file is untrusted
input like every other in the run directory: a bad one is ignored whole,
and the reason is shown.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass

from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.schema import SchemaError, SpikesFile, load

MODES = ("off", "observe", "enforce")
OVERRIDE_NAME = "spikes.json"
# The settings, as named in the dashboard's configuration, with their defaults.
DEFAULTS = {
    "SPIKE_MODE": "observe",
    "SPIKE_FACTOR": 3.0,
    "SPIKE_STEPS": 3,
    "SPIKE_RECOVER_STEPS": 100,
    "SKIP_BATCHES": 100,
    "MAX_ROLLBACKS": 3,
}


@dataclass(frozen=True)
class SpikePolicy:
    mode: str = "observe"
    factor: float = 3.0
    steps: int = 3
    recover_steps: int = 100
    skip_batches: int = 100
    max_rollbacks: int = 3
    source: str = "settings"
    error: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def override_path(run_dir: str | os.PathLike) -> str:
    return os.path.join(runfiles.state_dir(run_dir), OVERRIDE_NAME)


def policy_for(run_dir: str | os.PathLike | None, config: Mapping) -> SpikePolicy:
    """The policy in force: ``config``'s ``SPIKE_*`` (defaults for the missing), then the run's file."""
    mode = config.get("SPIKE_MODE", DEFAULTS["SPIKE_MODE"])
    if mode not in MODES:
        raise ValueError(f"setting SPIKE_MODE must be one of {', '.join(MODES)}, not {mode!r}")
    factor = float(config.get("SPIKE_FACTOR", DEFAULTS["SPIKE_FACTOR"]))
    if not factor > 1:
        raise ValueError(f"setting SPIKE_FACTOR must be above 1, not {factor}")
    fields = {
        "mode": mode,
        "factor": factor,
        "steps": int(config.get("SPIKE_STEPS", DEFAULTS["SPIKE_STEPS"])),
        "recover_steps": int(config.get("SPIKE_RECOVER_STEPS", DEFAULTS["SPIKE_RECOVER_STEPS"])),
        "skip_batches": int(config.get("SKIP_BATCHES", DEFAULTS["SKIP_BATCHES"])),
        "max_rollbacks": int(config.get("MAX_ROLLBACKS", DEFAULTS["MAX_ROLLBACKS"])),
    }
    if not run_dir:
        return SpikePolicy(**fields)
    try:
        override = load(SpikesFile, override_path(run_dir))
    except FileNotFoundError:
        return SpikePolicy(**fields)
    except (OSError, SchemaError) as e:
        return SpikePolicy(**fields, error=f"rankwatch/{OVERRIDE_NAME} ignored: {e}")
    for name in SpikesFile.model_fields:
        if getattr(override, name) is not None:
            fields[name] = getattr(override, name)
    return SpikePolicy(**fields, source=f"settings + rankwatch/{OVERRIDE_NAME}")
