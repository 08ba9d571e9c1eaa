"""The charts' shapes of a run's points: the per-rank window (``/api/history``) and the landing sparkline.

A reader handed a ``RunState``: the model keeps each rank's recent points
(``RankSlot.history``) and the whole-run series (``app.run.history``), and
copies them out under its lock (``RunState.chart_points``); this module only
shapes the copies.
"""

from __future__ import annotations

import math

from app.run.state import RunState


def loss_spark(state: RunState, points: int) -> list[float]:
    """At most ``points`` losses of the lowest rank's chart history, evenly picked, the newest last.

    The landing page's sparkline: from the points the view already holds
    (the history tail it was seeded from, then each heartbeat), so it
    reads no file. A NaN or infinite loss (null in the history) is left out.
    """
    _, series, _ = state.chart_points(lowest_only=True)
    history = next(iter(series.values()), [])
    losses = [p[2] for p in history if p[2] is not None]
    if len(losses) <= points or points < 2:
        return losses[-points:] if points > 0 else []
    step = (len(losses) - 1) / (points - 1)
    return [losses[round(i * step)] for i in range(points)]


def history(state: RunState, points: int | None = None, start: int = 0, count: int | None = None) -> dict:
    """Chart history as a ranks x time-bucket matrix (``/api/history``).

    Columns are buckets of ``CHART_BUCKET_S`` seconds, the newest ``points``
    of them ending at the newest point; a cell holds the rank's last value
    in that bucket, or null. The page seeds its charts from this and then
    extends them from deltas, so both sides bucket the same way.
    Only the ranks ``start`` to ``start + count`` (in rank order) are in it,
    and ``total`` says how many there are: an answer costs a page, not the
    world size job.json declares.
    """
    points = min(points or state.points, state.points)
    ranks, series, total = state.chart_points(start, count)
    b = state.bucket_s
    newest = max((h[-1][0] for h in series.values()), default=None)
    if newest is None:
        return {"bucket_s": b, "t": [], "ranks": ranks, "step_time_ms": [], "loss": [], "total": total}
    end = math.floor(newest / b)
    start = max(end - points + 1, min(math.floor(h[0][0] / b) for h in series.values()))
    width = end - start + 1
    step_rows, loss_rows = [], []
    for r in ranks:
        steps, losses = [None] * width, [None] * width
        for t, _, loss, step_ms in series.get(r, ()):
            col = math.floor(t / b) - start
            if col >= 0:
                steps[col], losses[col] = step_ms, loss
        step_rows.append(steps)
        loss_rows.append(losses)
    return {
        "bucket_s": b,
        "t": [(start + i) * b for i in range(width)],
        "ranks": ranks,
        "step_time_ms": step_rows,
        "loss": loss_rows,
        "total": total,
    }
