"""Issue 32, P11: a stop the policy makes is audited as the policy's, not as a request with the token.

A rank's device health (what its heartbeat says) fires the policy; its stop
request and its ``policy`` row must say ``basis: policy``, so the trail never
shows a file-driven stop as one an operator authenticated.
"""

from __future__ import annotations

from app.audit import POLICY, AuditLog
from app.incidents.alerts import AlertDesk
from app.incidents.policy import Policy, parse_rules
from app.stop.service import StopService
from tests.helpers.incidents import Sent
from trainer_bridge.rundir import runfiles


def test_a_policy_stop_is_audited_with_basis_policy(run_dir):
    audit = AuditLog(runfiles.state_dir(run_dir) / "audit.sqlite3")
    stop = StopService(str(run_dir), audit, deadline_s=900.0, auto_rearm=True)
    desk = AlertDesk(Sent(), str(run_dir), group_s=0, summary_over=5, rate_per_min=20)
    policy = Policy(parse_rules("device_unhealthy:30"), "on", stop, audit, desk, deadline_s=900.0)
    policy.new_job(1000.0)
    sick = {
        r: {
            "health": "healthy",
            "reason": "training",
            "host": "a",
            "device": f"npu:{r}",
            "device_health": "OK",
        }
        for r in range(2)
    }
    sick[1]["device_health"] = "Critical"  # what rank 1's heartbeat claims
    for now in (100.0, 130.0):
        for r, row in sick.items():
            policy.observe(r, row, now)
        policy.tick(now, sick, None)
    assert runfiles.read_flag(run_dir).exit
    rows = {r["action"]: r for r in audit.rows()}
    assert rows["request"]["who"] == "policy" and rows["request"]["basis"] == POLICY, rows["request"]
    assert rows["policy"]["basis"] == POLICY
