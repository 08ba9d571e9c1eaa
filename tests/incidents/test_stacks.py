"""Stack captures without MindSpore: the capture itself, the request files, the stall rule, py-spy.

The bridge side (``trainer_bridge.stacks.StackWatcher``) runs here in the
test process, as a rank's reporter would; py-spy reads real child processes.
Waiting is by polling for files with a deadline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer_bridge import stacks
from trainer_bridge.rundir import pyspy, runfiles, schema, stackfiles

# "ready" is printed from inside hang_here, so a reader of that line knows where the main thread is.
HANGER = """
import sys, threading, time
def hang_here():
    print("ready", flush=True)
    while True:
        time.sleep(3600)
def side():
    time.sleep(3600)
threading.Thread(target=side, name="side-worker", daemon=True).start()
hang_here()
"""


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def hanger():
    """A real Python process stuck in ``hang_here``, with a second thread."""
    proc = subprocess.Popen([sys.executable, "-c", HANGER], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


def captures(run_dir: Path, rank: int) -> list[stackfiles.Capture]:
    return [stackfiles.load_capture(p) for p in stackfiles.capture_files(run_dir, rank)]


def blocked_in_here(event: threading.Event) -> None:
    event.wait()


# ------------------------------------------------------------------ the capture


def test_python_threads_names_each_thread_and_its_function(monkeypatch):
    # Earlier tests in the same process may leave threads behind: show them all.
    monkeypatch.setattr(stacks, "MAX_THREADS", 100_000)
    release = threading.Event()
    t = threading.Thread(target=blocked_in_here, args=(release,), name="side-worker")
    t.start()
    try:
        threads, omitted = stacks.python_threads(threading.get_ident())
    finally:
        release.set()
        t.join()
    assert omitted == 0 and len(threads) >= 2
    assert threads[0]["training"] and threads[0]["name"] == "MainThread"
    assert threads[0]["frames"][0]["function"] == "test_python_threads_names_each_thread_and_its_function"
    side = next(x for x in threads if x["name"] == "side-worker")
    assert side["id"] == t.native_id
    # Innermost first, with the source line: the thread waits in Event.wait called from blocked_in_here.
    names = [f["function"] for f in side["frames"]]
    assert names.index("blocked_in_here") > names.index("Event.wait")
    here = side["frames"][names.index("blocked_in_here")]
    assert here["code"] == "event.wait()" and here["file"] == __file__


def test_a_deep_stack_is_cut_to_its_innermost_frames():
    def dive(n):
        if n == 0:
            return stacks.python_threads(threading.get_ident())
        return dive(n - 1)

    threads, _ = dive(300)
    main = threads[0]
    assert len(main["frames"]) == stackfiles.MAX_FRAMES
    assert main["frames"][0]["function"].endswith("dive") and main["omitted"] > 240


def test_a_capture_never_exceeds_its_file_bound():
    frame = {"function": "f" * 300, "file": "/x" * 250, "line": 1, "code": "c" * 300}
    threads = [
        {"id": i, "name": f"t{i}", "training": i == 0, "frames": [frame] * 64, "omitted": 0, "native": []}
        for i in range(64)
    ]
    capture = stackfiles.build_capture(
        rank=3, captured_at=time.time(), source="bridge", trigger="request", threads=threads
    )
    assert len(capture.to_json()) <= stackfiles.MAX_CAPTURE_BYTES
    assert capture.threads[0].training and capture.threads_omitted > 0
    assert "more threads left out" in capture.text


def test_load_capture_refuses_oversized_and_invalid_files(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (stackfiles.MAX_CAPTURE_BYTES + 1))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rank": -1, "captured_at": 1.0, "source": "bridge", "trigger": "request"}))
    for path, words in ((big, "more than"), (bad, "rank")):
        with pytest.raises(schema.SchemaError, match=words):
            stackfiles.load_capture(path)


# ------------------------------------------------------------------ the bridge side


def test_watcher_answers_a_request_file_and_ignores_one_from_before_it_started(run_dir):
    old = stackfiles.Request(request_id="from-the-last-job", requested_at=1.0)
    stackfiles.write_request(run_dir, 0, old)
    watcher = stacks.StackWatcher(run_dir, 0, "host-a")
    facts = {"steps": 5, "since_step_s": 0.1, "step_s": 0.05, "global_step": 5, "stepping": True}
    watcher.poll(**facts)
    time.sleep(0.3)  # nothing may come; a negative cannot be polled for
    assert captures(run_dir, 0) == []

    stackfiles.write_request(run_dir, 0, stackfiles.Request(request_id="req-1", requested_at=time.time()))
    watcher.poll(**facts)
    got = wait_for(lambda: captures(run_dir, 0), "a capture answering req-1")
    capture = got[0]
    assert (capture.request_id, capture.trigger, capture.source) == ("req-1", "request", "bridge")
    assert (capture.rank, capture.host, capture.pid, capture.global_step) == (0, "host-a", os.getpid(), 5)
    assert capture.threads[0].training and capture.threads[0].name == "MainThread"
    assert "Thread" in capture.text and "test_watcher_answers_a_request_file" in capture.text
    # The same file again is no new request; the job-wide file is one.
    watcher.poll(**facts)
    stackfiles.write_request(run_dir, None, stackfiles.Request(request_id="all-1", requested_at=time.time()))
    watcher.poll(**facts)
    got = wait_for(lambda: len(captures(run_dir, 0)) == 2 and captures(run_dir, 0), "the job-wide request")
    assert got[0].request_id == "all-1"


def test_watcher_captures_once_per_stall(run_dir, monkeypatch):
    monkeypatch.setenv(stacks.STALL_ENV, "2")
    monkeypatch.setenv(stacks.NATIVE_ENV, "off")
    watcher = stacks.StackWatcher(run_dir, 1, "h")
    base = {"step_s": 0.1, "global_step": 40, "stepping": True}
    watcher.poll(steps=40, since_step_s=1.9, **base)  # under the limit
    watcher.poll(steps=40, since_step_s=2.1, stepping=False, step_s=0.1, global_step=40)  # saving
    watcher.poll(steps=40, since_step_s=2.1, **base)
    watcher.poll(steps=40, since_step_s=9.0, **base)  # the same stall: no second capture
    got = wait_for(lambda: captures(run_dir, 1), "the stall capture")
    assert [c.trigger for c in got] == ["stall"]
    assert got[0].since_step_s == 2.1 and got[0].native == "off"
    # A slow model's limit scales with its step time: 5 x 1 s.
    watcher.poll(steps=41, since_step_s=4.0, step_s=1.0, global_step=41, stepping=True)
    watcher.poll(steps=41, since_step_s=5.5, step_s=1.0, global_step=41, stepping=True)
    wait_for(lambda: len(captures(run_dir, 1)) == 2, "the second stall's capture")


def test_captures_are_bounded_per_trigger_so_a_stall_survives_a_burst_of_requests(run_dir, monkeypatch):
    monkeypatch.setenv(stacks.NATIVE_ENV, "off")
    watcher = stacks.StackWatcher(run_dir, 0)
    watcher.capture("stall", None, True, {})
    for i in range(stackfiles.KEEP_PER_TRIGGER + 3):
        time.sleep(0.002)  # names carry milliseconds
        watcher.capture("request", f"r{i}", False, {})
    got = captures(run_dir, 0)
    assert [c.trigger for c in got].count("request") == stackfiles.KEEP_PER_TRIGGER
    assert [c.trigger for c in got].count("stall") == 1
    assert got[0].request_id == f"r{stackfiles.KEEP_PER_TRIGGER + 2}"


def test_a_bad_request_file_or_an_unwritable_directory_never_raises(run_dir, caplog):
    watcher = stacks.StackWatcher(run_dir, 0)
    path = runfiles.stack_request_path(run_dir, 0)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x00garbage{")
    watcher.poll(steps=1, since_step_s=0.0, step_s=0.1, global_step=1, stepping=True)
    assert "ignoring unreadable stack request" in caplog.text
    # The captures' directory is a file: the capture is logged, not raised.
    runfiles.stack_captures_dir(run_dir, 0).write_text("not a directory")
    stackfiles.write_request(run_dir, 0, stackfiles.Request(request_id="r", requested_at=time.time()))
    watcher.poll(steps=1, since_step_s=0.0, step_s=0.1, global_step=1, stepping=True)
    wait_for(lambda: "cannot write a stack capture" in caplog.text, "the failure to be logged")


def test_a_bad_stall_setting_keeps_the_default(monkeypatch, caplog):
    monkeypatch.setenv(stacks.STALL_ENV, "soon")
    assert stacks.StackWatcher("/nonexistent", 0).stall_after_s == stacks.STALL_AFTER_S
    assert stacks.STALL_ENV in caplog.text


# ------------------------------------------------------------------ py-spy


def test_pyspy_reads_a_running_process_with_native_frames(hanger):
    threads, _ = pyspy.pyspy_threads(pyspy.pyspy_dump(hanger.pid, native=True), hanger.pid)
    main = threads[0]
    assert main["training"] and main["frames"][0]["function"] == "hang_here"
    assert main["native"], "native frames below hang_here (the sleep)"
    assert any(t["name"] == "side-worker" for t in threads)


def test_pyspy_reads_a_stopped_process(hanger):
    os.kill(hanger.pid, signal.SIGSTOP)
    threads, _ = pyspy.pyspy_threads(pyspy.pyspy_dump(hanger.pid, native=False), hanger.pid)
    assert threads[0]["frames"][0]["function"] == "hang_here"


def test_pyspy_says_why_it_cannot_read_a_process(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(pyspy.PySpyError, match=str(proc.pid)):
        pyspy.pyspy_dump(proc.pid, native=False)
    # No py-spy on PATH nor beside the interpreter.
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(sys, "executable", "/nonexistent/bin/python")
    with pytest.raises(pyspy.PySpyError, match="not installed"):
        pyspy.pyspy_dump(proc.pid, native=False)


def test_the_readme_documents_the_capture_file_as_the_schema_says():
    page = (Path(__file__).resolve().parents[2] / "docs" / "incidents.md").read_text(encoding="utf-8")
    assert schema.markdown_table(stackfiles.Capture) in page
