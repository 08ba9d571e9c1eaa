"""The bridge's arguments, validated once: ``GracefulExitBridge``'s and the functional loop's.

``Settings`` refuses a value the engine could not use (a non-positive
interval, an overhead that is no fraction, a resume step that is no step)
with a sentence naming the argument, and takes the resume step from
``RANKWATCH_RESUME_STEP`` (``runfiles.RESUME_STEP_ENV``) when none is given.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from trainer_bridge.rundir import runfiles


@dataclass(frozen=True)
class Settings:
    """``GracefulExitBridge``'s arguments, validated (see its docstring)."""

    sync_interval_s: float = 0.5
    heartbeat_interval_s: float = 1.0
    poll_interval_s: float = 1.0
    max_sync_every: int = 1000
    max_overhead: float = 0.003
    resume: bool = True
    resume_step: int | None = None
    save_checkpoint: bool = True
    handle_sigterm: bool = True

    def __post_init__(self):
        for name in ("sync_interval_s", "heartbeat_interval_s", "poll_interval_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"GracefulExitBridge: {name} must be a positive number, got {value!r}")
        if not (isinstance(self.max_overhead, (int, float)) and 0 < self.max_overhead < 1):
            raise ValueError(
                f"GracefulExitBridge: max_overhead must be a fraction in (0, 1), got {self.max_overhead!r}"
            )
        if not (isinstance(self.max_sync_every, int) and self.max_sync_every >= 1):
            raise ValueError(
                f"GracefulExitBridge: max_sync_every must be an int >= 1, got {self.max_sync_every!r}"
            )
        step = self.resume_step
        if step is None:
            env_step = os.environ.get(runfiles.RESUME_STEP_ENV)
            if env_step:
                if not env_step.isdigit():
                    raise ValueError(
                        f"GracefulExitBridge: {runfiles.RESUME_STEP_ENV} must be a global step number, "
                        f"got {env_step!r}"
                    )
                object.__setattr__(self, "resume_step", int(env_step))
        elif not (isinstance(step, int) and step >= 1):
            raise ValueError(f"GracefulExitBridge: resume_step must be an int >= 1, got {step!r}")
