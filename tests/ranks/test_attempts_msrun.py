"""Attempts end to end, with real msrun jobs (2 ranks, CPU) in one run directory, in one sequence:

1. launch A; a second launch B in the same directory while A trains is refused, naming A's
   ranks, and A trains on;
2. stop A gracefully (a human's request), relaunch C: it resumes at S+1; stop C (the policy's
   request);
3. relaunch D pinned to A's older set (``RANKWATCH_RESUME_STEP``): it replays C's steps;
   kill it with SIGKILL;
4. ``attempts.jsonl`` holds three attempts, and the dashboard (API and page, in Chromium)
   shows them: two graceful stops told apart, the replayed range, and the kill; the stop
   panel of a dashboard started only now credits C's stop to attempt 2; the whole-run
   charts, seeded from the history files, start at A's first step, mark the three
   attempts and draw D's replay as a branch of its own, whose hover names it and why C ended;
   their x-axis, log-scale and smoothing controls change the plot.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.request

import pytest
from playwright.sync_api import expect

from app.run.heartbeats import read_history_tail
from tests.helpers.browser import serious
from tests.helpers.heartbeats import HOST
from tests.helpers.jobs import JOB_TIMEOUT_S, DemoJob, write_flag
from tests.helpers.liveserver import start_dashboard
from tests.helpers.signals import Terminal
from trainer_bridge.demo.__main__ import TRAIN_SCRIPT, free_port, job_env, msrun_command
from trainer_bridge.rundir import attempts, runfiles

pytestmark = [pytest.mark.msrun, pytest.mark.browser]

UI_TIMEOUT_MS = 120_000
SAMPLES = 500


def job(run, **kw) -> DemoJob:
    return DemoJob(run, epochs=50, samples=SAMPLES, step_delay=0.05, **kw)


def launches(j: DemoJob) -> set:
    return {hb.get("launch") for hb in j.heartbeats() if hb}


def rows(run) -> list[dict]:
    records, skipped = attempts.read_lines(run)
    assert skipped == 0
    return attempts.fold(records)


def refused_launch(run, tmp_path) -> tuple[int, str, str]:
    """msrun with the demo's worker in ``run`` while A trains; its logs elsewhere, so A's stay whole."""
    logs = tmp_path / "b_logs"
    data = run / "mnist"
    cmd = msrun_command(
        run,
        2,
        ["--run-dir", str(run), "--data-dir", str(data), "--epochs", "50", "--step-delay", "0.05"],
        free_port(),
        TRAIN_SCRIPT,
    )
    cmd = [f"--log_dir={logs}" if a.startswith("--log_dir=") else a for a in cmd]
    # On a terminal, as a person starts it: the refusal must reach it, not only the worker log.
    with Terminal() as tty:
        done = subprocess.run(
            cmd,
            env=job_env(),
            stdin=subprocess.DEVNULL,
            stdout=tty.slave,
            stderr=tty.slave,
            timeout=JOB_TIMEOUT_S,
        )
    return done.returncode, (logs / "worker_0.log").read_text(errors="replace"), tty.text()


# The page's Plotly figures, read back: each smoothed trace's attempt, branch flag and x values
# (the hover text is one per point; the first stands for all).
SERIES = """sel => { const el = document.querySelector(sel);
  return el && el.data ? el.data.filter(t => t.meta.kind === 'smoothed')
    .map(t => ({attempt: t.meta.attempt, branch: t.meta.branch, dash: t.line.dash, x: t.x, y: t.y,
                text: t.text[0], hover: t.hovertemplate})) : []; }"""
LAYOUT = """sel => { const l = document.querySelector(sel).layout;
  return {x: l.xaxis.type, y: l.yaxis.type, marks: l.shapes.map(m => m.x0), labels: l.annotations.map(a => a.text)}; }"""


def check_whole_run_charts(page, run, s: int, s2: int) -> None:
    """The loss chart over the whole run: A from its first reported step, C on from S+1, D a branch."""
    # A point is a step with a loss or a step time (a beat before the first step is none).
    lines = [p for r in range(2) for p in read_history_tail(run, r, 4096)]
    first = min(p[1] for p in lines if p[1] is not None and (p[2] is not None or p[3] is not None))
    page.wait_for_function(
        f"() => ({SERIES})('#chart-loss').length === 3",
        timeout=UI_TIMEOUT_MS,
    )
    a, c, d = page.evaluate(SERIES, "#chart-loss")
    assert [x["attempt"] for x in (a, c, d)] == [1, 2, 3]
    assert a["x"][0] == first and max(a["x"]) <= s and not a["branch"]
    assert min(c["x"]) > s and not c["branch"] and c["dash"] == "solid"
    # D trained S+1.. again: its own dashed trace, from a mark inside C's steps, neither dropped nor offset.
    assert d["branch"] and d["dash"] == "dash" and min(d["x"]) > s and s + 1 < max(c["x"]) <= s2
    # Hovering the branch says which attempt it is, what it replays, and why the one before it ended.
    assert "%{text}" in d["hover"]
    assert d["text"].startswith("attempt 3 · replays ") and f"resumed from global step {s}" in d["text"]
    assert d["text"].endswith("attempt 2 before it: stopped by the stop policy (request req-c)"), d["text"]
    layout = page.evaluate(LAYOUT, "#chart-loss")
    assert layout["x"] == "linear" and layout["y"] == "linear"
    # C and D both began at S+1: one mark for both.
    assert layout["marks"] == [1, s + 1] and layout["labels"] == ["attempt 1", "attempts 2, 3"]

    # x-axis: wall time, then back; log scale; smoothing off (the slider, by keyboard) draws the raw line.
    page.locator("#chart-x").select_option("time")
    page.wait_for_function("() => document.querySelector('#chart-loss').layout.xaxis.type === 'date'")
    page.locator("#chart-x").select_option("step")
    page.locator("#chart-log").check()
    page.wait_for_function(
        "() => { const l = document.querySelector('#chart-loss').layout;"
        " return l.xaxis.type === 'linear' && l.yaxis.type === 'log'; }"
    )
    smoothed = page.evaluate(SERIES, "#chart-loss")[0]["y"]
    raw = page.evaluate(
        "() => document.querySelector('#chart-loss').data.find(t => t.meta.kind === 'raw' && t.meta.attempt === 1).y"
    )
    assert len(raw) > 3 and smoothed != raw
    page.locator("#chart-smoothing").press("Home")
    page.wait_for_function(
        "() => { const d = document.querySelector('#chart-loss').data;"
        " const s = d.find(t => t.meta.kind === 'smoothed' && t.meta.attempt === 1).y;"
        " const r = d.find(t => t.meta.kind === 'raw' && t.meta.attempt === 1).y;"
        " return s.every((v, i) => v === r[i]); }"
    )
    expect(page.locator("#chart-smoothing-value")).to_have_text("0.00")


def test_attempts_refusal_resume_replay_kill(tmp_path, browser, console_errors, page):
    run = tmp_path / "run"

    # 1. A trains; B is refused and A trains on.
    a = job(run).start()
    c = d = server = None
    try:
        a.wait_for_step(3)
        beats = a.heartbeats()
        (launch_a,) = launches(a)
        pids_a = [hb["pid"] for hb in beats]
        code, said, terminal = refused_launch(run, tmp_path)
        assert code != 0
        assert "refusing to start: another launch of a job is training in" in said, said[-3000:]
        for r, pid in enumerate(pids_a):
            assert f"rank {r} (pid {pid} on {HOST}, heartbeat " in said
        assert "rankwatch: refusing to start: another launch of a job is training in" in terminal, terminal
        (turned_away,) = attempts.refused(attempts.read_lines(run, with_refused=True)[0])
        assert turned_away["world_size"] == 2 and turned_away["host"] == HOST, turned_away
        assert turned_away["reason"].startswith(
            "rankwatch: refusing to start: another launch of a job is "
            "training in this run directory: rank 0 (pid "
        ), turned_away
        past = max(hb["global_step"] for hb in a.heartbeats()) + 5
        a.wait_until(
            lambda hbs: all(h and h["global_step"] >= past and h["launch"] == launch_a for h in hbs),
            "A training on after the refused launch",
        )
        assert [hb["pid"] for hb in a.heartbeats()] == pids_a

        # 2. A human stops A; C resumes at S+1; the policy stops C.
        write_flag(run, "req-a", requested_by="alice", reason="test")
        assert a.wait() == 0, a.logs()
        s, _ = a.stopped_together()
        c = job(run).start()
        c.wait_until(
            lambda hbs: all(
                h and h.get("launch") not in (None, launch_a) and h["global_step"] >= s + 3 for h in hbs
            ),
            "C past S+3",
        )
        assert all(hb["resumed_from"]["global_step"] == s for hb in c.heartbeats())
        set_id = c.heartbeats()[0]["resumed_from"]["set"]
        assert set_id
        assert (
            f"rankwatch: attempt 2 of this run, resumed from global step {s} (set {set_id})"
            in c.worker_log(0)
        )
        assert all(c.steps_logged(r)[0] == s + 1 for r in range(2))
        write_flag(run, "req-c", requested_by="policy", reason="rule: stalled")
        assert c.wait() == 0, c.logs()
        s2, _ = c.stopped_together()
        assert s2 > s + 2

        # 3. D pinned to A's set replays S+1..S2; then it is killed.
        (launch_c,) = {hb["launch"] for hb in c.heartbeats()}
        d = job(run, env={runfiles.RESUME_STEP_ENV: str(s)}).start()
        d.wait_until(
            lambda hbs: all(
                h and h.get("launch") not in (None, launch_a, launch_c) and h["global_step"] >= s + 2
                for h in hbs
            ),
            "D past S+2",
        )
        (launch_d,) = launches(d)
        assert f"it trains global steps {s + 1}-{s2} again" in d.worker_log(0)
        d.kill()

        # 4. The file, then the dashboard.
        first, second, third = rows(run)
        assert [x["launch"] for x in (first, second, third)] == [launch_a, launch_c, launch_d]
        assert first["resumed_from"] is None and first["first_step"] == 1
        assert first["end"] == "graceful_stop" and first["request_id"] == "req-a"
        assert first["stop_by"] == "operator" and first["requested_by"] == "alice" and first["last_step"] == s
        assert first["hosts"] == [HOST] and first["world_size"] == 2
        assert second["resumed_from"] == {"set": set_id, "global_step": s} and second["first_step"] == s + 1
        assert second["replayed"] is None and second["previous_last_step"] == s
        assert (
            second["end"] == "graceful_stop" and second["stop_by"] == "policy" and second["last_step"] == s2
        )
        assert third["resumed_from"]["global_step"] == s and third["first_step"] == s + 1
        assert third["replayed"] == [s + 1, s2] and third["end"] is None

        server = start_dashboard(run, tmp_path / "dashboard.log", env={"RANKWATCH_TICK_S": "0.2"})
        deadline = time.monotonic() + 120
        while True:
            with urllib.request.urlopen(f"{server.url}/api/attempts") as r:
                body = json.load(r)
            if body["attempts"][-1]["end"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        last = body["attempts"][-1]
        assert last["end"] == "killed" and last["last_step"] >= s + 2 and last["inferred"], last
        with urllib.request.urlopen(f"{server.url}/api/ranks") as r:
            ranks = json.load(r)["ranks"]
        assert {row["resumed_from"] for row in ranks} == {f"resumed from global step {s} (set {set_id})"}

        page.goto(server.url)
        items = page.locator("#attempts-list li")
        expect(items).to_have_count(3, timeout=UI_TIMEOUT_MS)
        expect(
            page.locator("#attempts-list li[data-end='graceful_stop'][data-stop-by='operator']")
        ).to_contain_text("stopped by alice (request req-a)")
        expect(
            page.locator("#attempts-list li[data-end='graceful_stop'][data-stop-by='policy']")
        ).to_contain_text("stopped by the stop policy")
        killed = page.locator("#attempts-list li[data-end='killed']")
        expect(killed).to_contain_text(f"resumed from global step {s}")
        expect(killed).to_contain_text(f"trained global steps {s + 1}–{s2} again")
        expect(page.locator("#attempts-note")).to_contain_text(
            "A second launch into this run directory was refused at "
        )
        # The dashboard was not watching when C stopped for req-c: the stop is C's, not "not obeyed" by D.
        expect(page.locator("#stop-headline")).to_contain_text(
            "No stop requested. Last stop: completed", timeout=UI_TIMEOUT_MS
        )
        expect(page.locator("#stop-headline")).to_contain_text("by policy, attempt 2.")
        step_cell = page.locator("#rank-table tbody td[data-col='global_step']").first
        expect(step_cell).to_have_attribute("title", re.compile(f"resumed from global step {s} "))
        check_whole_run_charts(page, run, s, s2)
        page.screenshot(path=str(tmp_path / "attempts.png"), full_page=True)
        assert serious(page) == []
        assert console_errors == []
    finally:
        for j in (a, c, d):
            if j is not None:
                j.kill()
        if server is not None:
            server.stop()
