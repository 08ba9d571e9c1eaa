"""A copied run directory (``cp -a``) is an archived run, never "failed, 2 dead" (issue 33, section 4).

Its heartbeats name the original run's processes: alive on this host while the
original trains. The dashboard must not probe them, nor judge the copy by their
silence: ``job.json``'s ``dir_ino`` (``trainer_bridge.rundir.copies``) tells the copy
from the directory the job wrote.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.request

from tests.helpers.app import AUTH, TOKEN, make_app, wait_for
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import copies, runfiles

WORLD = 2


def api(url: str) -> dict:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())


def write_run(run, seq: int, now: float) -> None:
    """Rank 0 and 1 as a live job on this host writes them: the pid is this test's, which runs."""
    for rank in range(WORLD):
        write_heartbeat(run, heartbeat(rank, WORLD, seq=seq, now=now))


def test_a_copy_reads_copied_while_the_original_trains(tmp_path, start_server):
    root = tmp_path / "root"
    original, control, copy = root / "original", root / "control", root / "copy"
    now = time.time()
    for run in (original, control):
        runfiles.state_dir(run).mkdir(parents=True)
        write_job(run, WORLD, dir_ino=copies.dir_ino(run))  # as rank 0 writes it
        write_run(run, 1, now)
    # The copy as an operator makes it: the same bytes, times and pids, in a new directory.
    subprocess.run(["cp", "-a", str(original), str(copy)], check=True)
    assert copies.copied(copy, json.loads(runfiles.job_path(copy).read_text()))
    assert copies.copied(original, json.loads(runfiles.job_path(original).read_text())) is None

    stop = threading.Event()

    def train():
        seq = 2
        while not stop.wait(0.5):
            write_run(original, seq, time.time())
            seq += 1

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        server = start_server(
            root,
            tmp_path / "dashboard.log",
            runs_root=True,
            env={
                "RANKWATCH_TOKEN": TOKEN,
                "RANKWATCH_TICK_S": "0.2",
                "RANKWATCH_STALL_MIN_S": "2.5",
                "RANKWATCH_DEAD_AFTER_S": "4",
                "RANKWATCH_PROCESS_CHECK_AFTER_S": "1",
            },
        )

        def rows() -> dict[str, dict]:
            return {r["id"]: r for r in api(f"{server.url}/api/runs")["runs"]}

        # The control is the copy's twin, written in place: its heartbeats, as old, name the same
        # live pid. Once it reads failed, the copy has been judged past DEAD_AFTER_S too.
        wait_for(lambda: rows()["control"]["state"] == "failed", "the control run to read failed", 120)
        table = rows()
        assert table["control"]["health_counts"].get("dead") == WORLD and table["control"]["needs_attention"]

        got = table["copy"]
        assert got["state"] == "copied", got
        assert not got["needs_attention"]
        assert not {"dead", "failed", "stalled"} & set(got["health_counts"]), got["health_counts"]
        assert "is a copy" in got["status_message"] and "not this run's" in got["status_message"]

        # The original still reads live, the same pid and all.
        assert table["original"]["state"] == "training" and not table["original"]["needs_attention"]

        # The run page's own answers agree: ended, nothing to stop, no rank dead.
        summary = api(f"{server.url}/api/runs/copy/summary")
        assert summary["run"]["status"] == "ended" and summary["run"]["copied"] and summary["run"]["proven"]
        ranks = api(f"{server.url}/api/runs/copy/ranks")["ranks"]
        assert len(ranks) == WORLD and not {r["health"] for r in ranks} & {"dead", "stalled", "failed"}, ranks
        assert all("not this run's" in r["reason"] for r in ranks), [r["reason"] for r in ranks]
        assert api(f"{server.url}/api/runs/original/summary")["run"]["status"] == "running"

        # A launch into the copy rewrites job.json with the copy's own directory: a live run again.
        write_job(copy, WORLD, dir_ino=copies.dir_ino(copy))
        write_run(copy, 50, time.time())
        wait_for(lambda: rows()["copy"]["state"] == "training", "the relaunched copy to read training", 60)
    finally:
        stop.set()
        trainer.join()


def test_a_live_job_whose_state_directory_was_restored_under_it_is_no_copy(tmp_path):
    """RUN/rankwatch swapped for a copy of itself while the job runs: its inode is new, but the job
    writes on in it, and a heartbeat that advances says so; job.json's word alone would call it copied."""
    run = tmp_path / "run"
    runfiles.state_dir(run).mkdir(parents=True)
    write_job(run, WORLD, dir_ino=copies.dir_ino(run))
    write_run(run, 1, time.time())
    aside = tmp_path / "aside"
    runfiles.state_dir(run).rename(aside)
    subprocess.run(["cp", "-a", str(aside), str(runfiles.state_dir(run))], check=True)
    app = make_app(run)
    client = app.test_client()
    try:
        assert client.get("/api/summary", headers=AUTH).get_json()["run"].get("copied")
        write_run(run, 2, time.time())  # the job's next beats, into the directory at its path

        def live():
            run_status = client.get("/api/summary", headers=AUTH).get_json()["run"]
            return run_status if run_status["status"] == "running" else None

        assert not wait_for(live, "the run to read live again", 30).get("copied")
    finally:
        app.extensions["rankwatch"].watcher.stop()
