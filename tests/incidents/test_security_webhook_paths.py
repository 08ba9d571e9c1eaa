"""Issue 32, P11: no webhook payload carries the run directory's absolute path.

A webhook's channel is often read by more people than the dashboard; the
payload names the run by its id (its directory's name here), as the
dashboard's URLs and the audit trail do.
"""

from __future__ import annotations

import json

from app import create_app
from tests.helpers.app import AUTH, FAST_SETTINGS, TOKEN
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.receiver import Receiver


def test_a_stop_alert_names_the_run_by_its_id_not_its_path(run_dir):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1))
    with Receiver() as receiver:
        app = create_app(
            {
                "RUN_DIR": str(run_dir),
                "TESTING": True,
                "TOKEN": TOKEN,
                **FAST_SETTINGS,
                "WEBHOOK_URL": receiver.url,
            }
        )
        r = app.test_client().post("/api/exit", json={"reason": "P11", "who": "alice"}, headers=AUTH)
        assert r.status_code == 202, r.get_json()
        app.extensions["rankwatch"].watcher.tick()
        got = receiver.wait_for(lambda p: p, "the stop request alert")
        app.extensions["rankwatch"].incidents.alerts.sender.close()
    assert got[0]["event"] == "stop_requested" and got[0]["job"] == run_dir.name, got
    assert got[0]["text"].startswith(f"Rankwatch {run_dir.name}: graceful stop requested by alice"), got
    assert str(run_dir) not in json.dumps(got), got
