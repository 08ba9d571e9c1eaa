"""Verdict rules: what state a rank is in and why, as pure functions.

Everything here takes heartbeat dicts (README, "Heartbeat", schema 1) and the
current time, and does no I/O and reads no clock, so the rules are tested by
feeding heartbeat sequences. ``app.state`` does the reading and the process
probes and hands the results in.

The verdicts, in the order the rules are tried:

* **pending** - the rank has not written a heartbeat yet.
* **failed / finished / exited** - the rank said so in ``state``; these end a
  rank's life, so no later rule overrides them.
* **dead** - the process is gone (a probe on this host says so) or the
  heartbeats stopped for longer than ``dead_after_s``.
* **stalled** - no step for max(``stall_min_s``, ``stall_factor`` x the rank's
  median step time). Not applied while starting (graph compilation can take
  minutes) or saving a checkpoint.
* **straggler** - the rank's median step time over its window is at least
  ``straggler_ratio`` x the median of its peers (and ``straggler_min_gap_ms``
  slower in absolute terms).
* **healthy** - none of the above.

The score is nvidia-resiliency-ext's relative performance score with the
peer median as the reference instead of the fastest rank (one unusually fast
rank should not make everyone look slow): ``min(1, peer median / own)``, so
1.0 is "as fast as its peers" and 0.5 "twice as slow".
"""
from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

VERDICTS = ("healthy", "straggler", "stalled", "dead", "exited", "finished", "failed", "pending")

# One line per verdict, for the page's legend and the README.
VERDICT_HELP = {
    "healthy": "training (or starting, or saving) at the pace of its peers",
    "straggler": "steps markedly slower than the median of its peers",
    "stalled": "alive but has not finished a step for too long",
    "dead": "the process is gone or its heartbeats stopped",
    "exited": "stopped gracefully on request",
    "finished": "completed its training",
    "failed": "the process ended with an error",
    "pending": "has not written a heartbeat yet",
}

# States that end a rank's life; their verdict is the state itself.
TERMINAL_STATES = ("exited", "finished", "failed")
# States in which a rank steps and so is compared with its peers.
STEPPING_STATES = ("training", "stopping")


@dataclass(frozen=True)
class Thresholds:
    """The health settings (see ``app.config.SETTINGS`` for each one's reason)."""
    straggler_ratio: float = 1.5
    straggler_min_gap_ms: float = 5.0
    straggler_window: int = 32
    stall_min_s: float = 5.0
    stall_factor: float = 5.0
    dead_after_s: float = 30.0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Thresholds:
        return cls(**{f: config[f.upper()] for f in cls.__dataclass_fields__
                      if f.upper() in config})


@dataclass(frozen=True)
class Verdict:
    health: str
    reason: str
    score: float | None = None


def number(value: Any) -> float | None:
    """``value`` as a finite float, or None: heartbeats come from other processes."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def median(sorted_values: Sequence[float]) -> float | None:
    n = len(sorted_values)
    if n == 0:
        return None
    mid = n // 2
    return sorted_values[mid] if n % 2 else (sorted_values[mid - 1] + sorted_values[mid]) / 2


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
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


class StepWindow:
    """A rank's most recent step times and their median.

    Heartbeats carry each step's time since the previous heartbeat
    (``step_times_ms``); the window keeps the newest ``size`` of them. A
    heartbeat seen twice (same ``seq``) is counted once.
    """
    __slots__ = ("_times", "_seq", "median_ms")

    def __init__(self, size: int):
        self._times: deque[float] = deque(maxlen=size)
        self._seq: Any = None
        self.median_ms: float | None = None

    def add(self, hb: Mapping[str, Any]) -> None:
        seq = hb.get("seq")
        if seq is not None and seq == self._seq:
            return
        self._seq = seq
        times = hb.get("step_times_ms")
        if isinstance(times, list) and times:
            fresh = [t for t in map(number, times) if t is not None and t >= 0]
        else:
            last = number(hb.get("step_time_ms"))
            fresh = [last] if last is not None and last >= 0 else []
        if fresh:
            self._times.extend(fresh)
            self.median_ms = median(sorted(self._times))


def score(own_ms: float | None, peer_ms: float | None) -> float | None:
    """Relative performance score in [0, 1]: peer median / own, capped at 1."""
    if own_ms is None or peer_ms is None:
        return None
    if own_ms <= 0:
        return 1.0
    return round(min(1.0, peer_ms / own_ms), 2)


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def judge(hb: Mapping[str, Any] | None, now: float, th: Thresholds, *,
          own_ms: float | None = None, peer_ms: float | None = None,
          process_gone: str | None = None) -> Verdict:
    """One rank's verdict at time ``now``.

    ``own_ms`` is the median of the rank's step window, ``peer_ms`` the median
    of its stepping peers' (None when there is nothing to compare with).
    ``process_gone`` is a sentence saying why the rank's process is known to be
    gone, from a probe done by the caller; None means alive or unknown.
    """
    if not hb:
        return Verdict("pending", "has not written a heartbeat yet")
    state = hb.get("state")
    gstep = hb.get("global_step")
    rel = score(own_ms, peer_ms)
    if state == "failed":
        error = hb.get("error")
        return Verdict("failed", f"failed: {error}" if error else "failed without an error message")
    if state == "finished":
        return Verdict("finished", f"finished training at global step {gstep}", rel)
    if state == "exited":
        stop = hb.get("stop") if isinstance(hb.get("stop"), dict) else {}
        ckpt = stop.get("checkpoint") if isinstance(stop.get("checkpoint"), dict) else {}
        saved = f", checkpoint {ckpt['path']}" if ckpt.get("path") else ""
        return Verdict("exited", f"stopped gracefully at global step {gstep}{saved}", rel)

    if process_gone:
        return Verdict("dead", process_gone)
    written = number(hb.get("time"))
    age = now - written if written is not None else math.inf
    if age > th.dead_after_s:
        return Verdict("dead", f"no heartbeat for over {th.dead_after_s:g} s "
                               f"(last from {hb.get('host')} pid {hb.get('pid')})")

    if state == "starting":
        return Verdict("healthy", "starting: waiting for the first step (compiling)")
    if state == "saving":
        return Verdict("healthy", "saving a checkpoint", rel)

    last_step = number(hb.get("last_step_at"))
    if last_step is None:
        last_step = number(hb.get("started_at"))
    limit = max(th.stall_min_s, th.stall_factor * (own_ms or 0.0) / 1000.0)
    if last_step is not None and now - last_step > limit:
        return Verdict("stalled", f"no step finished for over {limit:.3g} s "
                                  f"(last: global step {gstep})", rel)

    if own_ms is not None and peer_ms is not None and own_ms >= th.straggler_ratio * peer_ms \
            and own_ms - peer_ms >= th.straggler_min_gap_ms:
        return Verdict("straggler", f"median step {_ms(own_ms)} is {own_ms / peer_ms:.2g}x "
                                    f"the peer median {_ms(peer_ms)}", rel)
    if state == "stopping":
        return Verdict("healthy", "stopping gracefully", rel)
    if peer_ms is None:
        return Verdict("healthy", "training (no peers to compare with)", rel)
    return Verdict("healthy", f"training within {th.straggler_ratio:g}x of the peer median", rel)


def judge_all(latest: Mapping[int, Mapping[str, Any] | None], own_ms: Mapping[int, float | None],
              now: float, th: Thresholds,
              process_gone: Mapping[int, str] | None = None) -> dict[int, Verdict]:
    """Every rank's verdict: peers are the other ranks that are stepping.

    O(n log n) for the one sort, then O(log n) per rank.
    """
    process_gone = process_gone or {}
    stepping = {r for r, hb in latest.items() if hb and hb.get("state") in STEPPING_STATES}
    times = sorted(own_ms[r] for r in stepping if own_ms.get(r) is not None)
    whole = median(times)
    out = {}
    for r, hb in latest.items():
        own = own_ms.get(r)
        if own is None:
            peer = whole
        elif r in stepping:
            peer = peer_median(times, own)
        else:
            peer = whole
        out[r] = judge(hb, now, th, own_ms=own, peer_ms=peer, process_gone=process_gone.get(r))
    return out


def judge_sequences(heartbeats: Mapping[int, Iterable[Mapping[str, Any]]], now: float,
                    th: Thresholds, process_gone: Mapping[int, str] | None = None,
                    ) -> dict[int, Verdict]:
    """Verdicts for ranks given each one's heartbeats in the order they were written.

    The same fold ``app.state`` does incrementally, in one call: the way the
    rules are meant to be read and tested.
    """
    latest, own = {}, {}
    for r, seq in heartbeats.items():
        window = StepWindow(th.straggler_window)
        hb = None
        for hb in seq:
            window.add(hb)
        latest[r] = hb
        own[r] = window.median_ms
    return judge_all(latest, own, now, th, process_gone)
