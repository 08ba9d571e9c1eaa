"""Telling a copied run directory from the one its job wrote (``trainer_bridge.rundir.copies``), on real files.

A launch into a copy of a live run is not refused for the original's ranks: they never train here.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

from tests.helpers.heartbeats import HOST, heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import copies, launchguard, runfiles


def live_run(run) -> None:
    """A job training in ``run`` now, as its rank 0 writes it: its pid is this test's, which runs."""
    runfiles.state_dir(run).mkdir(parents=True)
    write_job(run, 2, dir_ino=copies.dir_ino(run))
    for rank in range(2):
        write_heartbeat(run, heartbeat(rank, 2, now=time.time()))


def test_a_copy_is_told_and_its_launch_check_finds_nobody_alive(tmp_path):
    run = tmp_path / "run"
    live_run(run)
    for how, flag in (("copy", "-a"), ("hardlinks", "-al")):
        subprocess.run(["cp", flag, str(run), str(tmp_path / how)], check=True)
    assert copies.copied_dir(run) is None
    assert "is a copy" in copies.copied_dir(tmp_path / "copy")
    # cp -al shares job.json's inode, not the directory's.
    assert os.stat(runfiles.job_path(run)).st_ino == os.stat(runfiles.job_path(tmp_path / "hardlinks")).st_ino
    assert copies.copied_dir(tmp_path / "hardlinks")

    beats, live = launchguard.live_others(run, host=HOST, now=time.time())
    assert [r.rank for r in live] == [0, 1] and len(beats) == 2
    beats, live = launchguard.live_others(tmp_path / "copy", host=HOST, now=time.time(), watch_s=1.0)
    assert live == [] and len(beats) == 2  # the heartbeats are still read (the next start line seals them)

    # A moved run is still its own; a job.json without dir_ino (an older bridge) says nothing.
    os.rename(run, tmp_path / "moved")
    assert copies.copied_dir(tmp_path / "moved") is None
    write_job(tmp_path / "copy", 2)
    assert copies.copied_dir(tmp_path / "copy") is None
    assert [r.rank for r in launchguard.live_others(tmp_path / "copy", host=HOST, now=time.time())[1]] == [
        0,
        1,
    ]


def test_a_job_writing_on_in_a_restored_state_directory_still_refuses_a_second_launch(tmp_path):
    """rankwatch/ swapped for a copy of itself under a running job: a new inode, but the job writes on."""
    run = tmp_path / "run"
    live_run(run)
    runfiles.state_dir(run).rename(tmp_path / "aside")
    subprocess.run(["cp", "-a", str(tmp_path / "aside"), str(runfiles.state_dir(run))], check=True)
    assert copies.copied_dir(run)
    stop = threading.Event()

    def beat():  # the running job's reporter: a heartbeat a second
        seq = 2
        while not stop.wait(0.5):
            for rank in range(2):
                write_heartbeat(run, heartbeat(rank, 2, seq=seq, now=time.time()))
            seq += 1

    writer = threading.Thread(target=beat, daemon=True)
    writer.start()
    try:
        _, live = launchguard.live_others(run, host=HOST, now=time.time())
    finally:
        stop.set()
        writer.join()
    assert [r.rank for r in live] == [0, 1]
