"""The step counters: the one thing the training thread writes for the reporter.

The training thread updates a ``Counters`` on every step (a few additions,
no lock); the reporter reads them through ``snapshot()`` (on its own
thread, or on the training thread at an agreement), one
consistent-enough tuple per heartbeat (each field is a single Python object,
so no field is ever torn).
"""

from __future__ import annotations

import collections
import time
from typing import NamedTuple

# The heartbeat carries each step's time since the previous heartbeat; this
# bounds that list (and the deque behind it) for very fast steps.
MAX_STEP_TIMES = 64


class Snapshot(NamedTuple):
    """What the reporter reads of the training thread's counters, at one moment."""

    epoch: int
    per_epoch: int | None
    global_step: int
    steps_total: int
    in_total: float
    out_total: float
    last_step_end: float
    sync_every: int
    agreements: int
    agree_ms: float
    first_agree_ms: float | None


class Counters:
    """Written by the training thread only, read by the reporter through ``snapshot()``.

    The totals are never reset, so the reporter takes deltas without racing
    the training thread: time inside steps (from begin to end: compute and
    waiting for peers in the gradient AllReduce) and between them (data
    loading, other callbacks, host work).
    """

    __slots__ = (
        "epoch",
        "per_epoch",
        "global_step",
        "steps_total",
        "in_total",
        "out_total",
        "last_step_end",
        "step_times",
        "sync_every",
        "agreements",
        "agree_ms",
        "first_agree_ms",
    )

    def __init__(self, epoch: int, per_epoch: int | None, global_step: int):
        self.epoch = epoch
        self.per_epoch = per_epoch
        self.global_step = global_step
        self.steps_total = 0
        self.in_total = 0.0
        self.out_total = 0.0
        self.last_step_end = time.perf_counter()
        self.step_times: collections.deque = collections.deque(maxlen=MAX_STEP_TIMES)
        self.sync_every = 1
        self.agreements = 0
        self.agree_ms = 0.0
        self.first_agree_ms: float | None = None

    def snapshot(self) -> Snapshot:
        return Snapshot(
            self.epoch,
            self.per_epoch,
            self.global_step,
            self.steps_total,
            self.in_total,
            self.out_total,
            self.last_step_end,
            self.sync_every,
            self.agreements,
            self.agree_ms,
            self.first_agree_ms,
        )

    def drain_step_times(self) -> list[float]:
        times = []
        while True:
            try:
                times.append(self.step_times.popleft())
            except IndexError:
                return times
