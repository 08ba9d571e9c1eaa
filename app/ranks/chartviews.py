"""The charts' reads of a run's view: the per-rank window, the whole-run series, the landing sparkline.

A mixin of ``app.ranks.state.RunState``, which holds the slots (each rank's
recent points, ``RankSlot.history``), the whole-run series
(``app.ranks.runhistory.RunHistory``) and the lock these methods take.
Apart from ``_feed_run_history``, called by ``RunState._scan`` under the
lock, each is a read for a route: ``/api/history``, ``/api/history/run``
and the landing row's sparkline.
"""

from __future__ import annotations

import math

from app.attempts import launches


class ChartViews:
    """Chart reads over ``RunState``'s slots; see the module docstring."""

    def _feed_run_history(self, changed: set[int]) -> None:
        """Give the whole-run series the changed ranks' new points; seeded from the tails once."""
        hist = self._run_history
        if not hist.seeded and self._slots and self.run_dir is not None:
            hist.seed_from_files(
                self.run_dir, {r: s.hb for r, s in self._slots.items()}, launches(self.run_dir)
            )
        for r in changed:
            slot = self._slot(r)
            if slot is not None and slot.history:
                hist.feed_new(r, slot.history, slot.hb.get("launch") if slot.hb else None)

    def run_history(self, attempts: list[dict], after: float | None, generation: int | None) -> dict:
        """The whole-run chart series (``/api/history/run``; ``RunHistory.answer``)."""
        with self._lock:
            return self._run_history.answer(attempts, after, generation)

    def loss_spark(self, points: int) -> list[float]:
        """At most ``points`` losses of the lowest rank's chart history, evenly picked, the newest last.

        The landing page's sparkline: from the points the view already holds
        (the history tail it was seeded from, then each heartbeat), so it
        reads no file. A NaN or infinite loss (null in the history) is left out.
        """
        with self._lock:
            slot = next(
                (s for r in sorted(self._rows) if (s := self._slot(r)) is not None and s.history), None
            )
            losses = [p[2] for p in slot.history if p[2] is not None] if slot is not None else []
        if len(losses) <= points or points < 2:
            return losses[-points:] if points > 0 else []
        step = (len(losses) - 1) / (points - 1)
        return [losses[round(i * step)] for i in range(points)]

    def history(self, points: int | None = None, start: int = 0, count: int | None = None) -> dict:
        """Chart history as a ranks x time-bucket matrix (``/api/history``).

        Columns are buckets of ``CHART_BUCKET_S`` seconds, the newest ``points``
        of them ending at the newest point; a cell holds the rank's last value
        in that bucket, or null. The page seeds its charts from this and then
        extends them from deltas, so both sides bucket the same way.
        Only the ranks ``start`` to ``start + count`` (in rank order) are in it,
        and ``total`` says how many there are: an answer costs a page, not the
        world size job.json declares.
        """
        points = min(points or self.points, self.points)
        with self._lock:
            everyone = sorted(self._rows)
            ranks = everyone[start : None if count is None else start + count]
            series = {r: list(s.history) for r in ranks if (s := self._slot(r)) is not None and s.history}
        total = len(everyone)
        del everyone
        b = self.bucket_s
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
