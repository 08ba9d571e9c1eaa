"""The loss-spike policy through the real watcher tick: alert, mark, audit, rollbacks.jsonl, stop (issue 34).

Heartbeats are written as the bridge writes them (tests/helpers/heartbeats.py);
the webhook receiver is a real HTTP server; the checkpoint set is a real
MindSpore save. The msrun test is tests/incidents/test_spikes_msrun.py.
"""

from __future__ import annotations

import math
import time

import pytest

from app.cli.status import spikes_text
from app.runs.rows import spike_facts
from tests.helpers.app import AUTH, make_app
from tests.helpers.checkpoints import save_bridge_set
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import rollbacks, runfiles


@pytest.fixture
def receiver(make_receiver):
    return make_receiver().start()


def spike_app(run_dir, receiver, **extra):
    """The dashboard with its webhooks going to ``receiver``."""
    return make_app(run_dir, WEBHOOK_URL=receiver.url, **extra)


def train(run_dir, app, steps, loss_at, t0):
    """Both ranks write a heartbeat every 5 global steps; the watcher ticks after each pair."""
    watcher = app.extensions["rankwatch"].watcher
    for i, step in enumerate(steps, start=1):
        for r in (0, 1):
            loss = loss_at(r, step)
            write_heartbeat(
                run_dir, heartbeat(r, 2, seq=i, global_step=step, now=t0 + i, loss=loss), history=False
            )
        watcher.clock = lambda i=i: t0 + i + 0.5
        watcher.tick()


def curve(r, step):
    return 2.3 / (1 + step / 200) * (1 + 0.05 * math.sin(step + r))


def test_observe_alerts_marks_and_records_what_enforce_would_do_and_stops_nothing(run_dir, receiver):
    write_job(run_dir, 2)
    save_bridge_set(run_dir, 150)
    save_bridge_set(run_dir, 200)  # saved after the first NaN step: not a target
    app = spike_app(run_dir, receiver)
    t0 = time.time()
    train(run_dir, app, range(5, 300, 5), lambda r, s: math.nan if s >= 200 else curve(r, s), t0)
    client = app.test_client()
    body = client.get("/api/spikes").get_json()
    assert body["policy"]["mode"] == "observe" and body["open"] == ["nonfinite"]
    (mark,) = body["marks"]
    assert (mark["rule"], mark["step"], mark["value"], mark["ranks"], mark["acts"]) == (
        "nonfinite",
        200,
        "nan",
        2,
        True,
    )
    (line,) = body["rollbacks"]
    # K is the step after the last finite sample (195); the set at 200 holds NaN weights: 150 is the target.
    assert line["kind"] == "observed" and line["first_step"] == 196 and line["target_step"] == 150
    assert line["skip_batches"] == 100 and "enforce would roll back to step 150" in line["note"]
    got = receiver.wait_for(lambda p: [x for x in p if x["event"] == "loss_spike"], "the spike alert")
    assert got[0]["rule"] == "nonfinite" and got[0]["step"] == 200 and got[0]["mode"] == "observe"
    # The rank table shows it as NaN, never blank: the row names it.
    rows = {r["rank"]: r for r in client.get("/api/ranks").get_json()["ranks"]}
    assert rows[0]["loss"] is None and rows[0]["loss_nonfinite"] == "nan"
    assert runfiles.read_flag(run_dir) is None or not runfiles.read_flag(run_dir).exit
    assert rollbacks.read_request(run_dir) == (None, None)
    audit = client.get("/api/audit", headers=AUTH).get_json()
    assert any(row["action"] == "spike" for row in audit["rows"])
    # The landing page's row: an unresolved NaN needs attention; rankwatch status says it.
    facts = spike_facts(app.extensions["rankwatch"].state)
    assert facts == {"spike_open": ["nonfinite"], "rollbacks": 0, "spike_stuck": False}
    said = spikes_text(run_dir)
    assert "1 observed" in said and "nonfinite from step 196" in said and "the set at step 150" in said
    app.extensions["rankwatch"].incidents.alerts.sender.close()


def test_enforce_requests_the_rollback_and_joins_a_pending_stop(run_dir, receiver):
    write_job(run_dir, 2)
    save_bridge_set(run_dir, 100)
    app = spike_app(run_dir, receiver, SPIKE_MODE="enforce", SPIKE_RECOVER_STEPS=30)
    client = app.test_client()
    # An operator's stop is already pending: the rollback joins it, no second stop.
    rid = client.post("/api/exit", json={"reason": "maintenance", "who": "alice"}, headers=AUTH).get_json()[
        "request_id"
    ]
    t0 = time.time()
    # The dead-ReLU case: the loss jumps to ln 5 at step 160 and stays.
    train(run_dir, app, range(5, 260, 5), lambda r, s: math.log(5) if s >= 160 else 0.3, t0)
    req, why = rollbacks.read_request(run_dir)
    assert why is None and req.rule == "divergence" and req.first_step == 156 and req.skip_batches == 100
    assert req.evidence.level == pytest.approx(0.3) and req.evidence.step >= 190
    lines, _ = rollbacks.read_lines(run_dir)
    assert [(ln.kind, ln.rule, ln.target_step) for ln in lines] == [("requested", "divergence", 100)]
    flag = runfiles.read_flag(run_dir)
    assert flag.exit and flag.request_id == rid  # the same stop
    body = client.get("/api/spikes").get_json()
    assert [m["rule"] for m in body["marks"]] == ["spike", "divergence"]
    assert "joined the pending stop" in body["recent"][-1]["outcome"]
    app.extensions["rankwatch"].incidents.alerts.sender.close()


def test_a_bad_override_is_ignored_and_off_runs_nothing(run_dir, receiver):
    write_job(run_dir, 2)
    runfiles.state_dir(run_dir).mkdir(parents=True, exist_ok=True)
    (runfiles.state_dir(run_dir) / "spikes.json").write_text('{"mode": "loud"}')
    app = spike_app(run_dir, receiver, SPIKE_MODE="off")
    body = app.test_client().get("/api/spikes").get_json()
    assert body["policy"]["mode"] == "off" and "spikes.json ignored" in body["policy"]["error"]
    train(run_dir, app, range(5, 100, 5), lambda r, s: math.nan if s >= 50 else 1.0, time.time())
    assert app.test_client().get("/api/spikes").get_json()["marks"] == []
    (runfiles.state_dir(run_dir) / "spikes.json").write_text('{"mode": "observe", "factor": 4}')
    app2 = spike_app(run_dir, receiver, SPIKE_MODE="off")
    assert app2.test_client().get("/api/spikes").get_json()["policy"]["factor"] == 4.0
    for a in (app, app2):
        a.extensions["rankwatch"].incidents.alerts.sender.close()
