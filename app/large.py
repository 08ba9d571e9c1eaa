"""Answers that hold something per rank for a large job are built one at a time.

A ``/metrics`` with every rank, or ``/api/history``, of a 131,072-rank job
costs hundreds of megabytes while it is built; six at once took 1.44 GB.
Above ``LARGE_ANSWER_RANKS`` ranks such an answer takes the app's one slot
or is refused at once with a 503 and ``Retry-After`` (the time the last one
took), so the dashboard's memory holds one large answer whatever the number
of clients. Waiting for the slot instead would hold a server thread each.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from flask import current_app

from app.config import LARGE_JOB_RANKS
from app.errors import Busy

# 4,096 rows are a few megabytes, which any number of clients may have at once.
LARGE_ANSWER_RANKS = LARGE_JOB_RANKS


class LargeAnswers:
    """The slot for one large answer, and how long the last one took (the hint to retry)."""

    def __init__(self) -> None:
        self._slot = threading.Lock()
        self.last_s = 1.0

    @contextmanager
    def take(self, what: str) -> Iterator[None]:
        if not self._slot.acquire(blocking=False):
            raise Busy(f"{what}: another answer that large is being built; try again shortly", self.last_s)
        started = time.monotonic()
        try:
            yield
        finally:
            self.last_s = max(1.0, math.ceil(time.monotonic() - started))
            self._slot.release()


@contextmanager
def large_answer(ranks: int, what: str) -> Iterator[None]:
    """Hold the app's large-answer slot while building an answer with ``ranks`` rows, if that is many."""
    if ranks <= LARGE_ANSWER_RANKS:
        yield
        return
    # dict.setdefault is atomic: two first requests get the same slot.
    slot = current_app.extensions.setdefault("rankwatch_large_answers", LargeAnswers())
    with slot.take(what):
        yield
