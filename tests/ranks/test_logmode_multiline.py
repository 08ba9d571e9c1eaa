"""MindSpore's multi-line errors: the message is on the lines below "TypeError: ".

``tests/data/ms_kernel_select_error.log`` is the tail of a real worker log:
2 ranks on CPU with ``MS_ENABLE_GRACEFUL_EXIT=1`` under msrun (graph compile
fails on the Int32 AllReduce that OnRequestExit's ``graceful_init`` needs),
with only the site-packages and job paths shortened.
"""

from __future__ import annotations

from pathlib import Path

from app.run.logmode.parser import JOB_EXITED, LauncherLog, WorkerLog

REAL = (Path(__file__).parents[1] / "data" / "ms_kernel_select_error.log").read_text().splitlines()


def fold(lines, cls=WorkerLog):
    log = cls()
    for line in lines:
        log.feed(line)
    return log


def test_the_message_below_an_empty_exception_line_is_the_reason():
    log = fold(REAL)
    assert log.state == "failed"
    assert log.error.startswith("TypeError: Kernel select failed: Select CPU operator[AllReduce] fail!"), (
        log.error
    )
    assert "but get input[Int32 ] and output[Int32 ]" in log.error
    # The call stacks "for framework developers" and the rules are left out.
    assert "Call Stack" not in log.error and "----" not in log.error and "In file" not in log.error


def test_the_message_ends_at_the_next_log_record():
    record = (
        "[ERROR] DISTRIBUTED(10208,7f2904429b80,python):2026-11-23-08:57:58.163.543 "
        "[mindspore/ccsrc/cluster/topology/meta_server_node.cc:95] Finalize] "
        "There are 1 abnormal compute graph nodes."
    )
    head = REAL[: REAL.index("Select CPU operator[AllReduce] fail! Unsupported data type!") + 1]
    log = fold([*head, record, "this line is not part of the message"])
    # The record is read as itself (an error line of its own), and nothing after it joins the message.
    assert log.error == "There are 1 abnormal compute graph nodes."
    log = fold([*head, "[INFO] ME(1:2,MainProcess):2026 [x.py:1] f] chatter", "not the message either"])
    assert (
        log.error
        == "TypeError: Kernel select failed: Select CPU operator[AllReduce] fail! Unsupported data type!"
    )


def test_a_message_below_is_bounded():
    log = fold(
        ["Traceback (most recent call last):", "  File 'x.py', line 1", "TypeError: "] + ["word"] * 10_000
    )
    assert log.error.startswith("TypeError: word word")
    assert log.error.count("word") <= 20


def test_an_exception_with_its_message_on_the_line_keeps_it():
    log = fold(
        ["Traceback (most recent call last):", "  File 'x.py', line 1", "ValueError: bad", "more text"]
    )
    assert log.error == "ValueError: bad"


def test_msruns_words_are_read_from_the_exception_not_the_source_line_above_it():
    """The traceback shows msrun's ``raise`` line first: the page said 'Please check logs in ".'."""
    launcher = fold(
        [
            "Traceback (most recent call last):",
            '  File "/venv/site-packages/mindspore/parallel/cluster/process_entity/_api.py", line 389, in join',
            '    raise RuntimeError("Distributed job exited with exception. Please check logs in "',
            "RuntimeError: Distributed job exited with exception. Please check logs in directory: /run/msrun_logs.",
        ],
        LauncherLog,
    )
    assert launcher.job_exited == (
        "Distributed job exited with exception. Please check logs in directory: /run/msrun_logs."
    )


def test_msruns_last_words_say_the_job_is_over():
    launcher = fold(
        [
            "Traceback (most recent call last):",
            '  File "/venv/site-packages/mindspore/parallel/cluster/process_entity/_api.py", line 389',
            "RuntimeError: Distributed job exited with exception. Please check logs in directory: /run/msrun_logs.",
        ],
        LauncherLog,
    )
    assert launcher.job_exited.startswith(JOB_EXITED)
