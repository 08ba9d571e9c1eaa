"""A real 2-rank msrun job poisoned at global step K, watched in observe mode (issue 34).

The demo's hook (``RANKWATCH_DEMO_POISON_STEP``) makes the updates of steps
K..K+4 with a NaN learning rate, as bad batches there would: the weights are
NaN from K on, and every loss from K + 1 on; the live dashboard (defaults: ``SPIKE_MODE=observe``) must send
one ``loss_spike`` alert to a real receiver, mark the chart at K or after,
append an ``observed`` line naming the newest complete set before K, and stop
nothing: the job trains on to the end. Every wait polls with a deadline.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.helpers.app import FAST_SETTINGS, TOKEN
from tests.helpers.jobs import DEMO_BATCH, JOB_TIMEOUT_S
from trainer_bridge.demo.train import POISON_ENV
from trainer_bridge.rundir import rollbacks, runfiles

pytestmark = pytest.mark.msrun

K = 30
EVERY = 10  # a periodic checkpoint set every 10 steps: the set at 20 is the target


def get(server, path: str) -> dict:
    req = urllib.request.Request(server.url + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_poisoned_inputs_are_alerted_marked_and_observed_and_nothing_stops(
    run_dir, tmp_path, make_receiver, start_job, start_server
):
    receiver = make_receiver().start()
    env = {
        f"RANKWATCH_{k}": str(v)
        for k, v in {**FAST_SETTINGS, "TOKEN": TOKEN, "WEBHOOK_URL": receiver.url}.items()
    }
    server = start_server(run_dir, tmp_path / "dashboard.log", env=env)
    # 62 steps of 0.1 s at least: heartbeats (about one a second) sample the loss well after K.
    job = start_job(
        run_dir,
        epochs=1,
        samples=4000,
        batch=DEMO_BATCH,  # the loss itself is judged here: the demo's batch, not the noisier tests' one
        step_delay=0.1,
        extra=["--ckpt-every", str(EVERY), "--ckpt-keep", "10", "--activation", "tanh"],
        env={POISON_ENV: str(K)},
    )
    got = receiver.wait_for(lambda ps: [p for p in ps if p["event"] == "loss_spike"], "the loss_spike alert")
    alert = got[0]
    assert alert["rule"] == "nonfinite" and alert["value"] == "nan" and alert["step"] >= K, alert
    assert alert["mode"] == "observe" and alert["ranks"] == 2 and not alert["lone"], alert
    assert job.wait(JOB_TIMEOUT_S) == 0, job.logs()
    beats = job.heartbeats()
    # Nothing was stopped: both ranks trained to the end, their loss NaN in valid JSON.
    assert [h["state"] for h in beats] == ["finished", "finished"], beats
    assert [h["loss_nonfinite"] for h in beats] == ["nan", "nan"] and [h["loss"] for h in beats] == [
        None,
        None,
    ]
    flag = runfiles.read_flag(run_dir)
    assert flag is None or not flag.exit
    assert rollbacks.read_request(run_dir) == (None, None)
    body = get(server, "/api/spikes")
    marks = body["marks"]
    assert [(m["rule"], m["value"], m["acts"]) for m in marks] == [("nonfinite", "nan", True)], marks
    assert marks[0]["step"] == alert["step"] and "rank" in marks[0]["text"]
    # K as judged: the step after the last finite sample, at most the first NaN loss's step (K + 1).
    first = marks[0]["first_step"]
    assert first <= K + 1 <= marks[0]["step"], marks
    (line,) = body["rollbacks"]
    assert line["kind"] == "observed" and line["first_step"] == first
    # The newest complete set saved before the step before the first NaN loss (whose update made it),
    # from the real checkpoint index of the periodic sets; every set from K on holds NaN weights.
    assert line["target_step"] == (first - 2) // EVERY * EVERY, line
    assert line["target_step"] < K and "enforce would roll back" in line["note"]
    rows = get(server, "/api/ranks")["ranks"]
    assert [r["loss_nonfinite"] for r in rows] == ["nan", "nan"]
    assert len(receiver.events("loss_spike")) == 1
