"""Who runs the reporter: the agreements while they come, its thread while they do not.

A live Python thread costs MindSpore's functional steps about 2% at small
steps (``docs/benchmarks.md``), so the reporter hands its work to the
training thread's agreement steps and brings its thread back, through a
native one-shot timer (``trainer_bridge/wakeup.py``), when they stop. These
tests drive a real ``Reporter`` with agreements made by the test's own
thread, and assert on events: which threads exist, and heartbeats written.
The same with real MindSpore training is in ``test_bridge_unit.py``.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from tests.helpers.reporters import reporter as new_reporter
from trainer_bridge import handover
from trainer_bridge.reporter import Reporter
from trainer_bridge.rundir import runfiles
from trainer_bridge.wakeup import Wakeup

DEADLINE_S = 60.0  # a failure guard only: each wait ends on its event


def until(check, what: str, between=lambda: time.sleep(0.01)):
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        between()


def thread_alive() -> bool:
    return any(t.name == "rankwatch-reporter" and t.is_alive() for t in threading.enumerate())


def seq(run_dir) -> int:
    try:
        return runfiles.read_json(runfiles.heartbeat_path(run_dir, 0))["seq"]
    except (OSError, ValueError, KeyError):
        return -1


def cost(run_dir) -> dict:
    return runfiles.read_json(runfiles.heartbeat_path(run_dir, 0))["bridge_cost"]


@pytest.fixture
def reporter(tmp_path, monkeypatch):
    # A loaded host can make any heartbeat write slower than SLOW_TICK_S, which bars the
    # hand-over for a minute (the rule under test below, with a tick slowed on purpose).
    # Here that would test the host's disk, not an event: only a deliberate stall counts.
    monkeypatch.setattr(handover, "SLOW_TICK_S", 5.0)
    r = new_reporter(tmp_path, heartbeat_interval_s=0.25, poll_interval_s=0.05)
    yield r
    r.close()


def agree(r: Reporter) -> None:
    """One step and an agreement, as ``Engine.step_end`` makes them."""
    r.counters.global_step += 1
    r.counters.steps_total += 1
    r.counters.last_step_end = time.perf_counter()
    r.on_agreement()
    time.sleep(0.01)


def test_the_timer_calls_back_on_a_native_thread_once_and_never_after_close():
    fired, seen = threading.Event(), []

    def callback():
        seen.append(threading.get_native_id())
        fired.set()

    timer = Wakeup.create(callback)
    assert timer is not None, "this Linux has no SIGEV_THREAD timers"
    timer.arm(0.01)
    assert fired.wait(DEADLINE_S)
    assert seen[0] != threading.get_native_id()
    # Re-arming replaces the countdown; close drops an armed one.
    fired.clear()
    timer.arm(0.05)
    timer.close()
    timer.close()  # twice is fine
    later, other = threading.Event(), Wakeup.create(lambda: later.set())
    other.arm(0.2)  # armed after, due after: by the time it fires, the closed one would have
    assert later.wait(DEADLINE_S)
    other.close()
    assert not fired.is_set() and len(seen) == 1


def test_agreements_take_the_work_over_and_a_pause_brings_the_thread_back(reporter, tmp_path):
    reporter.start()
    reporter.state = "training"
    assert reporter.handover.thread is not None and thread_alive()  # until agreements come (compilation)

    # Agreements a heartbeat apart or closer: the thread hands the work over and ends.
    until(lambda: not thread_alive(), "the thread handing over", between=lambda: agree(reporter))
    before = seq(tmp_path)
    until(
        lambda: seq(tmp_path) >= before + 3 and not cost(tmp_path)["reporter_thread"],
        "heartbeats from the agreements",
        between=lambda: agree(reporter),
    )
    starts = cost(tmp_path)["reporter_thread_starts"]
    assert starts >= 1  # more if this machine held an agreement back past the hand-over time

    # A flag is seen at an agreement, with no thread.
    runfiles.write_flag(tmp_path, True, request_id="req-handover")
    until(lambda: reporter.request is not None, "the flag seen", between=lambda: agree(reporter))
    assert reporter.request.request_id == "req-handover"
    runfiles.write_flag(tmp_path, False)
    until(lambda: reporter.request is None, "the cancel seen", between=lambda: agree(reporter))

    # No agreement (a hang): the timer starts the thread, and heartbeats go on without steps.
    until(thread_alive, "the thread back after agreements stopped")
    before = seq(tmp_path)
    until(lambda: seq(tmp_path) >= before + 3, "heartbeats from the thread")
    assert cost(tmp_path)["reporter_thread"] is True
    assert cost(tmp_path)["reporter_thread_starts"] > starts

    # Agreements again: handed over again.
    until(lambda: not thread_alive(), "the second hand-over", between=lambda: agree(reporter))
    reporter.close()
    assert not thread_alive() and reporter.handover.wakeup._closed


def test_agreements_further_apart_than_a_heartbeat_leave_the_work_to_the_thread(reporter, tmp_path):
    reporter.start()
    reporter.state = "training"
    slow = 3 * reporter.heartbeat_interval_s

    def slow_agree():
        agree(reporter)
        time.sleep(slow)

    # Several agreements and, each time, the thread's own wake-ups: it stays.
    for _ in range(4):
        slow_agree()
        assert thread_alive()
    assert reporter.handover.starts == 1


def test_a_slow_tick_on_the_training_thread_gives_the_work_to_the_thread_for_a_while(
    reporter, tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(handover, "SLOW_TICK_S", 0.5)  # the stall below is twice that
    reporter.start()
    reporter.state = "training"
    until(lambda: not thread_alive(), "the thread handing over", between=lambda: agree(reporter))
    work = reporter.handover.work  # all the hand-over sees of the reporter
    tick = work.tick

    def slow_tick(now, slack):
        if threading.current_thread() is threading.main_thread():
            time.sleep(2 * handover.SLOW_TICK_S)  # a file system in trouble
        tick(now, slack)

    monkeypatch.setattr(reporter.handover, "work", dataclasses.replace(work, tick=slow_tick))
    reporter._next_beat = 0.0  # due at the next agreement
    agree(reporter)
    assert thread_alive() and "its thread does the work for 60 s" in caplog.text
    for _ in range(5):
        agree(reporter)  # no hand-over for a minute: agreements cost a clock read
    assert thread_alive() and reporter.handover.thread is not None
    # The minute over: handed back to the agreements (the next slow tick would bar it 120 s).
    monkeypatch.setattr(reporter.handover, "work", work)
    reporter.handover.no_handover_until = 0.0
    until(lambda: not thread_alive(), "the hand-over after the backoff", between=lambda: agree(reporter))
    assert reporter.handover.slow_ticks == 1
