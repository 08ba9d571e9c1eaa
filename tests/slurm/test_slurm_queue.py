"""The landing page's Slurm column (RANKWATCH_SLURM): a queued run shows before its first heartbeat, with Slurm's reason."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import expect

from app.slurmqueue import SlurmQueue, parse
from tests.helpers.slurm import Slurm, demo_script

pytestmark = pytest.mark.browser


def test_a_held_job_shows_as_pending_with_its_reason(
    slurm: Slurm, tmp_path, start_server, page, console_errors
):
    root = tmp_path / "runs"
    run = root / "lenet"
    script = demo_script(tmp_path, run, ["--epochs", "1"])
    job = slurm.sbatch(script, "--hold", "-o", str(tmp_path / "job.out"))
    slurm.wait_job(job, lambda f: f.get("Reason") == "JobHeldUser", "held")

    # One squeue for every run, at most once per poll.
    queue = SlurmQueue(poll_s=3600.0, run=lambda: slurm.run(["squeue", "--json"]).stdout.encode())
    jobs = queue.by_run_dir()
    assert jobs[str(run)] == {
        "kind": "slurm",
        "job_id": job,
        "state": "PENDING",
        "reason": "JobHeldUser",
        "nodes": None,
        "partition": slurm.partition,
        "time_left_s": None,
        "restart_count": 0,
    }
    queue.by_run_dir()
    assert queue.calls == 1

    env = {"RANKWATCH_SLURM": "1", "RANKWATCH_SLURM_POLL_S": "0.5", "SLURM_CONF": str(slurm.conf)}
    server = start_server(root, tmp_path / "dashboard.log", env=env, runs_root=True)
    page.goto(server.url)
    row = page.locator("#runs-table tbody tr[data-run='lenet'][data-slurm='pending']")
    expect(row.locator("td[data-col='slurm']")).to_have_text(
        f"job {job}: pending (JobHeldUser)", timeout=60_000
    )
    expect(page.locator("#runs-slurm-head")).to_be_visible()

    # Released, it runs: the row says so, and on which node.
    slurm.run(["scontrol", "release", job])
    expect(row.locator("td[data-col='slurm']")).to_have_count(0, timeout=120_000)
    running = page.locator(
        "#runs-table tbody tr[data-run='lenet'][data-slurm='running'] td[data-col='slurm']"
    )
    expect(running).to_contain_text(f"job {job}: running on {slurm.node}", timeout=120_000)
    assert console_errors == []


def test_squeue_output_is_untrusted(tmp_path):
    base = {"job_state": "PENDING", "current_working_directory": "/w", "name": "a", "job_id": 1}
    body = {
        "jobs": [
            base,
            {**base, "job_id": 2, "name": "../../etc"},  # a name with a slash names no run
            {**base, "job_id": 3, "comment": "rankwatch:relative/path"},
            {**base, "job_id": 4, "job_state": "COMPLETED", "name": "done"},
            {**base, "job_id": 5, "comment": "rankwatch:/r/x", "state_reason": "Priority"},
            "not a job",
        ]
    }
    got = parse(json.dumps(body).encode(), now=0.0)
    assert sorted(got) == ["/r/x", "/w/runs/a"]
    assert got["/r/x"]["reason"] == "Priority"
    with pytest.raises(ValueError):
        parse(b"[]", now=0.0)
