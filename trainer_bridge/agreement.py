"""How ranks agree on "stop now?": the amortised vote and its interval rule.

Pure Python, free of MindSpore: the collective that carries a vote is passed
in (``vote_sum``), so the rule's unit tests run in milliseconds.

Ranks agree with one float32 SUM AllReduce (the one collective MindSpore's
CPU backend has for this) every *K* steps, at global step numbers every rank
computes alike. *K* is recomputed at each agreement from *reduced* values
(the mean step time and the mean cost of an agreement), the same floats on
every rank, so every rank picks the same next step with no further message:
``K = clamp(max(sync_interval_s / step, agree_cost / (max_overhead * step)),
1, max_sync_every)``. When agreements are cheap, the stop latency decides K;
when the machine is so loaded that one costs more, K stretches so that
agreeing never takes more than ``max_overhead`` of the training time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# [saw a request, mean step time, mean agreement cost] summed over the ranks.
VoteSum = Callable[[float, float, float], tuple[float, float, float]]


def next_interval(
    mean_step_s: float,
    agree_cost_s: float,
    *,
    sync_interval_s: float,
    max_overhead: float,
    max_sync_every: int,
) -> int:
    """Steps until the next agreement (the rule above); 1 before any step time is known."""
    if mean_step_s <= 0:
        return 1
    for_latency = int(sync_interval_s / mean_step_s)
    for_cost = math.ceil(agree_cost_s / (max_overhead * mean_step_s))
    return max(1, min(max_sync_every, max(for_latency, for_cost)))


class Agreement:
    """One rank's side of the vote: when to vote next, and what it costs.

    The training thread calls ``step(dt)`` after every step; it returns True
    when this global step is an agreement step, and ``vote(mine)`` then
    returns the number of ranks that voted stop. ``vote_sum`` is None in a
    single process, where this rank's own vote is the answer.
    """

    def __init__(
        self,
        vote_sum: VoteSum | None,
        world: int,
        global_step: int,
        *,
        sync_interval_s: float,
        max_overhead: float,
        max_sync_every: int,
    ):
        self.vote_sum = vote_sum
        self.world = world
        self.sync_interval_s = sync_interval_s
        self.max_overhead = max_overhead
        self.max_sync_every = max_sync_every
        # Agree after the first step (it includes graph compilation), then every K.
        self.next_sync = global_step + 1
        self.sync_every = 1
        self.agree_cost_s = 0.0  # moving average of this rank's agreements, the first excluded
        # What agreeing has cost this rank (heartbeat "bridge_cost").
        self.agreements = 0
        self.agree_ms = 0.0
        self.first_agree_ms: float | None = None
        self._interval_time = 0.0
        self._interval_steps = 0

    def due(self, global_step: int, dt: float, steps: int = 1) -> bool:
        """Count ``steps`` steps that took ``dt`` seconds; True if ``global_step`` must vote."""
        self._interval_time += dt
        self._interval_steps += steps
        return global_step >= self.next_sync

    def vote(self, mine: bool, global_step: int) -> float:
        """Vote at an agreed step; return how many ranks voted stop, and pick the next step."""
        mean = self._interval_time / self._interval_steps if self._interval_steps else 0.0
        self._interval_time, self._interval_steps = 0.0, 0
        started = time.perf_counter()
        if self.vote_sum is None:
            votes, mean_step_s, cost_s = float(mine), mean, self.agree_cost_s
        else:
            votes, mean_sum, cost_sum = self.vote_sum(float(mine), mean, self.agree_cost_s)
            mean_step_s, cost_s = mean_sum / self.world, cost_sum / self.world
        self._account(time.perf_counter() - started)
        self.sync_every = next_interval(
            mean_step_s,
            cost_s,
            sync_interval_s=self.sync_interval_s,
            max_overhead=self.max_overhead,
            max_sync_every=self.max_sync_every,
        )
        self.next_sync = global_step + self.sync_every
        return votes

    def _account(self, took: float) -> None:
        if self.agreements:
            self.agree_ms += took * 1e3
            # A moving average: one agreement that waited out a peer's hiccup
            # should not stretch the interval for long.
            self.agree_cost_s += 0.3 * (took - self.agree_cost_s) if self.agreements > 1 else took
        else:  # the first one compiles the AllReduce graph: a one-off, kept apart
            self.first_agree_ms = round(took * 1e3, 3)
        self.agreements += 1
