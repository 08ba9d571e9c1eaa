"""What is worth an alert, and how many: verdict changes, stops and the policy's actions.

``AlertDesk`` turns events into webhook payloads and hands them to
``app.incidents.webhooks.WebhookSender``. Every payload has ``event``, ``text`` (one
line a person can read, so Slack- or Feishu-style incoming webhooks show it
as it is), ``job`` (the run's id: its path under ``--runs``, else its
directory's name; never its absolute path, issue 32 P11) and ``at`` (Unix seconds); verdict
events add ``rank``, ``health``, ``reason`` and ``previous``.

Verdict changes are the noisy kind, so they go through three filters:

* **dedup**: a rank is announced only when its verdict differs from the one
  last announced for it; a change that comes back within the group window
  (stalled, then healthy again a second later) cancels out;
* **grouping**: changes are held ``ALERT_GROUP_S`` seconds, then sent
  together: up to ``ALERT_SUMMARY_OVER`` of them one by one, more as a
  single ``verdicts`` summary ("1024 ranks changed: 1024 stalled (ranks
  0-1023)"), because a job-wide hang turns ranks stalled over a second or
  two, not in one tick;
* **rate limit**: at most ``ALERT_RATE_PER_MIN`` verdict messages a minute;
  past that, changes wait and go out as one summary when the minute allows.

Stops and policy actions are few and each matters, so they skip the filters,
and each is sent once (a ``dedup_key`` the delivery log keeps, so a
restarted dashboard does not announce an old stop again).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from app.incidents.webhooks import WebhookSender

# Verdicts worth an alert on the way in; "healthy" is announced only as a
# recovery from one of them.
ALERTING = ("stalled", "dead", "node_lost", "agent_lost", "failed", "straggler")
RECOVERED = "healthy"
VERDICT_EVENT = "verdict"
SUMMARY_EVENT = "verdicts"
# How many ranks a summary's text names per verdict before it says "and N more".
NAMED = 16


def ranks_text(ranks: Iterable[int], limit: int | None = None) -> str:
    """``[0, 2, 3, 4, 7]`` as ``"0, 2-4, 7"``; past ``limit`` runs, ``"... and N more"``."""
    ordered = sorted(set(ranks))
    runs: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        runs.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    if limit is not None and len(runs) > limit:
        shown = ", ".join(runs[:limit])
        return f"{shown} and {len(ordered) - sum(_run_len(r) for r in runs[:limit])} more"
    return ", ".join(runs)


def _run_len(run: str) -> int:
    first, _, last = run.partition("-")
    return int(last) - int(first) + 1 if last else 1


class AlertDesk:
    """Decides which alerts to send; the sender delivers them."""

    def __init__(
        self,
        sender: WebhookSender,
        job: str,
        *,
        group_s: float,
        summary_over: int,
        rate_per_min: int,
        clock: Callable[[], float] = time.time,
    ):
        self.sender = sender
        self.job = job
        self.group_s = group_s
        self.summary_over = summary_over
        self.rate_per_min = rate_per_min
        self.clock = clock
        self.announced: dict[int, str] = {}  # rank -> verdict last announced
        # rank -> (health, reason, when it changed, verdict before), waiting for the group window.
        self._pending: dict[int, tuple[str, str, float, str | None]] = {}
        self._sent_at: collections.deque = collections.deque()  # verdict messages in the last minute
        self._keys: set[str] = set()
        self._held = False  # changes waited for the rate limit: the next message is a summary

    @property
    def enabled(self) -> bool:
        return self.sender.enabled

    def payload(self, event: str, text: str, **extra) -> dict:
        return {
            "event": event,
            "text": f"Rankwatch {self.job}: {text}",
            "job": self.job,
            "at": self.clock(),
            **extra,
        }

    # ------------------------------------------------------------------ verdicts
    def verdict(self, rank: int, health: str, reason: str, now: float) -> None:
        """Rank ``rank``'s verdict is now ``health``; queue an alert if that is news."""
        before = self.announced.get(rank)
        if health in ALERTING or (health == RECOVERED and before in ALERTING):
            if rank not in self._pending:
                self._pending[rank] = (health, reason, now, before)
            else:
                self._pending[rank] = (health, reason, self._pending[rank][2], before)
        else:
            # Neither news nor a recovery (exited, finished, pending, corrupt):
            # remembered, so a later verdict is compared with it.
            self._pending.pop(rank, None)
            self.announced[rank] = health

    def flush(self, now: float) -> int:
        """Send what waited long enough; returns the number of messages sent."""
        if not self._pending:
            return 0
        if now - min(p[2] for p in self._pending.values()) < self.group_s:
            return 0
        # A change back to what was last announced (a flap inside the window) is no news.
        changes = {r: p for r, p in self._pending.items() if p[0] != self.announced.get(r)}
        while self._sent_at and now - self._sent_at[0] >= 60.0:
            self._sent_at.popleft()
        budget = self.rate_per_min - len(self._sent_at)
        if not changes:
            self._pending.clear()
            return 0
        if budget <= 0:
            self._held = True
            return 0  # they wait, and go out as a summary when the minute allows
        self._pending.clear()
        for r, (health, _, _, _) in changes.items():
            self.announced[r] = health
        held, self._held = self._held, False
        if held or len(changes) > self.summary_over or len(changes) > budget:
            self._send_summary(changes)
            self._sent_at.append(now)
            return 1
        for r in sorted(changes):
            health, reason, _, before = changes[r]
            if health == RECOVERED:
                text = f"rank {r} is healthy again (was {before})"
            else:
                text = f"rank {r} {health}: {reason}"
            self.sender.send(
                self.payload(VERDICT_EVENT, text, rank=r, health=health, reason=reason, previous=before)
            )
            self._sent_at.append(now)
        return len(changes)

    def _send_summary(self, changes: dict[int, tuple]) -> None:
        by_health: dict[str, list[int]] = collections.defaultdict(list)
        for r, (health, _, _, _) in changes.items():
            by_health[health].append(r)
        order = [*ALERTING, RECOVERED]
        parts = [
            f"{len(by_health[h])} {h if h != RECOVERED else 'healthy again'} (rank"
            f"{'s' if len(by_health[h]) > 1 else ''} {ranks_text(by_health[h], NAMED)})"
            for h in order
            if by_health.get(h)
        ]
        n = len(changes)
        self.sender.send(
            self.payload(
                SUMMARY_EVENT,
                f"{n} ranks changed verdict: {'; '.join(parts)}",
                changes={h: sorted(rs) for h, rs in by_health.items()},
                count=n,
            )
        )

    # ------------------------------------------------------------------ one-off events
    def once(self, key: str, event: str, text: str, **extra) -> bool:
        """Send an event that must go out exactly once (a stop, a policy action); False if it did."""
        if key in self._keys or self.sender.was_sent(key):
            self._keys.add(key)
            return False
        self._keys.add(key)
        self.sender.send(self.payload(event, text, **extra), dedup_key=key)
        return True
