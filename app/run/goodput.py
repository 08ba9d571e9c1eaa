"""Goodput: the share of the run's wall time spent on training steps that were kept.

``measure`` is the one engine behind the run page (beside the attempts
timeline), the landing page's column, ``rankwatch status``, ``rankwatch runs``
and ``/metrics``. It is a pure function of the attempts' rows (``/api/attempts``,
oldest first) and the step times of each attempt (the whole-run chart series,
``RunHistory.step_times``), so the arithmetic is tested on its own.

**Kept steps.** Attempt *i* trained global steps ``first_step .. last_step``.
A later attempt that resumed from an older set (its ``first_step`` at or
below that range) trains those steps again: attempt *i*'s copies of them are
lost work (its replayed steps). What is left is kept. Downtime (detection,
ending, relaunch, MindSpore's start and compile) is never a step, so it is
never kept.

**Their wall time.** A step's time is the bridge's step time. The series has
one point per heartbeat (and is thinned to a point a minute after an hour),
so a point stands for every step since the attempt's previous point: each
kept step takes the time of the point that covers it. A step no point covers
(the first steps before any heartbeat named a step time) takes the mean of
the attempt's known step times; an attempt with none adds nothing.

**The wall time of the run** runs from the first attempt's start (the
supervisor starting msrun when ``rankwatch launch`` ran it, else rank 0's
bridge starting) to now while the run may still train, else to the newest
end an attempt recorded.

Every number comes from run-directory files: the rows are validated by the
schema, the step times by ``RunHistory``; a time that goes backwards or a
step time that is not finite is skipped, and the ratio is clamped to [0, 1].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from itertools import pairwise

from trainer_bridge.rundir import supervised

# A ratio shown with this many decimals (a percentage with two).
DIGITS = 4


def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def kept_ranges(rows: Sequence[Mapping]) -> list[tuple[int, int, int] | None]:
    """Per row: (first kept step, last kept step, steps lost), or None if it trained no step.

    An empty kept range is ``(first, first - 1, lost)``.
    """
    out: list[tuple[int, int, int] | None] = []
    # The lowest first step of any later attempt: everything from there on was trained again.
    later_first = math.inf
    for row in reversed(rows):
        first, last = row.get("first_step"), row.get("last_step")
        if not isinstance(first, int) or not isinstance(last, int) or last < first:
            out.append(None)
        else:
            upto = int(min(last, later_first - 1)) if later_first != math.inf else last
            upto = max(upto, first - 1)
            out.append((first, upto, last - upto))
        if isinstance(first, int):
            later_first = min(later_first, first)
    out.reverse()
    return out


def kept_seconds(first: int, upto: int, points: Sequence[tuple[float, float]]) -> float | None:
    """The wall time of steps ``first .. upto`` from an attempt's (global step, step seconds) points.

    None when no point of the attempt has a step time (nothing is known).
    """
    known = []
    for step, seconds in points:
        step, seconds = _num(step), _num(seconds)
        if step is not None and seconds is not None and seconds >= 0:
            known.append((int(step), seconds))
    known.sort()
    if not known:
        return None
    if upto < first:
        return 0.0
    mean = sum(t for _, t in known) / len(known)
    total, covered_to = 0.0, first - 1
    for step, seconds in known:
        if step < first:
            continue
        lo, hi = covered_to, min(step, upto)
        if hi > lo:
            total += (hi - lo) * seconds
            covered_to = hi
        if covered_to >= upto:
            break
    if covered_to < upto:
        # Steps past the newest point (its heartbeat not read yet): at the attempt's mean.
        total += (upto - covered_to) * mean
    return total


def _start(row: Mapping) -> float | None:
    sup = row.get("supervisor") or {}
    times = [t for t in (_num(sup.get("spawned_at")), _num(row.get("started_at"))) if t is not None]
    return min(times) if times else None


def _end(row: Mapping) -> float | None:
    sup = row.get("supervisor") or {}
    times = [t for t in (_num(row.get("ended_at")), _num(sup.get("ended_at"))) if t is not None]
    return max(times) if times else None


def measure(
    rows: Sequence[Mapping],
    step_times: Mapping[str | None, Sequence[tuple[float, float]]],
    now: float,
    running: bool,
) -> dict:
    """The run's goodput and what it is made of.

    ``rows``: the attempts, oldest first (``app.attempts.answer``); ``step_times``:
    launch id -> (global step, step seconds) points; ``running``: the job may still
    train (its wall time runs to ``now``), as it does between two attempts of
    ``rankwatch launch`` (the last row's supervised line says ``relaunch``).
    """
    ranges = kept_ranges(rows)
    if rows and (rows[-1].get("supervisor") or {}).get("action") == "relaunch":
        running = True  # between two attempts: the next one is on its way
    kept_s, kept_steps, lost_steps, known = 0.0, 0, 0, False
    for row, rng in zip(rows, ranges, strict=True):
        if rng is None:
            continue
        first, upto, lost = rng
        lost_steps += lost
        kept_steps += max(0, upto - first + 1)
        seconds = kept_seconds(first, upto, step_times.get(row.get("launch"), ()))
        if seconds is not None:
            kept_s += seconds
            known = True
    starts = [s for r in rows if (s := _start(r)) is not None]
    ends = [e for r in rows if (e := _end(r)) is not None]
    start = min(starts) if starts else None
    end = now if running or not ends else max(ends)
    wall_s = end - start if start is not None and end > start else None
    downtime = [d for r in rows if (d := _num((r.get("downtime") or {}).get("total_s"))) is not None]
    ratio = min(1.0, kept_s / wall_s) if known and wall_s else None
    g = {
        "goodput": round(ratio, DIGITS) if ratio is not None else None,
        "kept_s": round(kept_s, 3) if known else None,
        "wall_s": round(wall_s, 3) if wall_s is not None else None,
        "kept_steps": kept_steps,
        "steps_lost": lost_steps,
        "restarts": max(0, len(rows) - 1),
        "restarts_by_launch": sum(1 for r in rows if r.get("restarted_by") == "launch"),
        # What relaunched each attempt after the first: rankwatch launch or a Slurm requeue
        # (after a fault, a hang, a preemption), else a person (a stop, then the command again).
        "automatic_restarts": sum(1 for a, b in pairwise(rows) if _automatic(a, b)),
        "downtime_s": round(sum(downtime), 3) if downtime else None,
        # rankwatch launch gave up after the newest attempt (its budget, the startup or no-progress rule).
        "gave_up": supervised.gave_up(rows[-1]) if rows else None,
    }
    # Said once, here: the page, the runs table and the terminal show these words.
    g["text"], g["detail"] = text(g), detail(g)
    return g


def _requeues(row: Mapping) -> int:
    count = ((row.get("supervisor") or {}).get("scheduler") or {}).get("restart_count")
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def _automatic(ended: Mapping, next_: Mapping) -> bool:
    """Whether ``next_`` was started by rankwatch launch (it marks the attempt it relaunched) or a Slurm requeue."""
    return ended.get("restarted_by") == "launch" or _requeues(next_) > _requeues(ended)


def text(g: Mapping) -> str:
    """The goodput in one line, as the terminal and the page say it (the page takes it from the API).

    Relaunches by hand are told apart from automatic restarts: a stop and the
    same command again is not a fault, though its gap counts against goodput.
    """
    ratio = g.get("goodput")
    said = f"goodput {ratio * 100:.1f}%" if ratio is not None else "goodput not known yet"
    auto = g.get("automatic_restarts", g["restarts"])
    by_hand = max(0, g["restarts"] - auto)
    parts = [said]
    if auto or not by_hand:
        parts.append(_plural(auto, "automatic restart"))
    if by_hand:
        parts.append(f"{by_hand:,} relaunch{'' if by_hand == 1 else 'es'} by hand")
    parts.append(f"{_plural(g['steps_lost'], 'step')} lost")
    if g.get("downtime_s") is not None:
        parts.append(f"{g['downtime_s']:.1f} s down")
    return " · ".join(parts)


def detail(g: Mapping) -> str | None:
    """What the ratio is made of, for the page's line (None until both figures are known)."""
    if g.get("kept_s") is None or g.get("wall_s") is None:
        return None
    return (
        f"{g['kept_steps']:,} kept steps took {g['kept_s']:.1f} s of {g['wall_s']:.1f} s "
        "since the first attempt started"
    )


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")
