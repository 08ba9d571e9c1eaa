"""The stop policy on a real stop service, audit trail and flag file, with the clock in the test's hands.

The end-to-end check (a fake ``npu-smi`` in a real msrun job) is in
``tests/incidents/test_incidents_msrun.py``; these pin the rules' semantics.
"""

from __future__ import annotations

import pytest

from app import create_app
from app.audit import AuditLog
from app.incidents.alerts import AlertDesk
from app.incidents.policy import Policy, Rule, parse_mode, parse_rules
from app.run.jobend import StopInputs
from app.stop.service import StopService
from tests.helpers.incidents import Sent
from trainer_bridge.rundir import runfiles


def test_rules_are_data_and_a_bad_one_names_the_setting():
    assert parse_rules("device_unhealthy:60, stalled:2.5,node_lost:0") == [
        Rule("device_unhealthy", 60.0),
        Rule("stalled", 2.5),
        Rule("node_lost", 0.0),
    ]
    assert parse_rules("") == []
    for bad, words in (
        ("melted:5", "unknown rule 'melted'"),
        ("stalled", "kind:seconds"),
        ("stalled:-1", "kind:seconds"),
        ("stalled:soon", "kind:seconds"),
        ("stalled:1,stalled:2", "declared twice"),
    ):
        with pytest.raises(ValueError, match=words) as e:
            parse_rules(bad)
        assert "POLICY_RULES" in str(e.value)
    assert parse_mode("dry-run") == "dry_run"
    with pytest.raises(ValueError, match="POLICY_MODE"):
        parse_mode("maybe")
    with pytest.raises(ValueError, match="POLICY_RULES"):
        create_app({"RUN_DIR": "/tmp", "POLICY_RULES": "melted:5"})


def rows(n=2, **rank_fields) -> dict[int, dict]:
    out = {
        r: {
            "health": "healthy",
            "reason": "training",
            "host": "a",
            "device": f"npu:{r}",
            "device_health": "OK",
        }
        for r in range(n)
    }
    for r, fields in rank_fields.items():
        out[int(r.removeprefix("r"))].update(fields)
    return out


class Harness:
    def __init__(self, run_dir, rules="device_unhealthy:30", mode="on", deadline_s=900.0):
        self.run_dir = run_dir
        self.audit = AuditLog(runfiles.state_dir(run_dir) / "audit.sqlite3")
        self.stop = StopService(str(run_dir), self.audit, deadline_s=deadline_s, auto_rearm=True)
        self.sent = Sent()
        self.policy = Policy(
            parse_rules(rules),
            mode,
            self.stop,
            self.audit,
            AlertDesk(self.sent, str(run_dir), group_s=0, summary_over=5, rate_per_min=20),
            deadline_s=deadline_s,
        )
        self.policy.new_job(1000.0)

    def feed(self, now, table):
        for r, row in table.items():
            self.policy.observe(r, row, now)
        return self.policy.tick(now, table, None)

    def flag(self):
        return runfiles.read_flag(self.run_dir)

    def audit_rows(self, action):
        return [r for r in self.audit.rows() if r["action"] == action]


def test_a_rule_fires_after_its_duration_with_the_stop_buttons_stop(run_dir):
    h = Harness(run_dir)
    sick = rows(r1={"device_health": "Critical"})
    h.feed(100.0, sick)
    h.feed(129.0, sick)
    assert h.flag() is None and h.sent.payloads == []
    assert h.feed(130.0, sick)
    flag = h.flag()
    assert flag.exit and flag.raw["requested_by"] == "policy"
    assert flag.raw["reason"] == (
        "policy device_unhealthy:30: rank 1 on a: device npu:1 reports health Critical for 30 s"
    )
    (request,) = h.audit_rows("request")
    assert request["who"] == "policy" and request["request_id"] == flag.request_id
    (fired,) = h.audit_rows("policy")
    assert fired["outcome"] == f"requested a graceful stop {flag.request_id}"
    (alert,) = h.sent.payloads
    assert alert["event"] == "policy_stop" and alert["request_id"] == flag.request_id
    assert alert["rule"] == "device_unhealthy:30" and alert["cannot_answer"] == []
    # Once per job run: the condition holding on fires nothing more.
    assert not h.feed(500.0, sick)
    assert len(h.audit_rows("policy")) == 1


def test_a_condition_that_clears_starts_its_clock_again(run_dir):
    h = Harness(run_dir)
    h.feed(100.0, rows(r1={"device_health": "Warning"}))
    h.feed(120.0, rows())
    h.feed(125.0, rows(r1={"device_health": "Warning"}))
    h.feed(150.0, rows(r1={"device_health": "Warning"}))
    assert h.flag() is None
    h.feed(155.0, rows(r1={"device_health": "Warning"}))
    assert h.flag().exit


def test_dry_run_stops_nothing_and_says_what_it_would_have_done(run_dir):
    h = Harness(run_dir, rules="straggler:60,stalled:10", mode="dry_run")
    slow = rows(r0={"health": "straggler", "reason": "own work 345 ms vs peer median 142 ms (2.4x)"})
    h.feed(0.0, slow)
    h.feed(60.0, slow)
    assert h.flag() is None and h.audit_rows("request") == []
    (row,) = h.audit_rows("policy")
    assert row["outcome"] == "dry run: would have requested a graceful stop"
    assert row["reason"].startswith("policy straggler:60: rank 0 on a straggler for 60 s: own work 345 ms")
    assert h.sent.payloads[0]["event"] == "policy_dry_run"
    assert h.policy.status(60.0)["rules"][0]["state"] == "fired"
    assert h.policy.status(60.0)["rules"][1]["state"] == "armed"


def test_a_restarted_dashboard_does_not_fire_again_for_the_same_job(run_dir):
    h = Harness(run_dir)
    sick = rows(r1={"device_health": "Critical"})
    h.feed(0.0, sick)
    h.feed(30.0, sick)
    again = Harness(run_dir)  # same audit trail, same job (started_at 1000.0)
    again.feed(40.0, sick)
    again.feed(100.0, sick)
    assert len(again.audit_rows("policy")) == 1 and again.sent.payloads == []
    # A new job run (relaunch): the rule is armed again.
    runfiles.write_flag(run_dir, False)
    again.policy.new_job(2000.0)
    again.feed(200.0, sick)
    again.feed(230.0, sick)
    assert len(again.audit_rows("policy")) == 2


def test_job_json_appearing_after_the_rule_fired_is_the_same_run(run_dir):
    """Rank 1's heartbeats can come before rank 0 writes job.json: that is no new run."""
    h = Harness(run_dir, mode="dry_run", rules="device_unhealthy:2")
    h.policy.new_job(None)
    sick = rows(r1={"device_health": "Critical"})
    h.feed(0.0, sick)
    h.feed(2.0, sick)
    assert len(h.audit_rows("policy")) == 1
    h.policy.new_job(1000.0)
    h.feed(3.0, sick)
    h.feed(10.0, sick)
    assert len(h.audit_rows("policy")) == 1 and len(h.sent.payloads) == 1
    assert h.policy.status(10.0)["rules"][0]["state"] == "fired"


def test_a_rank_that_cannot_answer_is_named_and_the_policy_does_not_loop(run_dir):
    h = Harness(run_dir, rules="stalled:20", deadline_s=300.0)
    hung = rows(r1={"health": "stalled", "reason": "no step finished for over 5 s (last: global step 40)"})
    h.feed(0.0, hung)
    h.feed(20.0, hung)
    flag = h.flag()
    assert flag.exit, "the flag is written anyway: if the rank recovers, the job stops"
    (row,) = h.audit_rows("policy")
    assert row["outcome"].endswith(
        "; rank 1 cannot answer (stalled), so a graceful stop cannot complete until it does; "
        "the policy will not retry"
    )
    status = {"request": {"request_id": flag.request_id}, "summary": None, "holding_up": [0, 1]}
    for now in (100.0, 200.0, 319.0):
        h.feed(now, hung)
        h.policy.tick(now, hung, status)
    assert len(h.sent.payloads) == 1
    h.policy.tick(320.0, hung, status)  # past STOP_DEADLINE_S: one more alert, and that is all
    for now in (400.0, 900.0, 5000.0):
        h.policy.tick(now, hung, status)
    assert [p["event"] for p in h.sent.payloads] == ["policy_stop", "policy_stop_incomplete"]
    assert "ranks 0-1 hold it up; the policy will not retry" in h.sent.payloads[1]["text"]
    assert len(h.audit_rows("request")) == 1 and len(h.audit_rows("policy")) == 2


def test_a_human_cancel_is_final(run_dir):
    h = Harness(run_dir)
    sick = rows(r1={"device_health": "Critical"})
    h.feed(0.0, sick)
    h.feed(30.0, sick)
    h.stop.cancel("alice", None, "false alarm", StopInputs({0: None, 1: None}, 2))
    h.feed(60.0, sick)
    h.feed(600.0, sick)
    assert not h.flag().exit and len(h.audit_rows("request")) == 1


def test_off_evaluates_nothing(run_dir):
    h = Harness(run_dir, mode="off")
    sick = rows(r1={"device_health": "Critical"})
    h.feed(0.0, sick)
    h.feed(1000.0, sick)
    assert h.flag() is None and h.audit_rows("policy") == []
    assert h.policy.status(0.0)["rules"][0]["state"] == "off"


def test_the_device_rule_says_it_cannot_fire_on_a_job_without_a_device(run_dir):
    """The CPU demo's stop-policy panel showed an npu-smi rule with no word that it cannot apply (issue 33)."""
    h = Harness(run_dir, rules="device_unhealthy:60,stalled:30")
    cpu = rows(r0={"device": None, "device_health": None}, r1={"device": None, "device_health": None})
    h.feed(100.0, cpu)
    device, stalled = h.policy.status(100.0)["rules"]
    assert device["help"].endswith("; no rank here reports an NPU (a CPU job), so this rule cannot fire")
    assert "Ascend NPU" in device["help"] and "cannot fire" not in stalled["help"]
    before = h.policy.version
    h.feed(101.0, rows())  # the ranks report their NPUs
    assert h.policy.version > before
    assert "cannot fire" not in h.policy.status(101.0)["rules"][0]["help"]
