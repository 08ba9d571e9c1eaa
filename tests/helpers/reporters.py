"""A rank-0 ``Reporter`` of a one-rank job, for tests that drive the reporter without training."""

from __future__ import annotations

from pathlib import Path


def reporter(run_dir: Path, *, heartbeat_interval_s: float, poll_interval_s: float):
    """Not started; the caller starts and closes it."""
    from trainer_bridge.counters import Counters
    from trainer_bridge.reporter import Reporter
    from trainer_bridge.saving import NOTHING_SERVED

    return Reporter(
        run_dir,
        0,
        1,
        Counters(1, 100, 0),
        served=NOTHING_SERVED,
        heartbeat_interval_s=heartbeat_interval_s,
        poll_interval_s=poll_interval_s,
        sync_interval_s=0.5,
        batch_size=None,
        resumed=None,
    )
