"""``rankwatch launch`` without MindSpore: the command rewrite, the rules, the lock, the resume choice,
and the supervised lines as the reader, the API and ``rankwatch status`` show them.

The real jobs are in test_launch_msrun.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from app.checkpoints import finite
from app.cli import main
from app.supervise import command, lock, policy
from app.supervise.attempt import Attempt
from app.supervise.cause import describe
from app.supervise.procs import Proc
from tests.helpers import ckptcraft
from trainer_bridge.rundir import attempts, ckptindex, runfiles, schema

MSRUN = ["msrun", "--worker_num", "2", "--local_worker_num=2", "--master_port", "8118", "--join", "True"]


def test_join_is_forced_false_and_the_port_is_fresh_whatever_the_user_passed():
    cmd = command.parse([*MSRUN, "train.py", "--join", "True", "--lr", "0.1"])
    argv = cmd.argv(master_port=4242)
    assert argv[0] == "msrun" and argv.count("--join=False") == 1 and "--join=True" not in argv
    assert "--master_port=4242" in argv and "--master_port=8118" not in argv
    # The script's own arguments are its own, untouched.
    assert argv[-5:] == ["train.py", "--join", "True", "--lr", "0.1"]
    assert cmd.worker_num == 2 and cmd.single_node
    # Several nodes: every node must name the same port, so the user's stays.
    multi = command.parse(["msrun", "--worker_num=4", "--local_worker_num=2", "--master_port=9", "t.py"])
    assert not multi.single_node
    module = command.parse([sys.executable, "-m", command.MSRUN_MODULE, "--log_dir=L", "t.py"])
    assert module.log_dir == "L" and module.argv(None)[:3] == [sys.executable, "-m", command.MSRUN_MODULE]


@pytest.mark.parametrize(
    "argv", [[], ["python", "train.py"], ["msrun", "--worker_num"], ["msrun", "--worker_num", "2"]]
)
def test_anything_but_an_msrun_launch_is_refused(argv):
    with pytest.raises(command.NotMsrun):
        command.parse(argv)


def test_a_command_that_is_not_msrun_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["launch", "--run-dir", str(tmp_path), "--", "python", "t.py"])
    assert result.exit_code == 2 and "is not msrun" in result.output


def sup(n: int, cause: dict, **extra) -> dict:
    return {
        "kind": "supervised",
        "attempt": n,
        "supervisor_pid": 100,
        "host": "a",
        "spawned_at": 1.7e9 + n,
        "cause": cause,
        "action": "relaunch",
        **extra,
    }


CRASH = {"kind": "crash", "rank": 1, "role": "worker", "signal": "SIGKILL"}
EARLY = {"kind": "crash", "rank": 0, "role": "worker", "exit_code": 1, "error": "ImportError: x"}


def test_the_rules_count_from_the_records():
    h = policy.History.of(
        [
            sup(1, CRASH, restarted_by="launch", last_step=30, progressed=True),
            sup(2, CRASH, restarted_by="launch", last_step=25, progressed=False),
            sup(3, CRASH, restarted_by="launch", last_step=28, progressed=False),
        ]
    )
    assert (h.restarts, h.best_step, h.stalled, h.restart_streak) == (3, 30, 2, 3)
    assert policy.advanced(31, h.best_step) and not policy.advanced(30, h.best_step)
    assert (
        policy.backoff(5, 1) == 5
        and policy.backoff(5, 3) == 20
        and policy.backoff(5, 30) == policy.MAX_BACKOFF_S
    )
    # Startup: the same failure before step 1, twice in a row; another failure in between resets it.
    early = {**EARLY, "before_first_step": True}
    h = policy.History.of([sup(1, early, restarted_by="launch"), sup(2, early)])
    assert h.startup_streak[1] == 2
    h = policy.History.of([sup(1, early), sup(2, {**early, "error": "ImportError: y"})])
    assert h.startup_streak[1] == 1
    # A stop or a finish is not a failure: it counts toward nothing.
    h = policy.History.of([sup(1, {"kind": "stop"}, action="end")])
    assert (h.restarts, h.stalled) == (0, 0)


def test_describe_names_rank_signal_status_and_error():
    assert describe({**CRASH, "pid": 7, "host": "a"}) == "rank 1 (pid 7 on a) killed by SIGKILL"
    assert describe({**EARLY, "role": "scheduler"}) == "the scheduler exit status 1: ImportError: x"


def write(run_dir, lines) -> None:
    path = runfiles.attempts_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        for ln in lines:
            f.write(json.dumps(ln).encode() + b"\n")


def start(n: int, launch: str, **extra) -> dict:
    return {
        "kind": "start",
        "attempt": n,
        "launch": launch,
        "started_at": 1.7e9 + 10 * n,
        "world_size": 2,
        "hosts": ["a"],
        "first_step": 1,
    } | extra


def test_supervised_lines_join_their_attempts_and_make_rows_of_their_own(run_dir, client):
    crash = {**CRASH, "pid": 7, "host": "a"}
    times = dict(
        fault_at=1.7e9 + 15, detected_at=1.7e9 + 15.2, ended_at=1.7e9 + 20.2, relaunched_at=1.7e9 + 20.7
    )
    write(
        run_dir,
        [
            start(1, "aaa"),
            sup(1, crash, launch="aaa", restarted_by="launch", **times),
            # Attempt 2 died at import: no start line, only the supervisor's.
            sup(2, {**EARLY, "before_first_step": True}, world_size=2, first_step=21, ended_at=1.7e9 + 25),
            start(3, "ccc", started_at=1.7e9 + 31),
            # A supervised line naming another launch than the row's is not this attempt's.
            sup(3, crash, launch="zzz"),
        ],
    )
    rows = attempts.fold(attempts.read_lines(run_dir)[0])
    a, b, c = rows
    assert a["cause"]["signal"] == "SIGKILL" and a["restarted_by"] == "launch"
    # The next attempt has no bridge start line, so the relaunch-to-start part is not known.
    assert a["downtime"] == {
        "fault_to_detected_s": 0.2,
        "detected_to_ended_s": 5.0,
        "ended_to_relaunched_s": 0.5,
        "total_s": 5.7,
    }
    assert b["launch"] is None and b["end"] == "failed" and b["error"] == "ImportError: x"
    assert b["world_size"] == 2 and b["first_step"] == 21 and b["restarted_by"] is None
    assert c["cause"] is None
    body = client.get("/api/attempts").get_json()
    api = body["attempts"]
    assert [r["attempt"] for r in api] == [1, 2, 3] and api[0]["cause"]["rank"] == 1
    assert api[0]["downtime"]["total_s"] == 5.7 and api[1]["resumed_text"] == "a fresh start"
    # rankwatch status says the restarts and the last cause.
    result = CliRunner().invoke(main, ["status", "--run-dir", str(run_dir)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "3 attempt(s), 1 restarted by rankwatch launch" in said
    assert "rank 1 (pid 7 on a) killed by SIGKILL (fault to relaunch 5.7 s)" in said


def test_a_file_without_supervised_lines_reads_as_before(run_dir):
    write(run_dir, [start(1, "aaa"), {"kind": "end", "attempt": 1, "launch": "aaa", "end": "finished"}])
    (row,) = attempts.fold(attempts.read_lines(run_dir)[0])
    assert row["end"] == "finished" and row["cause"] is None and row["downtime"] is None


def test_a_supervised_line_is_validated(run_dir):
    with pytest.raises(schema.SchemaError):
        schema.validate(schema.AttemptSupervised, sup(1, {**CRASH, "exit_code": 999}))
    write(run_dir, [sup(1, {"kind": "exploded"})])
    records, skipped = attempts.read_lines(run_dir)
    assert records == [] and skipped == 1


def test_one_supervisor_per_run_directory(run_dir):
    fd = lock.acquire(str(run_dir))
    try:
        # Another process: flock is per open file, so a second open here would be refused as well.
        probe = subprocess.run(
            [sys.executable, "-c", f"from app.supervise import lock; lock.acquire({str(run_dir)!r})"],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert probe.returncode != 0 and f"(pid {os.getpid()} on" in probe.stderr
    finally:
        os.close(fd)
    os.close(lock.acquire(str(run_dir)))  # free again once the holder let go


def test_a_fifo_at_the_lock_is_refused_without_blocking(run_dir):
    path = run_dir / lock.LOCK_NAME
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.raises(lock.Held, match="cannot use the supervisor lock"):
        lock.acquire(str(run_dir))


def periodic(run_dir, step: int, ranks=(0, 1), name="net-1_{s}.ckpt", body=None) -> None:
    for r in ranks:
        data = (
            body
            if body is not None
            else ckptcraft.ckpt(
                ckptcraft.entry("w", ckptcraft.tensor([4], "Float32", b"\0" * 16)), global_step=step
            )
        )
        ckptcraft.write(run_dir / f"ckpt/rank_{r}" / name.format(s=step), data)


def test_resume_passes_over_incomplete_corrupt_and_unhealthy_sets(run_dir):
    periodic(run_dir, 10)
    periodic(run_dir, 20)
    periodic(run_dir, 30, ranks=(0,))  # incomplete
    periodic(run_dir, 40, ranks=(1,))
    periodic(run_dir, 40, ranks=(0,), body=b"\x93garbage")  # corrupt on rank 0
    # MindSpore's exception save: named by the step in progress, holding global step 50.
    periodic(run_dir, 50, name="net-1_51_breakpoint.ckpt", body=None)
    for r in (0, 1):
        (run_dir / f"ckpt/rank_{r}/net-1_51_breakpoint.ckpt").write_bytes(
            ckptcraft.ckpt(ckptcraft.entry("w", ckptcraft.tensor([4], "Float32", b"\0" * 16)), global_step=50)
        )
    choice = policy.choose_resume(str(run_dir), 2)
    assert choice.global_step == 20
    said = choice.note
    assert "breakpoint" in said and "incomplete" in said and "corrupt" in said
    # The bridge, pinned to a step held by a healthy and an unhealthy set, takes the healthy one.
    periodic(run_dir, 20, name="net-1_21_breakpoint.ckpt")
    index = ckptindex.scan(run_dir, world_size=2)
    from trainer_bridge.rundir import ckpthealth

    bad = ckpthealth.unhealthy(str(run_dir), index)
    picked = ckptindex.resume_set(index, 20, bad)
    assert picked.global_step == 20 and picked.id not in bad


def test_a_set_whose_weights_are_not_finite_is_passed_over(run_dir):
    import struct

    nan = struct.pack("<4f", 1.0, float("nan"), 2.0, 3.0)
    periodic(run_dir, 10)
    periodic(
        run_dir,
        20,
        ranks=(1,),
        body=ckptcraft.ckpt(ckptcraft.entry("fc.w", ckptcraft.tensor([4], "Float32", nan)), global_step=20),
    )
    periodic(run_dir, 20, ranks=(0,))
    choice = policy.choose_resume(str(run_dir), 2)
    assert choice.global_step == 10
    assert "not finite: ckpt/rank_1/net-1_20.ckpt: fc.w holds NaN or infinite values" in choice.note
    bf16_inf = struct.pack("<H", 0x7F80) * 4
    periodic(
        run_dir,
        30,
        body=ckptcraft.ckpt(
            ckptcraft.entry("w", ckptcraft.tensor([4], "BFloat16", bf16_inf)), global_step=30
        ),
    )
    assert policy.choose_resume(str(run_dir), 2).global_step == 10


def test_real_mindspore_files_with_nan_weights_are_caught(run_dir):
    """Files MindSpore itself wrote (with a CRC trailer too): a NaN in one weight, and a clean one."""
    import mindspore as ms
    import numpy as np

    from tests.helpers.checkpoints import Small

    net = Small()
    clean = run_dir / "clean.ckpt"
    ms.save_checkpoint(net, str(clean), crc_check=True)
    weight = net.fc2.weight.asnumpy().copy()
    weight[1, 2] = np.nan
    net.fc2.weight.set_data(ms.Tensor(weight))
    bad = run_dir / "bad.ckpt"
    ms.save_checkpoint(net, str(bad), crc_check=True)
    assert finite.nonfinite(clean) is None
    assert finite.nonfinite(bad) == "fc2.weight holds NaN or infinite values"


def test_at_one_step_the_bridge_set_is_named_as_the_bridge_will_load_it(run_dir):
    periodic(run_dir, 31)
    for r in (0, 1):
        ckptcraft.write(
            runfiles.checkpoint_path(run_dir, r, 1, 31),
            ckptcraft.ckpt(
                ckptcraft.entry("w", ckptcraft.tensor([4], "Float32", b"\0" * 16)), global_step=31
            ),
        )
    choice = policy.choose_resume(str(run_dir), 2)
    assert choice.global_step == 31 and choice.set_id.startswith("checkpoints/rank_{rank}/")


@pytest.mark.parametrize("role", ["msrun", "other"])
def test_a_process_without_a_log_of_its_own_fails_with_the_workers_error_line(tmp_path, role):
    # A script that fails at import: whether msrun, an unnamed child or a worker is seen to fail
    # first, the attempt's error is the workers' line, so the startup rule sees the same failure.
    logs = tmp_path / "logs"
    logs.mkdir()
    error = "ModuleNotFoundError: No module named 'rankwatch_no_such_module'"
    for r in (0, 1):
        (logs / f"worker_{r}.log").write_text(f"Traceback (most recent call last):\n  ...\n{error}\n")
    cmd = command.parse(["msrun", "--worker_num=2", "--local_worker_num=2", f"--log_dir={logs}", "s.py"])
    attempt = Attempt(cmd, {}, "mark", None, grace_s=1.0, poll_s=0.1, signals=None)
    assert attempt.crash_error(Proc(1, role, None, 0.0)) == error
    assert attempt.crash_error(Proc(2, "worker", 1, 0.0)) == error
    (logs / "worker_1.log").write_text("killed\n")
    assert attempt.crash_error(Proc(2, "worker", 1, 0.0)) is None  # a worker's own log, or nothing
