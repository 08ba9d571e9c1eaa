"""The log reader's patterns: each example line, real MindSpore output, garbage and torn lines.

Every pattern in ``app.run.logmode.patterns`` carries an example line; these
tests parse each one, then lines printed by MindSpore's own callbacks (run in
a subprocess), then what must not be mistaken for training: garbage, a line
written in two pieces, a traceback that training survived.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from app.run.logmode.parser import LauncherLog, SchedulerLog, WorkerLog
from app.run.logmode.patterns import BY_ROLE, LAUNCHER, SCHEDULER, WORKER


def all_patterns():
    return [(role, p) for role, patterns in BY_ROLE.items() for p in patterns]


@pytest.mark.parametrize(
    ("role", "pattern"), all_patterns(), ids=lambda x: x if isinstance(x, str) else x.kind
)
def test_every_pattern_matches_its_own_example_and_only_its_kind(role, pattern):
    m = pattern.match(pattern.example)
    assert m is not None, pattern.example
    # The first pattern of its file's list that matches is the one applied.
    first = next(p for p in BY_ROLE[role] if p.match(pattern.example))
    assert first.kind == pattern.kind
    assert pattern.origin


def fold(lines, cls=WorkerLog):
    log = cls()
    for line in lines:
        log.feed(line)
    return log


def test_loss_monitor_line():
    log = fold(["epoch: 1 step: 25, loss is 2.305208206176758"])
    assert (log.epoch, log.step, log.global_step, log.loss, log.state) == (
        1,
        25,
        25,
        2.305208206176758,
        "training",
    )


def test_functional_tutorial_line_counts_from_zero():
    log = fold(["epoch: 0, step: 10, loss is 2.2905269"])
    # The tutorial prints its 0-based loop counters after the step: epoch 1, step 11 done.
    assert (log.epoch, log.step, log.global_step, log.loss) == (1, 11, 11, 2.2905269)


def test_mindformers_line_gives_the_global_step_and_the_step_time():
    example = next(p for p in WORKER if p.needle == "Epoch:[").example
    log = fold([example])
    assert (log.epoch, log.step, log.spe, log.global_step) == (1, 5, 100, 5)
    assert (log.loss, log.step_ms) == (10.253, 1234.0)
    sink = (
        "2025-03-04 10:21:35,456 - mindformers[mindformers/core/callback/callback.py:553] - INFO - "
        "{ Epoch:[  2/  2], step:[   10/  100], loss: 9.871, per_step_time: 1180ms, overflow cond: False, "
        "loss_scale: 1.0, global_norm: [1.31]"
    )
    log.feed(sink)
    assert (log.epoch, log.step, log.global_step, log.loss, log.step_ms) == (2, 10, 110, 9.871, 1180.0)


def test_time_monitor_line_is_the_epochs_mean_step_time():
    log = fold(["Train epoch time: 8318.583 ms, per step time: 831.858 ms"])
    assert log.step_mean_ms == 831.858
    assert log.steps == 0 and log.state == "starting"
    log.feed("Train epoch time: 1000.000 ms, per step time: 10.000 ms (data time: 1.234 ms)")
    assert log.step_mean_ms == 10.0
    log.feed("Eval epoch time: 50.000 ms, per step time: 5.000 ms")
    assert log.step_mean_ms == 10.0  # evaluation is not a training step


def test_steps_per_epoch_are_learnt_when_every_step_is_printed_and_an_epoch_ends():
    log = fold([f"epoch: 1 step: {s}, loss is 2.3" for s in (1, 2, 3)] + ["epoch: 2 step: 1, loss is 2.2"])
    assert (log.spe, log.global_step) == (3, 4)
    # Printed every 10 steps: the last line of an epoch is not its length, so no global step.
    log = fold(
        ["epoch: 1 step: 10, loss is 2.3", "epoch: 1 step: 20, loss is 2.3", "epoch: 2 step: 10, loss is 2"]
    )
    assert (log.spe, log.epoch, log.step, log.global_step) == (None, 2, 10, None)


def test_a_traceback_fails_the_rank_with_its_exception_line():
    lines = textwrap.dedent(
        """\
        epoch: 1 step: 3, loss is 2.30
        Traceback (most recent call last):
          File "/job/train.py", line 223, in <module>
            main()
          File "/job/train.py", line 176, in main
            model.train(epochs, dataset)
        ValueError: In epoch: 1 step: 4, loss is NAN or INF, training process cannot continue, terminating training.
        """
    ).splitlines()
    log = fold(lines)
    assert log.state == "failed"
    assert log.error.startswith("ValueError: In epoch: 1 step: 4, loss is NAN")
    # The traceback's lines are not steps: the position stays at step 3.
    assert (log.step, log.steps) == (3, 1)


def test_chained_traceback_ends_at_the_last_exception():
    lines = [
        "Traceback (most recent call last):",
        '  File "a.py", line 1, in f',
        "KeyError: 'x'",
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        '  File "a.py", line 3, in g',
        "RuntimeError: The pointer[origin_node_output_addr] is null.",
    ]
    log = fold(lines)
    assert log.error == "RuntimeError: The pointer[origin_node_output_addr] is null."


def test_mindspore_error_lines_fail_the_rank_and_a_later_step_makes_them_a_warning():
    error = next(p for p in WORKER if p.kind == "error" and p.needle == "[ERROR] ").example
    log = fold(["epoch: 1 step: 1, loss is 2.3", error])
    assert (log.state, log.error) == ("failed", "There are 1 abnormal compute graph nodes.")
    log.feed("epoch: 1 step: 2, loss is 2.29")
    assert (log.state, log.error) == ("training", None)
    assert log.warnings[-1] == "survived: There are 1 abnormal compute graph nodes."


def test_mindspore_kill_line_says_why():
    line = next(p for p in WORKER if p.needle == "Kill this process with SIGTERM").example
    log = fold([line])
    assert log.state == "failed"
    assert log.error.startswith(
        "Kill this process with SIGTERM. (MindSpore ended this rank because its cluster failed"
    )


def test_on_request_exit_lines():
    triggered = next(p for p in WORKER if p.kind == "graceful_exit").example
    log = fold(["epoch: 1 step: 7, loss is 2.3", triggered])
    assert log.state == "stopping"
    assert log.on_request_exit == "Graceful exit is triggered, stop training."
    for p in WORKER:
        if p.kind == "on_request_exit":
            assert fold([p.example]).on_request_exit and fold([p.example]).state == "starting"


def test_pid_and_rank_from_mindspore_lines():
    log = fold([p.example for p in WORKER if p.kind in ("rank_id", "pid")])
    assert (log.pid, log.rank_id) == (10211, 1)
    python_logger = "[WARNING] ME(4242:140080786361216,MainProcess):2026-11-23-09:10:01.482.000 [x.py:1] hi"
    assert fold([python_logger]).pid == 4242


def test_garbage_and_near_misses_change_nothing():
    garbage = [
        "",
        "\x00\x00\x00\x00",
        "�" * 5000,
        "epoch: one step: two, loss is three",
        "epoch: 1 step: , loss is ",
        "loss is 2.3",
        "Epoch:[ 1/ 2] step",
        "per step time: fast",
        "[ERROR]",
        "Traceback",
        "epoch: 99999999999999999999 step: 1, loss is 2.3",  # more digits than any job
        "RuntimeErrors: are not this",
        "x" * 100000,
    ]
    log = fold(garbage)
    assert (log.state, log.epoch, log.step, log.loss, log.error, log.steps) == (
        "starting",
        None,
        None,
        None,
        None,
        0,
    )


def test_a_loss_that_is_not_a_number_is_none_and_nan_is_kept():
    assert fold(["epoch: 1 step: 1, loss is Tensor(shape=[2], dtype=Float32, value=[1, 2])"]).loss is None
    log = fold(["epoch: 1 step: 1, loss is nan"])
    assert log.loss != log.loss and log.step == 1  # NaN is news: the run diverged


def test_scheduler_log_world_hosts_and_fates():
    sched = fold([p.example for p in SCHEDULER], SchedulerLog)
    assert sched.world == 2 and sched.hosts == {0: "vm"}
    assert sched.timed_out == {
        0: "The node: 0 is timed out. It may exit with exception, please check this node's log."
    }
    assert sched.left == {0}


def test_launcher_log_names_the_worker_that_died_and_its_signal():
    launcher = fold([p.example for p in LAUNCHER], LauncherLog)
    assert launcher.ranks == {1: "worker_1.log"}
    assert launcher.exits == {
        10211: (-9, "Worker process 10211 exit with exception. Error code: -9 (killed by SIGKILL, signal 9)")
    }
    assert launcher.killed_all.startswith("msrun killed the remaining workers after: Worker process 10211")
    # A relaunch into the same file starts over.
    launcher.feed(LAUNCHER[0].example)
    assert launcher.exits == {} and launcher.killed_all is None


REAL_OUTPUT = textwrap.dedent(
    """\
    import numpy as np
    import mindspore as ms
    from mindspore import log as logger
    from mindspore.train import LossMonitor, TimeMonitor
    from mindspore.train.callback import RunContext

    class Params(dict):
        __getattr__ = dict.__getitem__

    params = Params(cur_epoch_num=1, cur_step_num=0, batch_num=3, dataset_sink_mode=False, mode="train")
    ctx = RunContext(params)
    loss_monitor, time_monitor = LossMonitor(), TimeMonitor()
    for epoch in (1, 2):
        params["cur_epoch_num"] = epoch
        time_monitor.epoch_begin(ctx)
        for _ in range(3):
            params["cur_step_num"] += 1
            params["net_outputs"] = ms.Tensor(np.float32(2.3 - 0.01 * params["cur_step_num"]))
            loss_monitor.step_end(ctx)
        time_monitor.epoch_end(ctx)
    logger.warning("Graceful exit is triggered, stop training.")
    """
)


def test_lines_printed_by_mindspores_own_callbacks():
    """LossMonitor, TimeMonitor and MindSpore's logger, run for real (MindSpore is installed)."""
    env = {**os.environ, "GLOG_v": "2"}
    out = subprocess.run(
        [sys.executable, "-c", REAL_OUTPUT], capture_output=True, text=True, timeout=300, env=env, check=True
    )
    lines = out.stdout.splitlines() + out.stderr.splitlines()
    assert "epoch: 2 step: 3, loss is" in out.stdout, out.stdout
    log = fold(lines)
    assert (log.epoch, log.step, log.spe, log.global_step) == (2, 3, 3, 6)
    assert abs(log.loss - 2.24) < 1e-6
    assert log.step_mean_ms is not None and log.step_mean_ms >= 0
    assert log.state == "stopping"
    assert log.pid is not None  # from the logger's "[WARNING] ME(pid:..." prefix


# ------------------------------------------------------------------ hostile lines (issue 19, item 9)


def test_every_pattern_runs_on_a_linear_time_engine():
    """RE2, not Python's backtracking re: a line built to be slow costs no more than its length."""
    import re2

    from app.run.logmode.patterns import EXCEPTION

    engines = {type(p.regex) for _, p in all_patterns()} | {type(EXCEPTION)}
    assert engines == {type(re2.compile("x"))}, engines


def test_adversarial_lines_parse_without_error_and_are_cut_at_max_line():
    from app.run.logmode.patterns import MAX_LINE
    from tests.bench.logpatterns import adversarial

    hostile = list(adversarial().values())
    for cls in (WorkerLog, SchedulerLog, LauncherLog):
        log = fold(hostile, cls)
        assert log is not None
    worker = fold(hostile)
    # Some are [ERROR] lines, read as such; what is kept stays bounded.
    assert worker.error is None or len(worker.error) <= 4000  # schema.MAX_ERROR

    # A line's head is read; what lies past MAX_LINE is never matched.
    step = "epoch: 1 step: 25, loss is 2.305208206176758"
    assert fold([step + " " * (64 * 1024)]).step == 25
    assert fold(["x" * MAX_LINE + step]).steps == 0
    tail = "x" * (MAX_LINE - len(step) - 1) + " " + step
    assert fold([tail]).step == 25
