"""The hang rule's decision (``app.supervise.hang``) on a real ``RunState`` over heartbeat files.

The msrun test (``test_launch_msrun.py``) ends a real hung rank's attempt; here the dry run and the
timing of the decision are checked, with the clock handed in.
"""

from __future__ import annotations

import os

from app.compose import build
from app.config import from_env
from app.supervise.hang import HangWatch
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import stackfiles

T = 1.8e9


def watch(run_dir, mode: str, said: list[str], clock) -> HangWatch:
    config = {**from_env({}), **FAST_SETTINGS}
    return HangWatch(
        str(run_dir),
        5.0,
        mode,
        said.append,
        open_state=lambda: build(str(run_dir), {**config, "RUN_DIR": str(run_dir)}, live=False).state,
        clock=clock,
    )


def beat(run_dir, now: float) -> None:
    # Rank 0 trains; rank 1's reporter beats but its last step was 60 s ago: stalled ("no step finished").
    write_heartbeat(run_dir, heartbeat(0, 2, now=now, seq=int(now - T) + 2), history=False)
    write_heartbeat(run_dir, heartbeat(1, 2, now=now, global_step=40, last_step_at=T - 60), history=False)


def test_a_dry_run_says_once_what_it_would_do_and_restart_mode_ends_the_attempt(run_dir):
    write_job(run_dir, 2)
    now = [T]
    said: list[str] = []
    dry = watch(run_dir, "dry-run", said, lambda: now[0])
    real = watch(run_dir, "restart", [], lambda: now[0])
    me = {os.getpid()}
    for t in (T, T + 2.0, T + 4.0):
        now[0] = t
        beat(run_dir, t)
        assert dry.check(me) is None and real.check(me) is None
    assert said == []  # stalled for 4 s of the 5 the rule waits
    now[0] = T + 5.5
    beat(run_dir, now[0])
    assert dry.check(me) is None
    (line,) = said
    assert line.startswith("hang rule (dry run): rank 1 stalled for over 5 s: no step finished")
    assert "no stack capture" in line and "with --hang-mode restart the attempt would end now" in line
    hang = real.check(me)
    assert (hang.rank, hang.pid, hang.since) == (1, os.getpid(), T)
    # Said once per stall, not at every look.
    now[0] = T + 7.0
    beat(run_dir, now[0])
    assert dry.check(me) is None and len(said) == 1
    # A rank that is not one of this attempt's workers is never a hang of it.
    assert watch(run_dir, "restart", [], lambda: now[0]).check({1}) is None


def test_the_hang_names_the_newest_stack_capture_of_the_rank(run_dir):
    write_job(run_dir, 2)
    for ms in (1000, 3000, 2000):
        stackfiles.write_capture(
            run_dir,
            stackfiles.build_capture(
                rank=1, trigger="stall", captured_at=ms / 1000, source="bridge", pid=os.getpid(), threads=[]
            ),
        )
    now = [T]
    real = watch(run_dir, "restart", [], lambda: now[0])
    beat(run_dir, T)
    assert real.check({os.getpid()}) is None
    now[0] = T + 6.0
    beat(run_dir, now[0])
    hang = real.check({os.getpid()})
    assert hang.capture == "rankwatch/stacks/rank_1/00000000003000-stall.json", hang.capture
    assert hang.text(5.0).endswith("; stack capture rankwatch/stacks/rank_1/00000000003000-stall.json")
