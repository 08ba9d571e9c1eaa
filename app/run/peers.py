"""The peer median, and the straggler figures built on it, defined once.

A rank's step cost is compared with the median of its *peers'*: the other
stepping ranks, without the rank itself. The row's verdict
(``app.run.health``, ``app.run.judging``), the summary tile's "slowest
rank", ``rankwatch status`` and the agents' hub all take their figures from
here. The tile once used the median of every rank, the straggler included, and
said 1.21x against 954 ms while the row said 1.5x against 755 ms.

``slowest_rank()`` is the tile's rule, which the board
(``app.run.judging``) and the agents' hub (``app.agent.hub``) both call:
among the ranks alive and stepping with a cost, the largest (ties: the
highest rank), against its peer median. ``slowest()`` words its sentence,
so that the page and the CLI say the same thing; a rank is named only when
its verdict is ``straggler``, and the gap below that is jitter.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

import numpy as np

# The peer median in words, wherever a newcomer reads it (the tile, a row's reason, the CLI):
# "peer median" was jargon on the first screen (issue 33, section 6).
OTHERS_MEDIAN = "the other ranks' median"


def median(sorted_values: Sequence[float]) -> float | None:
    n = len(sorted_values)
    if n == 0:
        return None
    mid = n // 2
    return float(sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2)


def peer_median(sorted_values: Sequence[float], own: float) -> float | None:
    """The median of ``sorted_values`` without one copy of ``own``, in O(log n).

    ``sorted_values`` holds every rank's time including ``own``; sorting once
    per tick and answering each rank from it keeps a 1024-rank job cheap.
    """
    skip = bisect_left(sorted_values, own)
    n = len(sorted_values) - 1
    if n <= 0 or skip > n or sorted_values[skip] != own:
        return None

    def at(k: int) -> float:
        return sorted_values[k if k < skip else k + 1]

    mid = n // 2
    return float(at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2)


# A straggler stays one until it is clearly back among its peers: below this share of the
# ratio (and of the gap) that made it one. Without it a rank hovering near 1.5x flapped
# between straggler and healthy within a minute, and the page and the console disagreed.
STRAGGLER_HOLD = 0.9


def straggling(own_ms: float, peer_ms: float, ratio: float, min_gap_ms: float, was: bool = False) -> bool:
    """The straggler rule, with its hysteresis: ``was`` says the rank's last verdict was straggler.

    ``app.run.judging`` tests the same, element-wise, in this order of operations.
    """
    hold = STRAGGLER_HOLD if was else 1.0
    return own_ms >= ratio * hold * peer_ms and own_ms - peer_ms >= min_gap_ms * hold


def ratio_text(own_ms: float, peer_ms: float) -> str:
    """How many times the peer median, as the row's reason and the tile both write it."""
    return f"{own_ms / peer_ms:.2g}x"


def slowest(
    worst_ms: float,
    peer_ms: float | None,
    rank: int,
    basis: str,
    *,
    straggler: bool,
    threshold_ratio: float,
) -> dict:
    """The summary's ``slowest``: rank ``rank`` has the largest cost, ``worst_ms``.

    ``peer_ms`` is its peer median (``peer_median``), the figure its row is
    judged against; with no peer (one rank) it is compared with itself.
    """
    worst = float(worst_ms)
    mid = worst if peer_ms is None else float(peer_ms)
    figure = {
        "rank": rank,
        "step_time_ms": round(worst, 2),
        "median_ms": round(mid, 2),
        "gap_ms": round(worst - mid, 2),
        "ratio": round(worst / mid, 2) if mid > 0 else None,
        "basis": basis,
        # Only past the straggler rule is it a finding; below, the gap is jitter.
        "straggler": straggler,
        "threshold_ratio": threshold_ratio,
    }
    figure["text"] = slowest_text(figure)
    return figure


def pick(ranks: Sequence[int] | np.ndarray, costs: Sequence[float] | np.ndarray) -> tuple[int, float] | None:
    """(rank, cost) of the largest of ``costs`` (ties: the highest rank); None when there is none.

    The agent names its host's slowest rank by this too (its digest's ``slowest``).
    """
    costs = np.asarray(costs, dtype=float)
    if not costs.size:
        return None
    top = costs.max()
    return int(np.asarray(ranks)[costs == top].max()), float(top)


def slowest_rank(
    ranks: Sequence[int] | np.ndarray,
    costs: Sequence[float] | np.ndarray,
    basis: str,
    *,
    straggler: Callable[[int], bool],
    threshold_ratio: float,
    peer: Callable[[int], float | None] | None = None,
) -> dict | None:
    """The summary's ``slowest`` among ``ranks`` (alive, stepping, with a cost) and their ``costs``.

    ``peer(rank)``: its peer median where the caller already has it (the
    board's, per rank); else, and when that is None, it is taken from ``costs``.
    ``straggler(rank)``: whether its row's verdict is ``straggler``.
    """
    found = pick(ranks, costs)
    if found is None:
        return None
    rank, top = found
    mid = peer(rank) if peer is not None else None
    if mid is None:
        mid = peer_median(np.sort(np.asarray(costs, dtype=float)).tolist(), top)
    return slowest(top, mid, rank, basis, straggler=straggler(rank), threshold_ratio=threshold_ratio)


def _ms(value: float) -> str:
    """As the row's reason writes a time (``health._ms``)."""
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def slowest_text(s: dict) -> str:
    """The tile's sentence (the page and ``rankwatch status`` print it as it is)."""
    median_ms, ms = s["median_ms"], s["step_time_ms"]
    if not s["straggler"]:
        return f"none: every rank within {s['threshold_ratio']:g}x of {OTHERS_MEDIAN} step, {_ms(median_ms)}"
    # Work: the time a rank spends on its own, the wait for the others left out (app.run.health).
    own = " of its own work (the wait for the others left out)" if s["basis"] == "work" else ""
    ratio = f" ({ratio_text(ms, median_ms)})" if median_ms > 0 else ""
    return (
        f"rank {s['rank']}: {_ms(ms)} a step{own}, +{_ms(s['gap_ms'])} over {OTHERS_MEDIAN} "
        f"{_ms(median_ms)}{ratio}"
    )
