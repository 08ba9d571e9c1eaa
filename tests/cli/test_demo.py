"""The default demo, as ``make demo`` runs it: a real 2-rank msrun job and the dashboard.

What a newcomer must see: one line to open; a job planned to train for at
least 15 minutes; a loss that has visibly fallen (below 60% of its first
value); a complete checkpoint set while it runs; and, after a graceful
stop, a second run that resumes from the stop's set. Every wait polls with
a deadline.

The 15 minutes are checked from the job's plan, not by waiting: every
step sleeps ``--step-delay`` at least, so epochs x steps per epoch x the
delay is a floor on the job's length on any machine (the dataset's size is
read from the idx file the demo wrote, the rest from ``job.json``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers.app import wait_for
from tests.helpers.jobs import DemoJob, dump
from tests.helpers.liveserver import free_port
from tests.helpers.spikes import replay
from trainer_bridge.rundir import ckptindex, runfiles

pytestmark = pytest.mark.msrun

REPO = Path(__file__).resolve().parents[2]
MIN_PLANNED_S = 15 * 60
LOSS_FRACTION = 0.6
DEADLINE_S = 900


def first_loss(run: Path, rank: int) -> float | None:
    """The first loss the rank reported: the first line of its chart history."""
    path = runfiles.history_path(run, rank)
    if not path.exists():
        return None
    with open(path) as f:
        for line in f:
            loss = json.loads(line).get("loss")
            if loss is not None:
                return loss
    return None


def planned_s(run: Path) -> float:
    """The least the job can last: epochs x steps per epoch x ``--step-delay``, from its own files."""
    job = json.loads(runfiles.job_path(run).read_bytes())
    argv = job["argv"]

    def option(name: str) -> str:
        return argv[argv.index(name) + 1]

    # The idx header: magic, then the number of images (big-endian), as trainer_bridge/demo/mnist.py writes it.
    header = (Path(option("--data-dir")) / "train-images-idx3-ubyte").read_bytes()[:8]
    samples = int.from_bytes(header[4:8], "big")
    steps_per_epoch = -(-samples // job["world_size"]) // int(option("--batch-size"))
    return int(option("--epochs")) * steps_per_epoch * float(option("--step-delay"))


def demo_job(run: Path, port: int) -> DemoJob:
    job = DemoJob(run)
    # The demo with its defaults, exactly as make demo starts it (on a free port).
    job.cmd = [
        sys.executable,
        "-m",
        "trainer_bridge.demo",
        "--run-dir",
        str(run),
        "--dashboard",
        "--port",
        str(port),
    ]
    return job


def open_line(job: DemoJob, timeout: float = 300) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = job.output_path.read_text(errors="replace") if job.output_path.exists() else ""
        found = re.findall(r"^rankwatch demo: open (http://\S+)$", text, re.M)
        if found:
            assert len(found) == 1, text
            return found[0]
        assert job.proc.poll() is None, job.logs()
        time.sleep(0.2)
    raise AssertionError(f"the demo printed no URL to open\n{job.logs()}")


@pytest.mark.timeout(2 * DEADLINE_S + 300)
def test_the_default_demo_trains_learns_checkpoints_and_resumes(tmp_path, start_job):
    run = tmp_path / "demo"
    job = start_job(demo_job(run, free_port()))
    started = time.monotonic()
    url = open_line(job)
    with urllib.request.urlopen(url.split("#")[0], timeout=30) as r:
        assert r.status == 200
    # The printed URL carries a single-use login code, never the token: trade it as the page does.
    login = urllib.request.Request(
        url.split("#")[0] + "api/login",
        data=json.dumps({"code": url.split("#login=")[1]}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(login, timeout=30) as r:
        token = json.loads(r.read())["token"]

    def progress(hbs):
        first = [first_loss(run, r) for r in range(2)]
        losses = [h and h.get("loss") for h in hbs]
        learnt = None not in first and None not in losses and sum(losses) / 2 < LOSS_FRACTION * sum(first) / 2
        complete = [s for s in ckptindex.scan(run, 2).sets if s.complete]
        return (first, losses, complete) if learnt and complete else None

    first, losses, complete = job.wait_until(
        progress, "a falling loss and a complete set", timeout=DEADLINE_S
    )
    assert job.proc.poll() is None, "the demo ended"
    assert planned_s(run) >= MIN_PLANNED_S
    assert all(h["state"] == "training" for h in job.heartbeats()), dump(job.heartbeats())
    print(
        f"\ndemo after {time.monotonic() - started:.0f} s: loss {first} -> {losses}; "
        f"complete sets {[s.id for s in complete]}"
    )

    # Stop it gracefully, as the button does, then relaunch: it resumes from the stop's set.
    req = urllib.request.Request(
        url.split("#")[0] + "api/exit",
        data=json.dumps({"reason": "demo test"}).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 202
    stopped = job.wait_until(
        lambda hbs: hbs if all(h and h["state"] == "exited" for h in hbs) else None, "every rank exited"
    )
    stop_step = stopped[0]["stop"]["stop_step"]
    # The terminal says where a stop from the page stopped it, as it does after Ctrl-C.
    wait_for(
        lambda: (
            f"stopped gracefully at global step {stop_step}: every rank saved"
            in job.output_path.read_text(errors="replace")
        ),
        "the demo's line on where it stopped",
        timeout=120,
    )
    # No false alarm: the demo's own dashboard runs the loss-spike detector (SPIKE_MODE observe by
    # default) over the whole first run, and marked nothing (issue 34).
    with urllib.request.urlopen(url.split("#")[0] + "api/spikes", timeout=30) as r:
        spikes = json.loads(r.read())
    assert spikes["policy"]["mode"] == "observe" and spikes["marks"] == [], spikes

    # The demo keeps its dashboard up until Ctrl-C; the same command again trains under it.
    second = start_job(demo_job(run, free_port()))
    resumed = second.wait_until(
        lambda hbs: (
            hbs if all(h and h.get("resumed_from") and h["global_step"] > stop_step for h in hbs) else None
        ),
        "both ranks resumed and trained on",
        timeout=DEADLINE_S,
    )
    assert [h["resumed_from"]["global_step"] for h in resumed] == [stop_step, stop_step], dump(resumed)
    said = second.output_path.read_text(errors="replace")
    assert f"dashboard is up already: open {url.split('#')[0]}#login=" in said, said
    assert all(h["state"] == "training" for h in resumed), dump(resumed)
    # And over both runs, replayed from the history files with the defaults.
    found, judged = replay(run, 2)
    assert found == [] and judged >= 100, (found, judged)


def test_the_demo_says_what_it_does():
    out = subprocess.run(
        [sys.executable, "-m", "trainer_bridge.demo", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "--minutes" in out.stdout and "--ckpt-every" in out.stdout
