"""One rank's loss (or global norm) as the spike detector sees it: a rolling level and the abnormal run.

The detector's rules are ``app/run/spikes.py``'s; this is what they judge
against.

The level is a **rolling median** of the rank's last ``WINDOW`` normal
samples, not an EMA: a median ignores the odd outlier entirely (an EMA is
pulled up by it, and then misses the spike that follows), it needs no decay
constant to tune against the heartbeat rate, and an abnormal sample is never
added to it, so a slow spike cannot raise its own bar. A loss that falls
fast early in training only puts the median above the loss, which is safe.
The spike rule judges only a positive level (a loss that may go to or below
zero has no ratio); ``WARMUP`` samples are needed before it judges at all.

**The noise term.** A factor alone is touchy where the batches are noisy
next to the level, and the demo's own run is such a curve: with one label
in twenty wrong, once its median is near 0.25 the batches that hold
several wrong labels read 0.9 to 1.1, and later, once the net has learnt
its training set, the median is near 0.002 and such batches read 0.1, fifty
times the level. Replayed at the 30 sampling rates and offsets of the
test named below, the factor rule alone raised false spikes in every one
of them (2,462 in all) over that whole run. So a sample is abnormal only
if it is also above the level by ``NOISE_K`` times the window's upper spread (its 90th
percentile less its median: the window is sorted already, so it costs an
index; a tail measure, because the noise that fooled the factor is a heavy
tail), and a spike needs three such samples in a row, not two (one more
heartbeat, about a second). On a smooth curve the spread is small and the
factor decides, as before. The values are held to whole real runs:
``tests/incidents/test_spikes_curves.py`` replays the demo's and MindSpore's
quick start's recorded curves at many sampling rates, requires silence on
them, and a detection when the net dies in the same noise. With a
``NOISE_K`` of 4, 3 of the 30 replays raise one. The cost: where the
noise is widest, a loss that jumps to ln 10 (a dead net) can sit under the
bar and go unseen: at 116 of the demo's 17,677 steps where the factor
alone would see it (0.7%), all between its steps 366 and 932.
"""

from __future__ import annotations

import bisect
import math
from collections import deque

WINDOW = 32  # normal samples in a rank's rolling median
WARMUP = 8  # samples before the spike rules judge a rank
NOISE_K = 5.0  # an abnormal sample is also above the level by this many times the window's upper spread
NOISE_QUANTILE = 0.9  # the upper spread: this quantile of the window less its median
MIN_SAMPLES = 3  # a spike needs min(steps, this) abnormal samples in a row


class Series:
    """One rank's figure (loss or norm): its rolling median and the run of abnormal samples."""

    __slots__ = ("order", "sorted", "above_since", "above_n", "level_before", "last", "ok_step", "first")

    def __init__(self) -> None:
        self.order: deque[float] = deque()
        self.sorted: list[float] = []
        self.above_since: int | None = None  # the first abnormal sample's step
        self.ok_step: int | None = None  # the last normal sample's step
        self.first: int = 0  # the earliest step that may be abnormal (``Detection.first_step``)
        self.above_n = 0
        self.level_before: float | None = None
        self.last: float | None = None

    def level(self) -> float | None:
        n = len(self.sorted)
        if n < WARMUP:
            return None
        mid = n // 2
        return self.sorted[mid] if n % 2 else (self.sorted[mid - 1] + self.sorted[mid]) / 2

    def add(self, value: float) -> None:
        self.order.append(value)
        bisect.insort(self.sorted, value)
        if len(self.order) > WINDOW:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def start(self, step: int, level: float | None) -> None:
        self.above_since, self.level_before = step, level
        self.first = step if self.ok_step is None else self.ok_step + 1

    def spread(self, level: float) -> float:
        """How far the window's upper tail reaches above ``level``: its ``NOISE_QUANTILE`` less the level."""
        at = NOISE_QUANTILE * (len(self.sorted) - 1)
        low = int(at)
        high = min(low + 1, len(self.sorted) - 1)
        quantile = self.sorted[low] + (self.sorted[high] - self.sorted[low]) * (at - low)
        # Forged extremes (1e308 beside -1e308) overflow to inf or nan: the factor alone judges then.
        return quantile - level if math.isfinite(quantile) and quantile > level else 0.0

    def abnormal(self, value: float, level: float, factor: float) -> bool:
        return value > factor * level and value > level + NOISE_K * self.spread(level)

    def judge(self, step: int, value: float, factor: float, steps: int) -> tuple[bool, float | None]:
        """(whether the spike rule trips now, the level judged against); keeps the window."""
        level = self.level()
        self.last = value
        if level is None or level <= 0 or not self.abnormal(value, level, factor):
            self.above_since, self.above_n, self.ok_step = None, 0, step
            self.add(value)
            return False, level
        if self.above_since is None:
            self.start(step, level)
        self.above_n += 1
        span = step - self.above_since + 1
        trips = span >= steps and self.above_n >= min(steps, MIN_SAMPLES)
        return trips, level
