"""Rank failures in real msrun jobs, watched by the real dashboard and a real browser.

* ``kill -9`` of one rank mid-training: the dashboard names it dead; the
  survivors do not wait silently (msrun SIGKILLs them); the newest complete
  checkpoint set survives and the next launch resumes from it.
* ``SIGSTOP`` of one rank: it is stalled (its process is stopped), its peers
  are stalled waiting for it; ``SIGCONT`` brings everything back, no restart.
* One rank slowed by 1.5x the step time: a straggler with the expected
  score; and across healthy runs no rank is ever flagged.

Durations are measured and reported (``tests.helpers.faults.measure``), never asserted.
"""

from __future__ import annotations

import os
import re
import signal
import statistics
import subprocess
import time

import psutil
import pytest
from playwright.sync_api import expect

from app.config import from_env
from app.run.state import RunState
from tests.helpers.faults import UI_TIMEOUT_MS, WAIT_S, cell, measure, poll_until
from tests.helpers.jobs import STOPPED_RANK_ENV, UNTIL_STOPPED, DemoJob, dump
from trainer_bridge.rundir import ckptindex

pytestmark = [pytest.mark.msrun]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def files_of(cset) -> dict[str, tuple[int, int]]:
    return {f.path: (os.stat(f.abspath).st_size, os.stat(f.abspath).st_mtime_ns) for f in cset.files}


# -- kill -9 ------------------------------------------------------------------------------


@pytest.mark.browser
def test_kill_9_one_rank_mid_training(tmp_path, page, start_job, start_dash):
    run = tmp_path / "run"
    run.mkdir()
    dash = start_dash(run, tmp_path / "dashboard.log")
    page.goto(dash.url)  # the page's Socket.IO client starts the watcher (auto re-arm)

    # 1. A complete set to fall back on: a graceful stop.
    first = start_job(run, epochs=UNTIL_STOPPED, step_delay=0.05)
    first.wait_for_step(3)
    status, body = dash.post("/api/exit", {"reason": "fault test: make a set"})
    assert status == 202, body
    assert first.wait() == 0, first.logs()
    index = ckptindex.scan(run, 2)
    saved = index.newest_complete
    assert saved is not None and saved.complete, dump(index.to_dict())
    saved_files = files_of(saved)

    # 2. Relaunch (it resumes from that set), then kill -9 rank 1 mid-training.
    second = start_job(run, epochs=UNTIL_STOPPED, step_delay=0.05)
    hbs = second.wait_until(
        lambda hbs: (
            hbs
            if all(h and h.get("resumed_from") and h["global_step"] >= saved.global_step + 3 for h in hbs)
            else None
        ),
        "the relaunched ranks to train",
    )
    pids = [h["pid"] for h in hbs]
    dash.wait_rows(
        lambda rows: all(rows[r]["pid"] == pids[r] and rows[r]["health"] == "healthy" for r in (0, 1)),
        "the dashboard to show the relaunch",
    )
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)

    # The dashboard names rank 1 dead (measured: the default PROCESS_CHECK_AFTER_S
    # is 3 s, so a probe finds the pid gone about 3 s after its last heartbeat).
    seen = {}

    def watch(rows):
        for r in (0, 1):
            seen.setdefault((r, rows[r]["health"]), (time.monotonic() - killed_at, rows[r]["reason"]))
        if gone(pids[0]) and "survivor_gone" not in seen:
            seen["survivor_gone"] = time.monotonic() - killed_at
        return rows if rows[1]["health"] == "dead" else None

    rows = dash.wait_rows(watch, "rank 1 to be shown dead", poll=0.05)
    measure("kill9.time_to_dead", time.monotonic() - killed_at)
    assert f"process {pids[1]} is gone" in rows[1]["reason"], rows[1]
    expect(cell(page, 1, "health")).to_contain_text("dead", timeout=UI_TIMEOUT_MS)
    expect(cell(page, 1, "reason")).to_contain_text(f"process {pids[1]} is gone")

    # The survivor does not wait silently: msrun SIGKILLs every other
    # worker as soon as one exits abnormally (it polls once a second).
    poll_until(lambda: gone(pids[0]), "msrun to end the surviving rank", timeout=WAIT_S)
    measure(
        "kill9.survivor_exit",
        seen.get("survivor_gone", time.monotonic() - killed_at),
        note="rank 0 killed by msrun",
    )
    rows = dash.wait_rows(
        lambda rows: rows if rows[0]["health"] == "dead" else None, "the survivor to be shown dead"
    )
    # Killed by msrun, maybe not reaped yet: "is gone" or "has exited".
    assert re.match(rf"process {pids[0]} (is gone|has exited)", rows[0]["reason"]), rows[0]
    expect(cell(page, 0, "health")).to_contain_text("dead", timeout=UI_TIMEOUT_MS)
    measure("kill9.survivor_shown_dead", time.monotonic() - killed_at)
    stalled = {k: v for k, v in seen.items() if isinstance(k, tuple) and k[1] == "stalled"}
    measure("kill9.survivor_shown_stalled_first", bool(stalled), unit="", detail=str(stalled))

    # 3. The newest complete set is intact and is still the newest complete one.
    index = ckptindex.scan(run, 2)
    assert index.newest_complete is not None and index.newest_complete.id == saved.id
    assert files_of(index.newest_complete) == saved_files
    assert all(f.ok for f in index.newest_complete.files)

    # 4. Relaunch: it resumes from that set, while msrun's launcher of the
    # killed job is still winding down (its scheduler times out the dead node).
    third = start_job(run, epochs=UNTIL_STOPPED, step_delay=0.0)
    resumed = third.wait_until(
        lambda hbs: (
            hbs
            if all(
                h and h["pid"] not in pids and h.get("resumed_from") and h["global_step"] > saved.global_step
                for h in hbs
            )
            else None
        ),
        "the third launch to resume",
    )
    assert all(h["resumed_from"]["global_step"] == saved.global_step for h in resumed), dump(resumed)
    poll_until(lambda: all(third.steps_logged(r) for r in (0, 1)), "the step logs")
    assert [third.steps_logged(r)[0] for r in (0, 1)] == [saved.global_step + 1] * 2
    dash.wait_rows(
        lambda rows: all(rows[r]["health"] == "healthy" and rows[r]["pid"] not in pids for r in (0, 1)),
        "the dashboard to show the new launch",
    )

    poll_until(lambda: second.proc.poll() is not None, "the killed job's msrun to exit")
    launcher_rc = second.proc.returncode
    measure("kill9.msrun_launcher_exit", time.monotonic() - killed_at, note=f"exit code {launcher_rc}")
    assert launcher_rc != 0
    status, body = dash.post("/api/exit", {"reason": "fault test: done"})
    assert status == 202, body
    assert third.wait() == 0, third.logs()


# -- kill -9 with no msrun to end the survivors -------------------------------------------


class UnsupervisedJob(DemoJob):
    """The demo job under ``msrun --join=False``: msrun starts the workers and leaves.

    Nothing then ends the survivors of a dead rank, as on the other nodes of
    a multi-node job: they block in the next collective until MindSpore's
    own cluster heartbeat gives up on the dead node.
    """

    def start(self) -> UnsupervisedJob:
        from trainer_bridge.demo.__main__ import free_port, job_env, msrun_command
        from trainer_bridge.demo.mnist import write_mnist

        self.run_dir.mkdir(parents=True, exist_ok=True)
        data = write_mnist(self.run_dir / "mnist", samples=2000)
        cmd = msrun_command(
            self.run_dir,
            self.ranks,
            [
                "--run-dir",
                str(self.run_dir),
                "--data-dir",
                str(data),
                "--epochs",
                "20",
                "--step-delay",
                "0.05",
                "--step-log",
            ],
            free_port(),
        )
        cmd = [c.replace("--join=True", "--join=False") for c in cmd]
        self._out = open(self.output_path, "ab")
        launcher = subprocess.run(
            cmd, stdout=self._out, stderr=subprocess.STDOUT, env=job_env(), timeout=WAIT_S
        )
        assert launcher.returncode == 0, self.logs()
        # The workers and the scheduler outlive the launcher: follow them by pid.
        self.procs = [
            p
            for p in psutil.process_iter(["cmdline"])
            if str(self.run_dir) in " ".join(p.info["cmdline"] or [])
        ]
        assert self.procs, "msrun started no process"
        self.proc = self  # DemoJob.wait_until polls self.proc.poll()
        return self

    def poll(self):
        return None if any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in self.procs) else 0

    def kill(self) -> None:
        for p in getattr(self, "procs", []):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        if getattr(self, "_out", None):
            self._out.close()


@pytest.mark.browser
def test_kill_9_one_rank_without_msrun_to_end_the_survivor(tmp_path, page, start_job, start_dash):
    run = tmp_path / "run"
    job = start_job(UnsupervisedJob(run))
    dash = start_dash(run, tmp_path / "dashboard.log")
    hbs = job.wait_for_step(3)
    pids = [h["pid"] for h in hbs]
    page.goto(dash.url)
    expect(cell(page, 1, "health")).to_contain_text("healthy", timeout=UI_TIMEOUT_MS)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)

    # The survivor is alive (heartbeats) but blocked: stalled, naming the dead peer.
    rows = dash.wait_rows(
        lambda rows: rows if rows[1]["health"] == "dead" and rows[0]["health"] == "stalled" else None,
        "rank 1 dead and rank 0 stalled",
    )
    measure("kill9_unsupervised.survivor_shown_stalled", time.monotonic() - killed_at)
    assert rows[0]["reason"].endswith(
        "rank 1 is dead: this rank is likely blocked in a collective with it"
    ), rows[0]
    expect(cell(page, 0, "reason")).to_contain_text("rank 1 is dead: this rank is likely blocked")
    expect(cell(page, 0, "health")).to_contain_text("stalled")

    # Nothing waits forever: MindSpore's cluster heartbeat fails the survivor.
    hb = job.wait_until(
        lambda hbs: hbs[0] if hbs[0]["state"] == "failed" else None,
        "the survivor to fail",
        timeout=WAIT_S,
    )
    measure(
        "kill9_unsupervised.survivor_failed",
        time.monotonic() - killed_at,
        error=hb["error"].splitlines()[0][:150],
    )
    assert hb["error"].startswith("RuntimeError: "), hb
    rows = dash.wait_rows(
        lambda rows: rows if rows[0]["health"] == "failed" else None, "the survivor shown failed"
    )
    assert rows[0]["reason"].startswith("failed: RuntimeError: "), rows[0]
    expect(cell(page, 0, "health")).to_contain_text("failed", timeout=UI_TIMEOUT_MS)
    # Its process takes a while longer to wind down (about 20 s here); not
    # waited for, so as not to spend the suite's time on it.
    measure(
        "kill9_unsupervised.survivor_process_gone_at_end",
        gone(pids[0]),
        unit="",
        after_s=round(time.monotonic() - killed_at, 1),
    )


# -- SIGSTOP / SIGCONT ------------------------------------------------------------------


@pytest.mark.browser
def test_sigstop_one_rank_then_sigcont(tmp_path, page, start_job, start_dash):
    run = tmp_path / "run"
    job = start_job(run, epochs=20, step_delay=0.05, env=STOPPED_RANK_ENV)
    dash = start_dash(run, tmp_path / "dashboard.log")
    hbs = job.wait_for_step(3)
    pids = [h["pid"] for h in hbs]
    page.goto(dash.url)
    for r in (0, 1):
        expect(cell(page, r, "health")).to_contain_text("healthy", timeout=UI_TIMEOUT_MS)
    pid1 = pids[1]
    stopped_at = time.monotonic()
    os.kill(pid1, signal.SIGSTOP)

    rows = dash.wait_rows(
        lambda rows: (
            rows
            if rows[1]["health"] == "stalled"
            and rows[0]["health"] == "stalled"
            and "rank 1 is stopped" in rows[0]["reason"]
            else None
        ),
        "rank 1 stalled (stopped) and rank 0 waiting for it",
        poll=0.1,
    )
    measure("sigstop.time_to_both_stalled", time.monotonic() - stopped_at)
    assert rows[1]["reason"].startswith(f"process {pid1} is stopped"), rows[1]
    assert "kill -CONT" in rows[1]["reason"]
    assert "blocked in a collective with it" in rows[0]["reason"], rows[0]
    # In the browser: both stalled, with the reasons.
    expect(cell(page, 1, "health")).to_contain_text("stalled", timeout=UI_TIMEOUT_MS)
    expect(cell(page, 1, "reason")).to_contain_text(f"process {pid1} is stopped")
    expect(cell(page, 0, "health")).to_contain_text("stalled", timeout=UI_TIMEOUT_MS)
    expect(cell(page, 0, "reason")).to_contain_text("rank 1 is stopped")
    step_before = max(h["global_step"] for h in job.heartbeats())

    continued_at = time.monotonic()
    os.kill(pid1, signal.SIGCONT)
    dash.wait_rows(
        lambda rows: (
            all(rows[r]["health"] == "healthy" for r in (0, 1))
            and min(rows[r]["global_step"] for r in (0, 1)) > step_before
        ),
        "both ranks healthy and stepping again",
    )
    measure("sigstop.time_to_healthy_after_sigcont", time.monotonic() - continued_at)
    for r in (0, 1):
        expect(cell(page, r, "health")).to_contain_text("healthy", timeout=UI_TIMEOUT_MS)
    # No restart: the same processes.
    assert [h["pid"] for h in job.heartbeats()] == pids
    assert job.proc.poll() is None


# -- stragglers --------------------------------------------------------------------------

HEALTHY_RUNS = 3
TICK_S = from_env({})["TICK_S"]


def sample_verdicts(jobs: list[DemoJob]) -> list[dict]:
    """Judge each job with the dashboard's own code every tick until all have ended.

    Returns per job the verdicts seen for ranks that were training, and the
    job's median work per step, as the dashboard computes them.
    """
    states = [RunState(job.run_dir, from_env({})) for job in jobs]
    results = [{"flagged": [], "samples": 0, "works": []} for _ in jobs]
    while any(job.proc.poll() is None for job in jobs):
        for job, state, out in zip(jobs, states, results, strict=True):
            now = time.time()
            state.scan(now)
            snap = state.snapshot(now)
            for row in snap["ranks"]:
                if row["state"] != "training":
                    continue
                out["samples"] += 1
                if row["health"] != "healthy":
                    out["flagged"].append(
                        (
                            job.run_dir.parent.name,
                            row["rank"],
                            row["global_step"],
                            row["health"],
                            row["reason"],
                        )
                    )
            slowest = snap["summary"]["slowest"]
            if slowest and slowest["basis"] == "work":
                out["works"].append(slowest["median_ms"])
        time.sleep(TICK_S)
    return results


@pytest.fixture(scope="module")
def healthy_runs(tmp_path_factory) -> list[dict]:
    """Short healthy 2-rank jobs, all at once (6 ranks on the 2 shared cores), judged every tick.

    Running them together keeps the suite short, and makes the false-positive
    check harder: the ranks of busy jobs are descheduled at random.
    """
    jobs = [
        DemoJob(tmp_path_factory.mktemp(f"healthy{i}") / "run", epochs=2, step_delay=0.0)
        for i in range(HEALTHY_RUNS)
    ]
    try:
        for job in jobs:
            job.start()
        results = sample_verdicts(jobs)
        for job in jobs:
            assert job.wait() == 0, job.logs()
    finally:
        for job in jobs:
            job.kill()
    return results


def test_healthy_runs_flag_no_rank(healthy_runs):
    samples = sum(r["samples"] for r in healthy_runs)
    flagged = [f for r in healthy_runs for f in r["flagged"]]
    measure(
        "straggler.healthy_samples",
        samples,
        unit="rank-ticks",
        runs=HEALTHY_RUNS,
        work_ms=[round(statistics.median(r["works"]), 1) for r in healthy_runs if r["works"]],
    )
    measure(
        "straggler.false_positives",
        len([f for f in flagged if f[2] == "straggler"]),
        unit="rank-ticks",
        flagged=flagged,
    )
    assert samples > 0
    assert not [f for f in flagged if f[2] == "straggler"], flagged
    assert not flagged, flagged  # no stall or death either in a healthy run


@pytest.mark.browser
def test_slowed_rank_is_a_straggler_with_its_score(tmp_path, page, start_job, start_dash):
    """Rank 1 sleeps 1.5 x the job's measured step time more per step, outside the step.

    The demo measures it: rank 1 takes the median wall step time of its steps
    3 to 12 (``--slow-factor 1.5 --slow-after 12``), then sleeps 1.5 times
    that per step. The dashboard must flag rank 1 and never rank 0.

    The expected score is normal work / slowed work. The slowed rank's work
    is the job's wall step time (the slowest rank never waits) and the normal
    work is that minus the injected delay, so the expectation comes from the
    wall time and the delay alone, not from the split the dashboard uses. It
    is below 1 / 2.5: once rank 1 sleeps, the two ranks no longer compute at
    the same moment, so each computes faster than before on the 2 shared
    cores, and the delay weighs more.
    """
    run = tmp_path / "run"
    # Far more epochs than the test needs: it kills the job when done, and on
    # a loaded machine the verdict must not race the job's natural end.
    job = start_job(
        run,
        epochs=50,
        step_delay=0.0,
        extra=["--slow-rank", "1", "--slow-factor", "1.5", "--slow-after", "12"],
    )
    dash = start_dash(run, tmp_path / "dashboard.log")
    job.wait_for_step(2)
    page.goto(dash.url)
    before = dash.wait(
        lambda body: (
            body["summary"]["slowest"]
            if body["summary"]["slowest"] and body["summary"]["slowest"]["basis"] == "work"
            else None
        ),
        "work figures for the healthy phase",
        path="/api/summary",
    )
    found = poll_until(
        lambda: re.search(r"sleeping ([\d.]+) ms more per step", job.worker_log(1)),
        "rank 1 to measure its step",
    )
    delay_ms = float(found.group(1))
    slowed_at = time.monotonic()
    measure("straggler.work_per_step_before_slowing", before["median_ms"], unit="ms")
    measure(
        "straggler.injected_delay",
        delay_ms,
        unit="ms",
        log=found.group(0),
        measured_by="rank 1 over its steps 3-12",
    )
    dash.wait_rows(lambda rows: rows[1]["health"] == "straggler", "rank 1 to be a straggler")
    measure("straggler.time_to_flag", time.monotonic() - slowed_at)
    # The score settles once the rank's window (STRAGGLER_WINDOW = 32 steps)
    # is mostly slowed steps: sample it from there.
    window = from_env({})["STRAGGLER_WINDOW"]
    job.wait_for_step(12 + window * 3 // 4)
    scores, reasons, walls = [], [], []
    for _ in range(10):  # a few ticks' worth of the verdict
        rows = dash.rows()
        assert rows[0]["health"] == "healthy", rows[0]
        if rows[1]["health"] == "straggler":
            scores.append(rows[1]["score"])
            reasons.append(rows[1]["reason"])
        walls += [h["step_time_mean_ms"] for h in job.heartbeats()]
        time.sleep(TICK_S)
    score = statistics.median(scores)
    wall_ms = statistics.median(walls)
    expected = (wall_ms - delay_ms) / wall_ms
    measure("straggler.score", score, unit="", expected=round(expected, 3), wall_ms=wall_ms, samples=scores)
    # The expectation assumes both ranks get the cores alike, and alike in
    # every phase: the delay is measured in the healthy phase and the walls
    # in the slowed one, so other work that starts or ends on the machine in
    # between moves it either way (a stress run ending mid-test gave 0.19
    # against scores of 0.39-0.44). So the bounds are loose; what they still
    # catch is a score computed from the wrong figures: from wall time it
    # would be about 1 (both ranks share the wall), above 1 / 1.5.
    assert 0.5 * expected <= score <= 1 / 1.5, (expected, scores, reasons)
    assert re.search(r"own work [\d.]+ ms vs the other ranks' median [\d.]+ ms", reasons[-1]), reasons[-1]
    expect(cell(page, 1, "health")).to_contain_text("straggler", timeout=UI_TIMEOUT_MS)
    expect(cell(page, 1, "reason")).to_contain_text("own work")
    expect(cell(page, 0, "health")).to_contain_text("healthy")
    summary = dash.get("/api/summary")["summary"]
    assert summary["slowest"]["rank"] == 1 and summary["slowest"]["basis"] == "work", summary
