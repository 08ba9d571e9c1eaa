"""How often one client may try a token, and how often an operator may change state.

Both are keyed by the client's address (``request.remote_addr``): behind a
reverse proxy every client has the proxy's address, so there they limit the
proxy as a whole (README, "Security").

``Backoff``: after ``free`` wrong tokens in a row from one address, each
further attempt must wait twice as long as the last (1 s, 2 s, 4 s, ... up
to ``cap_s``); a right token clears the record. And whatever the address,
at most ``global_per_min`` failures a minute count in all: past them every
wrong attempt waits until the oldest is a minute old, so rotating source
addresses (all of 127.0.0.0/8 is this machine) gains nothing. The backoff
applies to failures only: a right token is accepted even while its address
or everyone waits (app/edge/auth.py checks it first), so nobody can lock the
operator out by guessing wrong.

``Bucket``: a token bucket per address for the writes an operator makes
(stop, cancel, re-arm, delete): ``per_minute`` in a burst, refilled at
``per_minute`` a minute, so a script with the token cannot fill the audit
trail without bound.

Both keep at most ``max_keys`` addresses (the least recently seen go first),
so a client with many addresses cannot grow them without bound.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable


class _Table:
    """A bounded LRU of per-key state."""

    def __init__(self, max_keys: int):
        self.max_keys = max_keys
        self.items: OrderedDict[str, list] = OrderedDict()

    def get(self, key: str, default: Callable[[], list]) -> list:
        item = self.items.get(key)
        if item is None:
            item = self.items[key] = default()
            while len(self.items) > self.max_keys:
                self.items.popitem(last=False)
        else:
            self.items.move_to_end(key)
        return item


class Backoff:
    """Exponential backoff on failed token checks, per client address, and a cap on failures in all."""

    def __init__(
        self,
        free: int = 5,
        base_s: float = 1.0,
        cap_s: float = 60.0,
        max_keys: int = 10_000,
        global_per_min: int = 20,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.free, self.base_s, self.cap_s, self.clock = free, base_s, cap_s, clock
        self.global_per_min = global_per_min
        self._table = _Table(max_keys)
        self._lock = threading.Lock()
        self._recent: deque[float] = deque()  # when the failures of the last minute were, oldest first

    def _global_wait(self, now: float) -> float:
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) < self.global_per_min:
            return 0.0
        return self._recent[0] + 60.0 - now

    def wait_s(self, key: str) -> float:
        """Seconds a failure from ``key`` must still wait (0: it may try now): its own backoff or everyone's."""
        with self._lock:
            now = self.clock()
            item = self._table.items.get(key)
            own = 0.0 if item is None else max(0.0, item[1] - now)
            return max(own, self._global_wait(now))

    def failed(self, key: str) -> bool:
        """Count a failure from ``key``; True if it filled the global allowance (time to tell someone)."""
        with self._lock:
            now = self.clock()
            item = self._table.get(key, lambda: [0, 0.0])  # [failures in a row, not before]
            item[0] += 1
            over = item[0] - self.free
            if over > 0:
                item[1] = now + min(self.cap_s, self.base_s * 2 ** min(over - 1, 32))
            self._global_wait(now)
            self._recent.append(now)
            return len(self._recent) == self.global_per_min

    def succeeded(self, key: str) -> None:
        with self._lock:
            self._table.items.pop(key, None)


class Bucket:
    """A token bucket per client address: ``per_minute`` at once, refilled at that rate."""

    def __init__(self, per_minute: int, max_keys: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self._table = _Table(max_keys)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Spend one token of ``key``; 0 if it had one, else the seconds until it will."""
        with self._lock:
            now = self.clock()
            item = self._table.get(key, lambda: [self.capacity, now])  # [tokens, as of]
            item[0] = min(self.capacity, item[0] + (now - item[1]) * self.rate)
            item[1] = now
            if item[0] >= 1.0:
                item[0] -= 1.0
                return 0.0
            return (1.0 - item[0]) / self.rate
