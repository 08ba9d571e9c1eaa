"""Who runs the reporter's work: the training thread at its agreements, or the reporter's own thread.

A live Python thread costs MindSpore's functional steps about 2% at small
steps even when it never wakes (``docs/benchmarks.md``), so while steps
flow no reporter thread exists: the training thread calls
``Reporter.on_agreement()`` at each agreement step, where every rank is at
the same global step and waits for the others anyway, and it runs the
reporter's work there once a heartbeat is due. The thread runs only when
those agreements do not come: from the start to the first agreements (graph
compilation), and whenever they stop (a hang, an evaluation, a long save).
A one-shot timer (``wakeup.Wakeup``), re-armed at every agreement, starts it
again; the thread hands the work back once agreements arrive within a
heartbeat interval of each other. Without such a timer (not Linux with
glibc) the thread runs all the time.

A tick on the training thread slower than ``SLOW_TICK_S`` hands the work to
the thread for a while: a file system in trouble then holds only the thread.

The reporter hands this a ``Work`` at construction, and that is all either
sees of the other: the hand-over owns the thread, its loop and the tick lock;
the reporter owns what a tick does and when it is steady enough to leave to
the agreements.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer_bridge.wakeup import Wakeup

log = logging.getLogger("trainer_bridge")
# A tick on the training thread slower than this (a heartbeat takes about
# 0.3 ms) hands the reporter's work to its thread for SLOW_TICK_BACKOFF_S,
# doubled at each such tick up to an hour: a file system in trouble then
# holds only the thread, and a passing stall (another process's writeback
# throttling this one's writes, a loaded host) costs a minute of thread.
SLOW_TICK_S = 0.05
SLOW_TICK_BACKOFF_S = 60.0


@dataclass(frozen=True)
class Work:
    """What the reporter gives its hand-over (``Reporter.__init__``)."""

    tick: Callable[
        [float, float], None
    ]  # the reporter's work, once: (monotonic now, slack in s); never raises
    steady: Callable[[], bool]  # training, and nothing to do that must stay off the training thread
    closed: threading.Event  # set by the reporter's close(): no more ticks, the thread ends
    wake: threading.Event  # set to wake the thread before its poll interval (a stop stage, a hand-over)
    heartbeat_interval_s: float
    poll_interval_s: float


class HandOver:
    """The reporter's thread and the agreements that stand in for it, for one ``Work``."""

    def __init__(self, work: Work):
        self.work = work
        self._lock = threading.Lock()  # starting and handing over the thread
        self._tick_lock = threading.Lock()  # one tick at a time: the thread's or the training thread's
        self.thread: threading.Thread | None = None
        self.starts = 0
        self.wakeup: Wakeup | None = None
        self.agreed_at: float | None = None  # the last agreement (monotonic) and the gap before it
        self.agree_gap: float | None = None
        self.slow_ticks = 0
        self.no_handover_until = 0.0  # monotonic: after a slow tick (SLOW_TICK_S)

    def start(self) -> None:
        """The timer that starts the thread when agreements stop coming, and the thread until they come."""
        self.wakeup = Wakeup.create(self.wake_thread)
        self.wake_thread()

    def on_agreement(self, now: float) -> None:
        """The training thread, at an agreement step: do the reporter's work if it is due."""
        w = self.work
        if self.agreed_at is not None:
            self.agree_gap = now - self.agreed_at
        self.agreed_at = now
        wakeup = self.wakeup
        if wakeup is None or w.closed.is_set():
            return
        # Past this, heartbeats are late: the thread takes over.
        wakeup.arm(self.handover_s())
        if self.thread is not None:
            if self.may_hand_over(now):
                w.wake.set()  # the thread hands over now, not at its next wake-up
            return
        if not self._tick_lock.acquire(blocking=False):
            return
        try:
            # Due before the next agreement is due too: agreements a poll
            # interval apart or more then poll at every one, and a request
            # written before an agreement is voted there.
            w.tick(now, min(self.agree_gap or 0.0, w.poll_interval_s))
        finally:
            self._tick_lock.release()
        took = time.monotonic() - now
        if took > SLOW_TICK_S:
            # Its next stall would hold every rank at this agreement.
            backoff = min(SLOW_TICK_BACKOFF_S * 2**self.slow_ticks, 3600.0)
            self.slow_ticks += 1
            self.no_handover_until = time.monotonic() + backoff
            log.warning(
                "rankwatch: a heartbeat on the training thread took %.2f s: its thread does the work for %.0f s",
                took,
                backoff,
            )
            self.wake_thread()

    def handover_s(self) -> float:
        return 2.0 * max(self.work.heartbeat_interval_s, self.work.poll_interval_s)

    def wake_thread(self) -> None:
        """Start the thread unless it runs (from ``start()``, or the watchdog timer's own thread)."""
        with self._lock:
            if self.thread is not None or self.work.closed.is_set():
                return
            # daemon given: Thread() would otherwise ask current_thread(), which on the
            # timer's native thread leaves a _DummyThread behind for every expiry.
            self.thread = threading.Thread(target=self.run, name="rankwatch-reporter", daemon=True)
            self.thread.start()
            self.starts += 1

    def may_hand_over(self, now: float) -> bool:
        """Whether the agreements keep heartbeats on time: two of them within a heartbeat, the last recent."""
        w = self.work
        if self.wakeup is None or now < self.no_handover_until or not w.steady():
            return False
        gap, last = self.agree_gap, self.agreed_at
        return (
            gap is not None
            and last is not None
            and gap <= w.heartbeat_interval_s
            and now - last <= gap + w.poll_interval_s
        )

    def run(self) -> None:
        """The thread's body: a tick per poll interval (or wake-up) until closed or handed over."""
        w = self.work
        while not w.closed.is_set():
            with self._tick_lock:
                w.tick(time.monotonic(), 0.0)
            if self.hand_over():
                return
            w.wake.wait(w.poll_interval_s)
            w.wake.clear()

    def hand_over(self) -> bool:
        """The thread: give the work to the agreements if they keep heartbeats on time."""
        if not self.may_hand_over(time.monotonic()):
            return False
        with self._lock:
            if self.work.closed.is_set():
                return False
            self.thread = None
        # Armed again here too: if the agreements stopped right after the check above.
        self.wakeup.arm(self.handover_s())
        return True

    def stop(self) -> None:
        """At close (the reporter already closed): no more wake-ups, and the thread ended (5 s at most)."""
        if self.wakeup is not None:
            self.wakeup.close()
        with self._lock:
            thread = self.thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            thread.join(timeout=5)
