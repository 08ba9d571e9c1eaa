"""The stop API through Flask's test client: token, CSRF, double clicks, cancel, re-arm."""

from __future__ import annotations

import json

import pytest

from app import create_app
from tests.helpers.app import AUTH, TOKEN, wait_for_event
from tests.helpers.heartbeats import heartbeat, write_heartbeat
from trainer_bridge.rundir import runfiles


def post(client, url, body, headers=AUTH, **kw):
    return client.post(url, json=body, headers=headers, **kw)


def audit(client):
    return client.get("/api/audit").get_json()["rows"]


def stop_hb(run_dir, rank, rid, stage, stop_step=5):
    write_heartbeat(
        run_dir,
        heartbeat(
            rank,
            2,
            state="exited" if stage == "exited" else "stopping",
            stop={
                "request_id": rid,
                "source": "flag",
                "stage": stage,
                "seen_step": 4,
                "stop_step": stop_step,
                "at": {stage: 1.0},
                "checkpoint": {
                    "path": f"checkpoints/rank_{rank}/rankwatch-1_5.ckpt",
                    "bytes": 10,
                    "seconds": 0.1,
                },
            },
        ),
    )


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, {"Authorization": "Basic " + TOKEN}],
)
def test_no_or_wrong_token_is_401_and_writes_nothing(client, run_dir, headers):
    r = post(client, "/api/exit", {"reason": "x"}, headers=headers)
    assert r.status_code == 401 and r.get_json()["status"] == 401
    assert not runfiles.flag_path(run_dir).exists()


def test_request_answers_202_and_writes_the_native_flag(client, run_dir):
    r = post(client, "/api/exit", {"reason": "npu 3 ECC", "who": "alice"})
    assert r.status_code == 202
    rid = r.get_json()["request_id"]
    flag = json.loads(runfiles.flag_path(run_dir).read_text())
    assert flag["GracefulExit"] == 1 and flag["request_id"] == rid and flag["reason"] == "npu 3 ECC"
    [row] = audit(client)
    assert (row["who"], row["remote_addr"], row["outcome"]) == ("alice", "127.0.0.1", "accepted")


@pytest.mark.parametrize(
    "headers, status",
    [
        ({**AUTH, "Origin": "http://evil.example"}, 403),
        ({**AUTH, "Sec-Fetch-Site": "cross-site"}, 403),
        ({"Origin": "http://evil.example"}, 403),
    ],
)
def test_cross_site_requests_are_refused(client, run_dir, headers, status):
    r = post(client, "/api/exit", {"reason": "csrf"}, headers=headers)
    assert r.status_code == status
    assert not runfiles.flag_path(run_dir).exists()


def test_a_form_post_cannot_stop_the_job(client, run_dir):
    """What a CSRF page can send: a form, with cookies but no Authorization header."""
    client.set_cookie("session", "whatever")
    r = client.post(
        "/api/exit", data={"reason": "csrf"}, headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert r.status_code == 401
    r = client.post("/api/exit", data="reason=csrf", headers={**AUTH, "Content-Type": "text/plain"})
    assert r.status_code == 415
    assert not runfiles.flag_path(run_dir).exists()


def test_same_origin_browser_request_is_accepted(client):
    r = post(
        client,
        "/api/exit",
        {"reason": "ok"},
        headers={**AUTH, "Origin": "http://localhost", "Sec-Fetch-Site": "same-origin"},
    )
    assert r.status_code == 202


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "'reason' is required"),
        ({"reason": "   "}, "must not be empty"),
        ({"reason": 3}, "must be str"),
        ({"reason": "x", "force": True}, "unknown field"),
        ({"reason": "x" * 501}, "longer than"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_bodies_are_400_and_write_nothing(client, run_dir, body, message):
    r = post(client, "/api/exit", body)
    assert r.status_code == 400 and message in r.get_json()["error"]
    assert not runfiles.flag_path(run_dir).exists()


def test_garbage_json_and_oversized_body(client, run_dir):
    r = client.post("/api/exit", data=b"{not json", headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 400 and r.get_json()["error"].startswith("the body is not valid JSON")
    r = client.post("/api/exit", data=b"x" * 100_000, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.get_json()["status"] == 413
    assert not runfiles.flag_path(run_dir).exists()


def test_double_click_makes_one_request(client):
    first = post(client, "/api/exit", {"reason": "click"}).get_json()
    second = post(client, "/api/exit", {"reason": "click"}).get_json()
    assert first["request_id"] == second["request_id"]
    assert (first["created"], second["created"]) == (True, False)
    assert len(audit(client)) == 2


def test_cancel_before_agreement_and_not_after(client, run_dir):
    rid = post(client, "/api/exit", {"reason": "r"}).get_json()["request_id"]
    write_heartbeat(run_dir, heartbeat(0, 2))
    stop_hb(run_dir, 1, rid, "seen")
    assert client.get("/api/exit").get_json()["can_cancel"] is True
    r = post(client, "/api/exit/cancel", {"reason": "false alarm"})
    assert r.status_code == 200 and r.get_json()["request_id"] == rid
    assert not runfiles.read_flag(run_dir).exit
    assert client.get("/api/exit").get_json()["state"] == "cancelled"

    rid2 = post(client, "/api/exit", {"reason": "again"}).get_json()["request_id"]
    stop_hb(run_dir, 1, rid2, "agreed")
    r = post(client, "/api/exit/cancel", {})
    assert r.status_code == 409 and "too late" in r.get_json()["error"]
    assert runfiles.read_flag(run_dir).exit


def test_rearm_after_completion(client, run_dir):
    app = client.application
    app.extensions["rankwatch"].stop.auto_rearm = False
    rid = post(client, "/api/exit", {"reason": "r"}).get_json()["request_id"]
    stop_hb(run_dir, 0, rid, "exited")
    stop_hb(run_dir, 1, rid, "saving")
    assert post(client, "/api/exit/rearm", {}).status_code == 409
    stop_hb(run_dir, 1, rid, "exited")
    status = client.get("/api/exit").get_json()
    assert status["state"] == "completed" and status["summary"].startswith("all 2 ranks stopped after step 5")
    r = post(client, "/api/exit/rearm", {"reason": "relaunching"})
    assert r.status_code == 200
    assert json.loads(runfiles.flag_path(run_dir).read_text())["GracefulExit"] == 0
    rows = [(a["action"], a["outcome"].split(":")[0]) for a in audit(client)]
    assert rows == [("rearm", "accepted"), ("rearm", "refused"), ("request", "accepted")]


def test_status_estimate_and_native_job_honesty(client, run_dir):
    s = client.get("/api/exit").get_json()
    assert s["state"] == "idle" and s["estimate"]["ranks"] == 0
    post(client, "/api/exit", {"reason": "native script"})
    s = client.get("/api/exit").get_json()
    assert s["state"] == "requested" and s["bridge_seen"] is False


def test_stop_status_is_pushed_on_connect_and_on_change(app, client, sio, run_dir):
    first = wait_for_event(sio, "stop_status")
    assert first["state"] == "idle"
    rid = post(client, "/api/exit", {"reason": "r"}).get_json()["request_id"]
    pushed = wait_for_event(sio, "stop_status", lambda s: s["state"] == "requested")
    assert pushed["request"]["request_id"] == rid


def test_audit_csv_download(client):
    post(client, "/api/exit", {"reason": "csv, with a comma"})
    r = client.get("/api/audit.csv")
    assert r.status_code == 200 and r.mimetype == "text/csv"
    assert "attachment" in r.headers["Content-Disposition"]
    assert '"csv, with a comma"' in r.get_data(as_text=True)


def test_session_checks_the_token(client):
    assert client.post("/api/session", json={"token": TOKEN}).status_code == 200
    r = client.post("/api/session", json={"token": "nope"})
    assert r.status_code == 401 and r.get_json() == {"error": "wrong operator token", "status": 401}


def test_generated_token_when_unset(run_dir, monkeypatch):
    monkeypatch.delenv("RANKWATCH_TOKEN", raising=False)
    app = create_app({"RUN_DIR": str(run_dir)})
    assert app.config["TOKEN_GENERATED"] and len(app.config["TOKEN"]) >= 24
