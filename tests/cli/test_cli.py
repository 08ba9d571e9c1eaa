"""``rankwatch status``, ``stop`` and ``checkpoints`` on run directories in the bridge's format.

``status`` and ``checkpoints`` run in-process (click's runner); ``stop`` runs
as a real process (``python -m app.cli``) while the test plays the ranks:
it reads the flag and writes each stage into the heartbeats as the bridge
does. The real job is stopped by ``rankwatch stop`` in ``test_install.py``.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from app.audit import AuditLog
from app.cli import main
from app.run.verdicts import VERDICT_GLYPH
from tests.helpers.checkpoints import bridge_id, save_bridge_set
from tests.helpers.heartbeats import gone_pid, heartbeat, write_heartbeat, write_job
from tests.helpers.signals import ctrl_c_default
from trainer_bridge.rundir import runfiles

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60


def run_cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write_ranks(run: Path, world: int, **overrides) -> None:
    write_job(run, world)
    for r in range(world):
        write_heartbeat(run, heartbeat(r, world, global_step=40, **overrides))


def test_status_shows_every_rank_with_its_verdict_and_reason(run_dir):
    write_job(run_dir, 3)
    write_heartbeat(run_dir, heartbeat(0, 3, global_step=40))
    write_heartbeat(run_dir, heartbeat(1, 3, global_step=40))
    write_heartbeat(run_dir, heartbeat(2, 3, global_step=12, state="failed", error="RuntimeError: boom"))
    result = run_cli("status", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for rank, verdict in ((0, "healthy"), (1, "healthy"), (2, "failed")):
        row = next(ln for ln in lines if re.match(rf"\s*{rank}\s", ln))
        assert f"{VERDICT_GLYPH[verdict]} {verdict}" in row, result.output
    assert "RuntimeError: boom" in result.output
    assert "world size 3" in result.output

    only = run_cli("status", "--run-dir", str(run_dir), "--health", "failed")
    assert "boom" in only.output and "healthy  " not in only.output


def test_status_refuses_an_unknown_verdict(run_dir):
    result = CliRunner().invoke(main, ["status", "--run-dir", str(run_dir), "--health", "sleepy"])
    assert result.exit_code == 2 and "unknown verdict sleepy" in result.output


def test_checkpoints_lists_sets_and_the_resume_command(run_dir):
    write_job(run_dir, 2, argv=["train.py", "--epochs", "3"])
    save_bridge_set(run_dir, 16)
    save_bridge_set(run_dir, 24, ranks=(0,))  # incomplete: rank 1 never saved
    result = run_cli("checkpoints", "--run-dir", str(run_dir))
    assert result.exit_code == 0, result.output
    assert "2 checkpoint sets" in result.output and "1 complete" in result.output
    rows = {ln.split()[0]: ln for ln in result.output.splitlines() if ln.startswith("checkpoints/")}
    assert "yes" in rows[bridge_id(16)] and "★" in rows[bridge_id(16)]
    assert re.search(r"graceful stop\s+no\s+1\s", rows[bridge_id(24)]), rows[bridge_id(24)]
    assert f"Resume from {bridge_id(16)}" in result.output
    assert "msrun --worker_num=2 --local_worker_num=2 --join=True train.py --epochs 3" in result.output

    one = run_cli("checkpoints", "--run-dir", str(run_dir), "--set", bridge_id(24))
    assert "checkpoints/rank_0/rankwatch-3_8.ckpt" in one.output
    assert "this set is incomplete" in one.output

    unknown = CliRunner().invoke(main, ["checkpoints", "--run-dir", str(run_dir), "--set", "nope"])
    assert unknown.exit_code == 1 and "no checkpoint set 'nope'" in unknown.output


def test_stop_refuses_a_job_that_has_ended(run_dir):
    write_ranks(run_dir, 2, state="finished", pid=gone_pid())  # and its processes are gone
    result = CliRunner().invoke(main, ["stop", "--run-dir", str(run_dir), "--reason", "late"])
    assert result.exit_code == 1 and "nothing to stop: The job has ended" in result.output
    assert not runfiles.flag_path(run_dir).exists()


def play_ranks_through_the_stop(run: Path, world: int, proc: subprocess.Popen) -> str:
    """Act as the bridge: once the flag asks, move every rank through the stages to exited."""
    deadline = time.monotonic() + WAIT_S
    while True:
        flag = runfiles.read_json_or_none(runfiles.flag_path(run))
        if flag and flag.get("GracefulExit") == 1:
            break
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < deadline, "the CLI wrote no flag"
        time.sleep(0.05)
    rid, at, seq = flag["request_id"], {}, 2
    for stage in ("seen", "agreed", "saving", "saved", "exited"):
        at[stage] = time.time()
        for r in range(world):
            write_heartbeat(
                run,
                heartbeat(
                    r,
                    world,
                    seq=seq,
                    global_step=48,
                    state="exited" if stage == "exited" else "stopping",
                    stop={
                        "request_id": rid,
                        "source": "flag",
                        "stage": stage,
                        "seen_step": 41,
                        "stop_step": 48,
                        "checkpoint": {
                            "path": f"checkpoints/rank_{r}/rankwatch-1_48.ckpt",
                            "bytes": 1000,
                            "seconds": 0.01,
                        }
                        if stage in ("saved", "exited")
                        else None,
                        "at": dict(at),
                    },
                ),
            )
        seq += 1
        time.sleep(0.3)
    return rid


def test_stop_from_a_shell_waits_prints_each_stage_and_is_audited_like_the_button(run_dir, start_process):
    world = 2
    write_ranks(run_dir, world)
    proc = start_process(
        [
            sys.executable,
            "-m",
            "app.cli",
            "stop",
            "--run-dir",
            str(run_dir),
            "--reason",
            "ECC errors",
            "--who",
            "ops",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    rid = play_ranks_through_the_stop(run_dir, world, proc)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, out
    assert f"Stop requested: {rid} (by ops: 'ECC errors')" in out
    for r in range(world):
        told = [m.group(1) for m in re.finditer(rf"^rank\s+{r}\s+(\w+)", out, re.M)]
        assert told == ["requested", "seen", "agreed", "saving", "saved", "exited"], out
    assert "all 2 ranks stopped after step 48, 2 checkpoints" in out

    # One audit trail, as the button writes it: the request, then the
    # completion and the automatic re-arm (the CLI does the watcher's part).
    rows = list(reversed(AuditLog(runfiles.state_dir(run_dir) / "audit.sqlite3").rows()))
    assert [r["action"] for r in rows] == ["request", "complete", "rearm"], rows
    request = rows[0]
    assert (request["who"], request["reason"], request["outcome"]) == ("ops", "ECC errors", "accepted")
    assert request["remote_addr"].startswith("shell ")
    assert all(r["request_id"] == rid for r in rows)
    assert runfiles.read_json_or_none(runfiles.flag_path(run_dir))["GracefulExit"] == 0


def test_a_second_stop_joins_the_pending_request(run_dir):
    write_ranks(run_dir, 2)
    first = run_cli("stop", "--run-dir", str(run_dir), "--reason", "one", "--no-wait")
    second = run_cli("stop", "--run-dir", str(run_dir), "--reason", "two", "--no-wait")
    rid = runfiles.read_json_or_none(runfiles.flag_path(run_dir))["request_id"]
    assert f"Stop requested: {rid}" in first.output
    assert f"Stop already pending; joined: {rid}" in second.output
    outcomes = [r["outcome"] for r in AuditLog(runfiles.state_dir(run_dir) / "audit.sqlite3").rows()]
    assert outcomes == [f"duplicate: joined request {rid}", "accepted"]


def test_verdict_glyphs_match_the_page():
    js = (REPO / "static" / "js" / "format.js").read_text()
    page = dict(re.findall(r'(\w+): "(.)"', js[js.index("GLYPH") : js.index("});")]))
    assert page == VERDICT_GLYPH


def test_status_watch_follows_the_files_until_ctrl_c(run_dir, start_process):
    """In a terminal (a pty), --watch redraws as heartbeats change; Ctrl-C ends it with status 0."""
    write_ranks(run_dir, 2)
    master, slave = pty.openpty()
    proc = start_process(
        [
            sys.executable,
            "-m",
            "app.cli",
            "status",
            "--run-dir",
            str(run_dir),
            "--watch",
            "--interval",
            "0.2",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "TERM": "xterm", "COLUMNS": "200", "LINES": "40"},
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=ctrl_c_default,
    )
    os.close(slave)
    screen = b""

    def read_until(text: bytes) -> None:
        nonlocal screen
        deadline = time.monotonic() + WAIT_S
        while text not in screen:
            assert proc.poll() is None and time.monotonic() < deadline, screen.decode(errors="replace")
            if select.select([master], [], [], 0.2)[0]:
                screen += os.read(master, 65536)

    try:
        read_until(b"1/40")
        for r in range(2):
            write_heartbeat(run_dir, heartbeat(r, 2, seq=2, global_step=77))
        read_until(b"1/77")
        proc.send_signal(signal.SIGINT)
        # Keep reading: the frame --watch draws as it ends must not block on a full pty.
        deadline = time.monotonic() + WAIT_S
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    screen += os.read(master, 65536)
                except OSError:  # EIO once the process closed its side
                    break
        assert proc.wait(WAIT_S) == 0, screen.decode(errors="replace")[-2000:]
    finally:
        os.close(master)


def test_every_audit_row_reaches_open_pages(run_dir, sio):
    """A stop from a shell, and a second one that only joins it, are pushed as stop_status."""
    from tests.helpers.app import wait_for_event

    write_ranks(run_dir, 2)
    audit = AuditLog(runfiles.state_dir(run_dir) / "audit.sqlite3")
    run_cli("stop", "--run-dir", str(run_dir), "--reason", "one", "--no-wait")
    first = wait_for_event(sio, "stop_status", lambda s: s["audit_last_id"] == audit.last_id())
    assert first["state"] == "requested"
    # The join changes neither the flag nor any rank: only the trail.
    run_cli("stop", "--run-dir", str(run_dir), "--reason", "two", "--who", "bob", "--no-wait")
    second = wait_for_event(sio, "stop_status", lambda s: s["audit_last_id"] == audit.last_id())
    assert second["audit_last_id"] > first["audit_last_id"]
    assert audit.rows(limit=1)[0]["who"] == "bob"
