"""When a job goes wrong, end to end: real 2-rank msrun jobs, the real dashboard, a real webhook receiver.

* A rank hangs inside Python: it is shown stalled, its automatic capture
  names the hung function, its peer's shows it waiting in the step, a POST
  brings a fresh capture, and a POST without the token gets 401.
* A rank is SIGSTOPped while the webhook receiver is down: after 10 s the
  receiver comes up and still gets the stalled alert; after SIGCONT, the
  recovery. py-spy captures the stopped rank.
* A fake ``npu-smi`` (the one mock: there is no NPU here) reports rank 1's
  chip unhealthy: the dry-run policy stops nothing; the armed policy stops
  the job gracefully, ``who = policy``, and the audit rows, the alerts and
  the checkpoints agree.

Every wait polls with a generous deadline; nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from app.incidents.stacks import collective, training_thread
from tests.helpers.app import AUTH, FAST_SETTINGS, TOKEN, make_app, wait_for
from tests.helpers.jobs import JOB_TIMEOUT_S, STOPPED_RANK_ENV, DemoJob, dump
from tests.helpers.receiver import quiet_port
from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.msrun


def http(server, method: str, path: str, body: dict | None = None, token: str | None = TOKEN):
    """(status, JSON) from the live dashboard."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def live_env(**extra) -> dict:
    return {f"RANKWATCH_{k}": str(v) for k, v in {**FAST_SETTINGS, "TOKEN": TOKEN, **extra}.items()}


@pytest.mark.parametrize("front", ["callback", "loop"])
def test_a_hung_rank_is_named_by_its_stack(run_dir, front, start_job):
    """Model.train with the callback, and a functional loop with bridge.loop."""
    loop = front == "loop"
    job = start_job(
        run_dir,
        epochs=3,
        step_delay=0.02,
        extra=["--hang-rank", "1", "--hang-at", "15"] + (["--loop"] if loop else []),
        env={"RANKWATCH_STALL_CAPTURE_S": "3"},
    )
    app = make_app(run_dir)
    client = app.test_client()

    def health(rank):
        ranks = client.get("/api/ranks").get_json()["ranks"]
        return ranks[rank]["health"] if len(ranks) > rank else None

    job.wait_until(lambda hbs: health(1) == "stalled", "rank 1 to be shown stalled")

    def capture(rank, query=""):
        r = client.get(f"/api/ranks/{rank}/stack{query}")
        return r.get_json() if r.status_code == 200 else None

    hung = job.wait_until(lambda hbs: capture(1, "?trigger=stall"), "rank 1's automatic capture")
    # The callback hangs in step 15's step_end (15 steps done); the loop inside step 15's body.
    assert hung["source"] == "bridge" and hung["global_step"] == (14 if loop else 15)
    main = training_thread(hung)
    assert main["frames"][0]["function"] == "hang_here", hung["text"]
    assert "hang_here" in hung["text"]

    peer = job.wait_until(lambda hbs: capture(0, "?trigger=stall"), "rank 0's automatic capture")
    frames = [f["function"] for f in training_thread(peer)["frames"]]
    # Waiting in the step: inside the network's call (Model._train_process, or the
    # functional loop's jitted train_step), no hook of ours.
    assert ("main" if loop else "Model._train_process") in frames, peer["text"]
    assert "hang_here" not in frames, peer["text"]
    assert "site-packages/mindspore" in training_thread(peer)["frames"][0]["file"]
    if peer["native"] == "included" and not loop:
        # In the functional loop the peer waits for MindSpore's async pipeline
        # (Pipeline::WaitAll, e.g. in Tensor.asnumpy), whose AllReduce runs on
        # another thread, so only the callback's wait names the collective.
        assert collective(training_thread(peer)["native"]) == "AllReduce", peer["text"]

    # Asking needs the token; a fresh capture answers the request.
    denied = client.post("/api/ranks/1/stack", json={})
    assert denied.status_code == 401 and denied.get_json()["status"] == 401
    asked_at = time.monotonic()
    r = client.post("/api/ranks/1/stack", json={}, headers=AUTH)
    assert r.status_code == 202 and r.get_json()["via"] == "bridge"
    rid = r.get_json()["request_id"]
    fresh = job.wait_until(
        lambda hbs: (c := capture(1)) and c["request_id"] == rid and c, "the requested capture"
    )
    print(f"\ncapture latency (POST to capture readable): {time.monotonic() - asked_at:.2f} s")
    assert fresh["trigger"] == "request" and fresh["captured_at"] > hung["captured_at"]
    assert training_thread(fresh)["frames"][0]["function"] == "hang_here"

    grouped = client.get("/api/stacks").get_json()
    print(f"grouped: {grouped['text']}")
    assert grouped["captured"] == 2
    assert "rank 1 in `hang_here` (train.py:" in grouped["text"], grouped["text"]


def test_webhooks_announce_a_stopped_rank_and_its_recovery_through_a_receiver_outage(
    run_dir, tmp_path, make_receiver, start_job, start_server
):
    receiver = make_receiver(quiet_port())  # down until 10 s after the first failed delivery
    # Rank 1 stays stopped through the receiver's outage: MindSpore must not end the job meanwhile.
    job = start_job(run_dir, epochs=12, step_delay=0.05, env=STOPPED_RANK_ENV)
    server = start_server(
        run_dir, tmp_path / "dashboard.log", env=live_env(WEBHOOK_URL=receiver.url, ALERT_GROUP_S=1.0)
    )
    hbs = job.wait_for_step(10)
    pid = hbs[1]["pid"]
    os.kill(pid, signal.SIGSTOP)

    def rank1():
        return http(server, "GET", "/api/ranks")[1]["ranks"][1]

    job.wait_until(lambda _: rank1()["health"] == "stalled", "rank 1 to be shown stalled")
    assert "stopped" in rank1()["reason"]

    # The stopped rank's bridge cannot answer: py-spy captures it.
    status, ask = http(server, "POST", "/api/ranks/1/stack", {})
    assert status == 202 and ask["via"] == "py-spy", ask
    shot = job.wait_until(
        lambda _: (
            (c := http(server, "GET", "/api/ranks/1/stack"))[0] == 200
            and c[1]["request_id"] == ask["request_id"]
            and c[1]
        ),
        "the py-spy capture of the stopped rank",
    )
    assert shot["source"] == "py-spy" and training_thread(shot)["frames"], shot["text"]

    def failures():
        rows = http(server, "GET", "/api/alerts")[1]["rows"]
        return [r for r in rows if r["event"] == "verdict" and r["outcome"].startswith("failed")]

    first = job.wait_until(lambda _: failures(), "a failed delivery to the receiver that is down")[-1]
    job.wait_until(lambda _: time.time() - first["at"] >= 10.0, "10 s of the receiver being down")
    receiver.start()
    got = receiver.wait_for(
        lambda ps: [p for p in ps if p.get("rank") == 1 and p.get("health") == "stalled"],
        "rank 1's stalled alert",
        timeout=JOB_TIMEOUT_S,
    )
    stalled = next(p for p in got if p.get("rank") == 1)
    assert stalled["event"] == "verdict" and "stopped" in stalled["reason"]
    assert {"event", "text", "job", "at", "rank", "health", "reason"} <= set(stalled)
    assert stalled["job"] == run_dir.name  # the run's id, never its absolute path (issue 32, P11)

    os.kill(pid, signal.SIGCONT)
    receiver.wait_for(
        lambda ps: [p for p in ps if p.get("rank") == 1 and p.get("health") == "healthy"],
        "rank 1's recovery alert",
        timeout=JOB_TIMEOUT_S,
    )
    rows = http(server, "GET", "/api/alerts")[1]["rows"]
    assert any(r["event"] == "verdict" and r["outcome"] == "delivered (HTTP 200)" for r in rows)


NPU_SMI = """#!/bin/sh
# A fake npu-smi (there is no NPU here): NPU 1 reports Critical, NPU 0 OK.
cat <<'EOF'
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc3                 Version: 23.0.rc3                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B1               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
| 1     910B1               | Critical      | 95.1        71                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
EOF
"""


def test_the_policy_stops_the_job_when_a_device_turns_unhealthy(
    run_dir, tmp_path, make_receiver, start_job, start_server
):
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "npu-smi").write_text(NPU_SMI)
    (tools / "npu-smi").chmod(0o755)
    receiver = make_receiver().start()
    job = start_job(
        run_dir, epochs=30, step_delay=0.05, env={"PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
    )
    policy = {"WEBHOOK_URL": receiver.url, "POLICY_RULES": "device_unhealthy:2"}
    server = start_server(run_dir, tmp_path / "dry.log", env=live_env(POLICY_MODE="dry_run", **policy))
    job.wait_until(lambda hbs: all(h and h["device"] for h in hbs), "the devices to report")
    assert [h["device"]["health"] for h in job.heartbeats()] == ["OK", "Critical"]

    # Dry run: an audit row and an alert, and the job trains on.
    dry = receiver.wait_for(lambda ps: [p for p in ps if p["event"] == "policy_dry_run"], "the dry run")[0]
    assert dry["rule"] == "device_unhealthy:2" and dry["rank"] == 1 and dry["request_id"] is None
    at_step = max(h["global_step"] for h in job.heartbeats())
    job.wait_for_step(at_step + 20)
    assert not runfiles.read_flag(run_dir)
    audit = http(server, "GET", "/api/audit")[1]["rows"]
    assert [r["action"] for r in audit] == ["policy"]
    assert audit[0]["outcome"].startswith("dry run: would have requested a graceful stop")
    status, policy_status = http(server, "GET", "/api/policy")
    assert policy_status["mode"] == "dry_run" and policy_status["rules"][0]["state"] == "fired"
    server.stop()

    # Armed: the same graceful stop as the button.
    server = start_server(run_dir, tmp_path / "on.log", env=live_env(POLICY_MODE="on", **policy))
    fired = receiver.wait_for(
        lambda ps: [p for p in ps if p["event"] == "policy_stop"],
        "the policy's stop",
        timeout=JOB_TIMEOUT_S,
    )[0]
    assert job.wait() == 0, job.logs()
    stop_step, stops = job.stopped_together()
    rid = fired["request_id"]
    assert {s["request_id"] for s in stops} == {rid}, dump(receiver.events())
    assert fired["text"].startswith(f"Rankwatch {run_dir.name}: policy requested a graceful stop ({rid}): ")
    assert "rank 1 on " in fired["evidence"] and "reports health Critical" in fired["evidence"]

    completed = receiver.wait_for(
        lambda ps: [p for p in ps if p["event"] == "stop_completed"], "the completion alert"
    )[0]
    assert completed["request_id"] == rid and completed["stop_step"] == stop_step

    def audit_rows():
        rows = http(server, "GET", "/api/audit")[1]["rows"]
        return rows if any(r["action"] == "complete" for r in rows) else None

    rows = wait_for(audit_rows, "the completion's audit row", timeout=60)
    request = next(r for r in rows if r["action"] == "request")
    assert (request["who"], request["request_id"], request["outcome"]) == ("policy", rid, "accepted")
    # The request's reason is the policy's own; the alert may add which ranks cannot answer:
    # a rank whose heartbeat is late on a loaded host reads stalled for a moment.
    assert request["reason"].startswith("policy device_unhealthy:2: rank 1 on "), request
    assert fired["text"].split(f"({rid}): ", 1)[1].startswith(request["reason"]), (fired, request)
    assert next(r for r in rows if r["action"] == "complete")["request_id"] == rid
    policy_rows = [r for r in rows if r["action"] == "policy"]
    assert [r["outcome"].split(" ")[0] for r in policy_rows] == ["requested", "dry"], dump(policy_rows)

    # Checkpoints: every rank saved at the stop step, as a complete set.
    index = http(server, "GET", "/api/checkpoints")[1]
    assert index["newest_complete"] is not None, dump(index)
    newest = next(s for s in index["sets"] if s["id"] == index["newest_complete"])
    assert newest["global_step"] == stop_step and newest["complete"]
    assert sorted(f["path"] for f in newest["files"]) == sorted(s["checkpoint"]["path"] for s in stops)


def test_a_rank_without_the_bridge_is_captured_by_pyspy_from_its_log_row(tmp_path):
    """Log mode (no bridge, rows from msrun's worker logs): the dashboard's py-spy reads the hung rank."""
    run = tmp_path / "run"
    (run / "msrun_logs").mkdir(parents=True)
    job = DemoJob(
        run,
        epochs=3,
        step_delay=0.02,
        extra=["--no-bridge", "--monitors", "--hang-rank", "1", "--hang-at", "15"],
        env={"GLOG_v": "2"},
    )
    app = make_app(run)
    client = app.test_client()
    auth = AUTH
    with job:

        def row1():
            rows = client.get("/api/ranks").get_json()["ranks"]
            return rows[1] if len(rows) == 2 and rows[1]["source"] == "log" and rows[1]["pid"] else None

        job.wait_until(
            lambda _: (r := row1()) and (r["global_step"] or 0) >= 15, "rank 1's log row at step 15"
        )
        assert not (run / "rankwatch" / "rank_1.json").exists(), "the script ran without the bridge"
        r = client.post("/api/ranks/1/stack", json={"native": True}, headers=auth)
        assert r.status_code == 202 and r.get_json()["via"] == "py-spy", r.get_json()
        assert "without the bridge" in r.get_json()["why"]
        rid = r.get_json()["request_id"]

        def answered():
            got = client.get("/api/ranks/1/stack")
            body = got.get_json()
            if got.status_code == 200 and body["request_id"] == rid:
                return body
            return None

        capture = job.wait_until(lambda _: answered(), "the py-spy capture")
        assert capture["source"] == "py-spy" and capture["pid"] == row1()["pid"]
        frames = [f["function"] for f in training_thread(capture)["frames"]]
        assert frames[0] == "hang_here" and "Hang.on_train_step_end" in frames, capture["text"]
        assert capture["native"] == "included" and training_thread(capture)["native"], capture["text"]
