"""Issue 32, P1: one forged write must not cancel a stop (a real msrun job, the real dashboard).

The attack, as the review ran it: rank 0's user rewrites each rank's
heartbeat once, with the same ``started_at``, ``seq`` + 1,000,000 and
``state: finished``, and appends msrun's "Distributed job exited with
exception" to a ``*.log`` in the log directory. Then the operator stops the
job. Before the fix the dashboard dropped every later real heartbeat as
"older", judged the job ended, called the stop ``not_obeyed`` and re-armed
it within a tick: the ranks trained on. Now the later heartbeats win (a
newer time), the rank is flagged as having a second writer, the ranks'
live processes contradict "finished", and the stop lands.

Every wait polls for an event; the timeouts are upper bounds only.
"""

from __future__ import annotations

import json
import re
import sqlite3
import time
import urllib.request

import pytest
from playwright.sync_api import expect

from app.run.jobend import StopInputs
from app.run.logmode.parser import JOB_EXITED
from tests.helpers.app import TOKEN, operator
from tests.helpers.browser import WAIT_MS
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.jobs import UNTIL_STOPPED, wait_for_job
from tests.helpers.liveserver import sign_in
from trainer_bridge.rundir import runfiles

FORGED_SEQ = 1_000_000


def api(server, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(
        server.url + path,
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"},
    )
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def forge_finished(run, ranks: int) -> None:
    """What the review's rank 0 wrote: every rank's heartbeat, once, 'finished' and far ahead in seq."""
    for r in range(ranks):
        hb = runfiles.read_json_or_none(runfiles.heartbeat_path(run, r))
        assert hb is not None
        forged = hb | {"seq": hb["seq"] + FORGED_SEQ, "state": "finished", "time": time.time()}
        runfiles.atomic_write_json(runfiles.heartbeat_path(run, r), forged)
    logs = run / "msrun_logs"
    logs.mkdir(exist_ok=True)
    with open(logs / "forged.log", "a") as f:
        f.write(f"[ERROR] ME(1:1,python):2026-11-28-08:00:00.000.000 [launcher] {JOB_EXITED}.\n")


@pytest.mark.msrun
def test_a_forged_finished_heartbeat_neither_locks_out_the_real_ones_nor_cancels_the_stop(
    tmp_path, start_job, start_server
):
    run = tmp_path / "run"
    job = start_job(run, epochs=UNTIL_STOPPED, step_delay=0.05)
    server = start_server(
        run,
        tmp_path / "dashboard.log",
        env={"RANKWATCH_TOKEN": TOKEN, "RANKWATCH_TICK_S": "0.2", "RANKWATCH_PROCESS_CHECK_AFTER_S": "1"},
    )
    job.wait_for_step(3)
    wait_for_job("both ranks training on the dashboard", lambda: _training(server), job)

    forge_finished(run, 2)
    assert api(server, "/api/exit", {"reason": "security: forged end"})["created"] is True

    # The real beats come at newer times, with lower seqs: they win, and say a second writer is there.
    def real_beats_back():
        # Before the fix the stop was called not obeyed within a tick: fail at once, not at the timeout.
        status = api(server, "/api/exit")
        assert status["state"] != "not_obeyed", status
        rs = api(server, "/api/ranks")["ranks"]
        back = all(any("a second writer" in w for w in r["warnings"]) and r["seq"] < FORGED_SEQ for r in rs)
        return rs if back else None

    rows = wait_for_job("the real heartbeats shown again, flagged as a second writer", real_beats_back, job)
    assert all(r["state"] != "finished" for r in rows), rows

    # The stop lands: every rank exits for it at one step, and the job ends by it.
    assert job.wait() == 0, job.logs()
    stop_step, _ = job.stopped_together()
    done = wait_for_job(
        "the stop's outcome",
        lambda: (s := api(server, "/api/exit"))["state"] in ("completed", "rearmed", "not_obeyed") and s,
        job,
    )
    assert done["state"] != "not_obeyed", done
    with sqlite3.connect(runfiles.state_dir(run) / "audit.sqlite3") as db:
        outcomes = [o for (o,) in db.execute("SELECT outcome FROM audit ORDER BY id")]
    assert not any("not obeyed" in (o or "") for o in outcomes), outcomes
    assert runfiles.read_flag(run).raw.get("outcome") is None


def _training(server):
    rows = api(server, "/api/ranks")["ranks"]
    return len(rows) == 2 and all(r["state"] == "training" for r in rows)


def test_files_alone_never_re_arm_a_stop_and_call_it_not_obeyed_only_after_the_minimum(client, app, run_dir):
    """Ranks on another host (nothing here can probe them) whose files say finished: the stop
    stays armed, the page warns, Stop stays usable, and "not obeyed" waits for the flag's minimum
    lifetime; even then the flag is not re-armed: the operator does that."""
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, global_step=40, host="node-b", pid=4242))
    rw = app.extensions["rankwatch"]
    rw.state.scan(time.time())
    assert client.post("/api/exit", json={"reason": "forged end"}, headers=operator()).status_code == 202
    for r in range(2):  # the forged write: finished, far ahead in seq
        write_heartbeat(run_dir, heartbeat(r, 2, seq=FORGED_SEQ, state="finished", host="node-b", pid=4242))
    now = time.time()
    rw.state.scan(now)
    run = rw.state.summary(now)["run"]
    assert run["status"] == "ended" and run["proven"] is False and "Stop stays usable" in run["message"]

    ranks, world = rw.state.heartbeats()
    facts = rw.state.job_facts()
    rw.stop.tick(now, StopInputs(ranks, world, facts=facts))
    status = rw.stop.status(now, StopInputs(ranks, world, facts=facts))
    assert status["state"] == "requested" and "looks ended by its files alone" in status["warning"], status
    assert runfiles.read_flag(run_dir).exit

    later = now + rw.stop.claims_min_s(ranks) + 1
    rw.stop.tick(later, StopInputs(ranks, world, facts=facts))
    status = rw.stop.status(later, StopInputs(ranks, world, facts=facts))
    assert status["state"] == "not_obeyed" and "by the run directory's word only" in status["summary"]
    flag = runfiles.read_flag(run_dir)
    assert flag.exit and flag.raw.get("outcome") is None  # still says stop: not re-armed
    actions = [r["action"] for r in rw.stop.audit.rows(limit=10)]
    assert actions == ["complete", "request"], actions


def test_a_live_process_contradicts_its_finished_file(client, app, run_dir):
    """This host's rank whose file says finished while its process runs: not ended, never not obeyed."""
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1, global_step=40))  # this test process is the rank
    rw = app.extensions["rankwatch"]
    rw.state.scan(time.time())
    assert client.post("/api/exit", json={"reason": "forged end"}, headers=operator()).status_code == 202
    write_heartbeat(run_dir, heartbeat(0, 1, seq=FORGED_SEQ, state="finished"))
    now = time.time()
    rw.state.scan(now)
    ranks, world = rw.state.heartbeats()
    facts = rw.state.job_facts()
    assert facts.running == {0}
    far = now + 10 * rw.stop.claims_min_s(ranks)
    rw.stop.tick(far, StopInputs(ranks, world, facts=facts))
    status = rw.stop.status(far, StopInputs(ranks, world, facts=facts))
    assert status["state"] == "requested" and "still runs on this host" in status["warning"], status
    assert runfiles.read_flag(run_dir).exit
    assert "still runs on this host" in rw.state.summary(now)["run"]["message"]


@pytest.mark.browser
@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN}], indirect=True)
def test_the_stop_button_stays_usable_with_a_warning_while_only_files_say_the_job_ended(
    live_server, page, run_dir
):
    write_job(run_dir, 2)
    for r in range(2):  # this test process is each rank's: it runs while the files say finished
        write_heartbeat(run_dir, heartbeat(r, 2, seq=FORGED_SEQ, state="finished"))
    sign_in(page, live_server.url, TOKEN)
    expect(page.locator("#state-pill")).to_have_attribute("data-state", "ended", timeout=WAIT_MS)
    stop = page.locator("#stop-open")
    expect(stop).to_be_enabled(timeout=WAIT_MS)
    expect(stop).to_have_attribute(
        "title", re.compile(r"^Warning: The job has ended: 2 finished\. But the process")
    )
