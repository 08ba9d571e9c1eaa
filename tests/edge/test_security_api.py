"""Issue 13: the attacks of the security review on the HTTP API and Socket.IO, each reproduced.

Attacker A reaches the port with no token; attacker B writes the run
directory. Each test sends what the review sent and checks the fixed
outcome (the Flask test client, real files, real SQLite).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from app import create_app
from app.run.jobend import StopInputs
from tests.helpers import ckptcraft
from tests.helpers.app import AUTH, FAST_SETTINGS, TOKEN
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles


def json_routes(app) -> list[str]:
    """Every route that takes a JSON body (path parameters filled in: rank 0).

    Not the per-run twins (app/runs/scoping.py): the same views, and twice the
    routes would pass the operator's write rate here.
    """
    return sorted(
        re.sub(r"<(?:int:)?\w+>", "0", rule.rule)
        for rule in app.url_map.iter_rules()
        if "POST" in rule.methods and "run_id" not in rule.arguments
    )


# ------------------------------------------------------------- item 9: nested JSON


@pytest.mark.parametrize("depth", [1000, 5000])
def test_deeply_nested_json_bodies_are_400_not_500(app, client, run_dir, depth):
    """``[`` x 1000 to /api/session answered 500 with a logged traceback."""
    routes = json_routes(app)
    assert "/api/session" in routes and "/api/exit" in routes
    for route in routes:
        for data in (b"[" * depth + b"]" * depth, b'{"reason": ' + b"[" * depth + b"]" * depth + b"}"):
            r = client.post(route, data=data, headers={**AUTH, "Content-Type": "application/json"})
            assert r.status_code == 400, (route, r.status_code, r.get_data()[:200])
            body = r.get_json()
            assert body["status"] == 400 and isinstance(body["error"], str), body
            # Under Python's default recursion limit the decoder gives up (MindSpore, imported
            # by other tests in this process, raises the limit, so the list may parse).
            if sys.getrecursionlimit() < depth:
                assert body["error"] == "the body is not valid JSON: nested too deeply"
    assert not runfiles.flag_path(run_dir).exists()


# ------------------------------------------------ item 2: the stop path under bad files


def raw_heartbeat(run_dir, rank: int, **overrides) -> None:
    """A heartbeat written as raw JSON text, past the schema the test helper enforces."""
    raws: list[str] = []

    def mark(value):
        raws.append(value.text)
        return f"@@raw{len(raws) - 1}@@"

    text = json.dumps({**heartbeat(rank, 2), **overrides}, default=mark)
    for i, raw in enumerate(raws):
        text = text.replace(f'"@@raw{i}@@"', raw)
    path = runfiles.heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


class RawJSON:
    """A value written into a heartbeat as this exact JSON text."""

    def __init__(self, text: str):
        self.text = text


def stopping(rid="req-1", **stop):
    return {"request_id": rid, "stage": "saving", "seen_step": 5, "stop_step": 8, **stop}


BAD_HEARTBEATS = {
    "a 401-digit loss": {"loss": RawJSON("1" * 401)},
    "a 401-digit float": {"step_time_ms": RawJSON("1" * 400 + ".5")},
    "pid -1 on this host": {"pid": -1},
    "stop.at as a list": {"stop": stopping(at=[1, 2, 3])},
    "stop as a list": {"stop": [1, 2]},
    "stop.checkpoint as text": {"stop": stopping(checkpoint="x", at={"seen": "soon"})},
    "stop.at with a huge number": {"stop": stopping(at={"seen": RawJSON("9" * 400)})},
    "sync_every 1e9": {"sync_every": 10**9, "step_time_mean_ms": 1e9},
    "nested 100000 deep": {"device": RawJSON("[" * 100_000 + "]" * 100_000)},
    "a 200 MB-like string": {"error": "x" * 300_000},
}
BAD_FLAGS = {
    "nested 100000 deep": b'{"GracefulExit": 1, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "not JSON": b"\xff\xfe{",
    "a list": b"[1, 2]",
    "request_id a list": b'{"GracefulExit": 1, "request_id": [1, 2]}',
    "requested_at text": b'{"GracefulExit": 1, "request_id": "r-1", "requested_at": "soon", "reason": 5}',
    "last_request text": b'{"GracefulExit": 0, "last_request": "r-0", "cancelled": [1]}',
    "last_request with bad facts": b'{"GracefulExit": 0, "last_request": {"request_id": {}, "requested_at": []}}',
    "a 401-digit requested_at": b'{"GracefulExit": 1, "request_id": "r-2", "requested_at": '
    + b"1" * 401
    + b"}",
    "10 MB": b'{"GracefulExit": 1, "pad": "' + b"x" * 10_000_000 + b'"}',
}


def write_bad(run_dir, heartbeat_case=None, flag_case=None):
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2, stop=stopping(at={"seen": time.time()})))
    if heartbeat_case is not None:
        raw_heartbeat(run_dir, 1, **BAD_HEARTBEATS[heartbeat_case])
    else:
        write_heartbeat(run_dir, heartbeat(1, 2))
    if flag_case is not None:
        runfiles.flag_path(run_dir).write_bytes(BAD_FLAGS[flag_case])


def assert_stop_path_works(client, run_dir):
    r = client.get("/api/exit")
    assert r.status_code == 200, r.get_data()[:500]
    r = client.post("/api/exit", json={"reason": "device 3 ECC errors"}, headers=AUTH)
    assert r.status_code == 202, r.get_data()[:500]
    flag = runfiles.read_flag(run_dir)
    assert flag is not None and flag.exit, flag
    rid = r.get_json()["request_id"]
    assert isinstance(rid, str) and rid
    if r.get_json()["created"]:
        assert flag.request_id == rid
    # And the page's view of it still answers.
    assert client.get("/api/exit").status_code == 200
    assert client.get("/api/ranks").status_code == 200


@pytest.mark.parametrize("case", list(BAD_HEARTBEATS))
def test_a_bad_heartbeat_does_not_block_the_stop(client, run_dir, case):
    write_bad(run_dir, heartbeat_case=case)
    assert_stop_path_works(client, run_dir)


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_a_bad_flag_does_not_block_the_stop(client, run_dir, case):
    write_bad(run_dir, flag_case=case)
    assert_stop_path_works(client, run_dir)


def test_the_stop_service_survives_stop_records_it_cannot_use(tmp_path):
    """Below the schema: the service itself reads whatever a rank's ``stop`` holds."""
    from app.audit import AuditLog
    from app.stop.service import StopService

    service = StopService(str(tmp_path), AuditLog(tmp_path / "a.sqlite3"), deadline_s=900, auto_rearm=True)
    runfiles.write_flag(tmp_path, True, request_id="req-1", requested_at="soon")
    odd = [
        {"stop": stopping(at=[1, 2])},
        {"stop": stopping(at={"seen": "x", "saved": 10**400, "exited": float("nan")})},
        {"stop": stopping(checkpoint="path", stage="exited")},
        {"stop": stopping(checkpoint={"bytes": "many", "seconds": [1]}, stage="exited")},
        {"stop": stopping(stop_step=[8], seen_step={"a": 1})},
        {"stop": "saving"},
        {"step_time_mean_ms": "fast", "sync_every": [1]},
        {"step_time_mean_ms": 1e300, "sync_every": 10**12},
        "not a heartbeat",
    ]
    ranks = dict(enumerate(odd))
    status = service.status(time.time(), StopInputs(ranks, len(odd)))
    json.dumps(status)
    assert status["state"] in ("requested", "stopping")
    json.dumps(service.estimate(StopInputs(ranks, len(odd))))
    service.tick(inputs=StopInputs(ranks, len(odd)))
    assert service.request("again", "op", None) == ("req-1", False, None, None)


def test_a_corrupt_audit_trail_does_not_block_the_stop(client, run_dir):
    """The trail lives in the run directory, which B can write: the stop goes on, and says so."""
    write_bad(run_dir)
    db = runfiles.state_dir(run_dir) / "audit.sqlite3"
    db.write_bytes(b"this is not an SQLite database" * 100)
    r = client.post("/api/exit", json={"reason": "r"}, headers=AUTH)
    assert r.status_code == 202, r.get_data()[:300]
    assert "audit_error" in r.get_json()
    assert runfiles.read_flag(run_dir).exit
    assert client.get("/api/exit").status_code == 200
    r = client.get("/api/audit")
    assert r.status_code == 503 and "audit" in r.get_json()["error"]


# ------------------------------------------------ item 5: the copyable relaunch command

INJECTED = "n1;touch {marker};#"


def run_pasted(command: str, tmp_path) -> list[str]:
    """Paste ``command`` into bash, with ``msrun`` a function that records its arguments."""
    script = 'msrun() { printf "%s\\n" "$@" > args; }\nNODE_RANK=0\nLOCAL_WORKERS=1\n' + command + "\n"
    subprocess.run(["bash", "-c", script], cwd=tmp_path, check=False, capture_output=True, timeout=30)
    args = tmp_path / "args"
    return args.read_text().splitlines() if args.exists() else []


def test_a_hostile_host_name_is_refused_and_never_reaches_the_shell(tmp_path):
    from app.checkpoints.relaunch import relaunch_command

    marker = tmp_path / "pwned"
    job = {"argv": ["train.py"], "world_size": 2}
    heartbeats = {0: {"host": INJECTED.format(marker=marker)}, 1: {"host": "node-b"}}
    command, notes = relaunch_command(job, 2, heartbeats)
    assert command is None, command
    assert any("not a host name" in n for n in notes), notes
    # Before the fix the command held --master_addr=n1;touch ...;# and ran it.
    for host in ("node-a", "10.0.0.7", "fe80::1", "a_b.example.com"):
        command, _ = relaunch_command(job, 2, {0: {"host": host}, 1: {"host": "node-b"}})
        assert f"--master_addr={host}" in run_pasted(command, tmp_path), command
    assert not marker.exists()


def test_every_value_of_the_relaunch_command_is_quoted(tmp_path):
    from app.checkpoints.relaunch import relaunch_command

    marker = tmp_path / "pwned"
    argv = [
        "train.py",
        f"--name=$(touch {marker})",
        f"`touch {marker}`",
        "a b",
        "it's",
        "x\ny",
        "--lr=0.1;id",
    ]
    for heartbeats in ({0: {"host": "node-a"}}, {0: {"host": "node-a"}, 1: {"host": "node-b"}}):
        command, _ = relaunch_command({"argv": argv, "world_size": 2}, 2, heartbeats)
        args = run_pasted(command, tmp_path)
        assert args[-len(argv) - 2 :] == ["--join=True", *argv[:5], "x", "y", "--lr=0.1;id"], args
    assert not marker.exists()


def test_the_resume_route_refuses_a_hostile_host(client, run_dir, tmp_path):
    write_job(run_dir, 2)
    raw_heartbeat(run_dir, 0, host=INJECTED.format(marker=tmp_path / "pwned"))
    write_heartbeat(run_dir, heartbeat(1, 2, host="node-b"))
    for r in (0, 1):
        path = run_dir / f"checkpoints/rank_{r}/rankwatch-1_8.ckpt"
        ckptcraft.write(path, ckptcraft.ckpt(global_step=8))
    sets = client.get("/api/checkpoints").get_json()["sets"]
    info = client.get("/api/checkpoints/resume", query_string={"set": sets[0]["id"]}).get_json()
    assert info["command"] is None or "touch" not in info["command"], info["command"]


# ------------------------------------------------ item 6: DNS rebinding and token guessing


def test_a_rebound_host_name_is_refused_on_every_path(app, client, run_dir):
    """A page on rebind.test, resolving to 127.0.0.1, read every API and the socket."""
    write_job(run_dir, 2)
    for path in (
        "/",
        "/api/ranks",
        "/api/checkpoints",
        "/api/audit.csv",
        "/checkpoints",
        "/socket.io/?EIO=4&transport=polling",
    ):
        r = client.get(path, headers={"Host": "rebind.test:5000"})
        assert r.status_code == 400, (path, r.status_code)
        assert r.get_json() == {
            "error": "host 'rebind.test' is not one this dashboard serves (setting ALLOWED_HOSTS)",
            "status": 400,
        }
    r = client.post("/api/session", json={"token": TOKEN}, headers={"Host": "rebind.test"})
    assert r.status_code == 400
    # The names it is reached by are fine, with or without a port.
    for host in ("localhost", "localhost:5000", "127.0.0.1:5000", "[::1]:5000", "LOCALHOST."):
        assert client.get("/api/ranks", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_adds_a_reverse_proxy_name(run_dir):
    app = create_app(
        {"RUN_DIR": str(run_dir), "TESTING": True, "ALLOWED_HOSTS": "dash.example.com, *.corp.example"}
    )
    client = app.test_client()
    assert client.get("/api/ranks", headers={"Host": "dash.example.com"}).status_code == 200
    assert client.get("/api/ranks", headers={"Host": "a.corp.example"}).status_code == 200
    assert client.get("/api/ranks", headers={"Host": "corp.example.evil"}).status_code == 400
    assert client.get("/api/ranks").status_code == 200  # localhost stays
    anything = create_app({"RUN_DIR": str(run_dir), "TESTING": True, "ALLOWED_HOSTS": "*"}).test_client()
    assert anything.get("/api/ranks", headers={"Host": "rebind.test"}).status_code == 200


def test_a_wildcard_bind_allows_this_machine_s_names_only(run_dir):
    import socket

    app = create_app({"RUN_DIR": str(run_dir), "TESTING": True, "HOST": "0.0.0.0"})
    client = app.test_client()
    assert client.get("/api/ranks", headers={"Host": socket.gethostname()}).status_code == 200
    assert client.get("/api/ranks", headers={"Host": "rebind.test"}).status_code == 400


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("how", ["session", "bearer"])
def test_token_guessing_backs_off(app, client, run_dir, how):
    """The review guessed about 1,050 tokens a second through /api/session, with no lockout."""
    clock = FakeClock()
    app.extensions["rankwatch_limits"].backoff.clock = clock

    def attempt(token):
        if how == "session":
            return client.post("/api/session", json={"token": token})
        return client.post(
            "/api/exit", json={"reason": "guess"}, headers={"Authorization": f"Bearer {token}"}
        )

    statuses = [attempt(f"guess-{i}").status_code for i in range(100)]
    checked = statuses.count(401)
    assert checked <= 6 and statuses.count(429) == 100 - checked, statuses
    r = attempt("still-guessing")
    assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
    assert r.get_json()["error"].startswith("too many wrong operator tokens (from 127.0.0.1")
    # Each further failure doubles the wait, up to a minute.
    clock.now += 2
    assert attempt("guess-again").status_code == 401
    assert int(attempt("and-again").headers["Retry-After"]) == 2  # 1 s, then 2 s, then 4 s...
    # The right token is never refused (issue 19, item 5), and clears this address's record.
    assert attempt(TOKEN).status_code in (200, 202)
    assert attempt("one-typo").status_code == 401
    assert attempt(TOKEN).status_code in (200, 202)
    # Another address is not held back by this one's guesses.
    other = client.post("/api/session", json={"token": "x"}, environ_base={"REMOTE_ADDR": "10.0.0.9"})
    assert other.status_code == 401


def test_guessing_from_the_operator_s_address_never_locks_the_operator_out(app, client):
    """Issue 19, item 5: while another client on the same address guesses, the right token gets 10 of 10."""
    accepted = 0
    for i in range(10):
        for j in range(10):  # the attacker: wrong tokens, wrong Bearer headers, bogus login codes
            client.post("/api/session", json={"token": f"wrong-{i}-{j}"})
            client.post("/api/login", json={"code": f"bogus-{i}-{j}"})
            client.post("/api/exit", json={"reason": "x"}, headers={"Authorization": f"Bearer no-{i}-{j}"})
        assert client.post("/api/session", json={"token": "one-more"}).status_code == 429  # backing off
        accepted += client.post("/api/session", json={"token": TOKEN}).status_code == 200
    assert accepted == 10
    # And a stop with the token goes through, in the middle of it.
    client.post("/api/session", json={"token": "again"})
    assert client.post("/api/exit", json={"reason": "real"}, headers=AUTH).status_code == 202
    # A live login code is redeemed too.
    code, _ = app.extensions["rankwatch_login"].mint()
    assert client.post("/api/login", json={"code": code}).get_json() == {"token": TOKEN}


def test_rotating_addresses_trips_the_global_limit_with_a_log_line_and_an_alert(run_dir, caplog):
    """All of 127.0.0.0/8 is this machine: one address per guess gained a fresh backoff each time."""
    from tests.helpers.receiver import Receiver

    with Receiver() as hook:
        app = create_app(
            {
                "RUN_DIR": str(run_dir),
                "TESTING": True,
                "TOKEN": TOKEN,
                **FAST_SETTINGS,
                "AUTH_FAILURES_PER_MIN": 20,
                "WEBHOOK_URL": hook.url,
            }
        )
        client = app.test_client()
        try:
            statuses = []
            for i in range(100):
                addr = {"REMOTE_ADDR": f"127.{i // 250}.{i % 250}.{1 + i % 7}"}
                way = i % 2
                if way:
                    r = client.post("/api/session", json={"token": f"guess-{i}"}, environ_base=addr)
                else:
                    r = client.post("/api/login", json={"code": f"guess-{i}"}, environ_base=addr)
                statuses.append(r.status_code)
            assert statuses[:20] == [401] * 20 and statuses[20:] == [429] * 80, statuses
            assert "too many wrong" in r.get_json()["error"] and int(r.headers["Retry-After"]) >= 1
            # The right token from any address still works.
            ok = client.post("/api/session", json={"token": TOKEN}, environ_base={"REMOTE_ADDR": "127.9.9.9"})
            assert ok.status_code == 200
            lines = [r.getMessage() for r in caplog.records if "AUTH_FAILURES_PER_MIN" in r.getMessage()]
            assert len(lines) == 1 and "someone may be guessing" in lines[0], lines
            alert = hook.wait_for(lambda got: [p for p in got if p.get("event") == "auth_flood"], "the alert")
            assert len(alert) == 1 and "AUTH_FAILURES_PER_MIN" in alert[0]["text"]
        finally:
            app.extensions["rankwatch"].watcher.stop()
            app.extensions["rankwatch"].incidents.alerts.sender.close()


@pytest.mark.parametrize(
    "token, weak",
    [
        ("s3cret", True),
        ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", True),
        ("abababababababababababababababab", True),
        ("password1234", True),
        ("Kx9-security-test-token-7Qz2mW4vT8pL", False),
        ("kq7vT2mZ9xL4wB8nR3cH6jP1", False),
    ],
)
def test_a_weak_token_is_warned_about_at_start(run_dir, caplog, token, weak):
    create_app({"RUN_DIR": str(run_dir), "TESTING": True, "TOKEN": token})
    warned = [r.getMessage() for r in caplog.records if "RANKWATCH_TOKEN is weak" in r.getMessage()]
    assert bool(warned) == weak, warned
    if weak:
        assert token not in warned[0]  # the warning must not leak the token into the log


# ------------------------------------------------ item 10: security headers


def test_every_response_carries_the_security_headers(app, client):
    answers = {
        "page": client.get("/"),
        "checkpoints page": client.get("/checkpoints"),
        "api": client.get("/api/ranks"),
        "api error": client.get("/api/nope"),
        "refused": client.post("/api/exit", json={"reason": "x"}),
        "static": client.get("/static/js/main.js"),
        "plotly": client.get("/vendor/plotly.min.js"),
        "plotly css": client.get("/vendor/plotly.css"),
        "engine.io": client.get("/socket.io/?EIO=4&transport=polling"),
        "wrong host": client.get("/", headers={"Host": "rebind.test"}),
    }
    for what, r in answers.items():
        csp = r.headers.get("Content-Security-Policy", "")
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp, (what, csp)
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, (what, csp)
        assert r.headers["X-Frame-Options"] == "DENY", what
        assert r.headers["X-Content-Type-Options"] == "nosniff", what
        assert r.headers["Referrer-Policy"] == "no-referrer", what
        r.close()


def test_the_pages_have_no_inline_script_or_handler(client):
    import re

    for url in ("/", "/checkpoints"):
        html = client.get(url).get_data(as_text=True)
        for tag in re.findall(r"<script\b[^>]*>", html):
            assert "src=" in tag or 'type="application/json"' in tag, (url, tag)
        assert not re.search(r"\son[a-z]+\s*=", html), url
        assert not re.search(r"<style\b|\sstyle\s*=", html), url
    css = client.get("/vendor/plotly.css").get_data(as_text=True)
    assert ".js-plotly-plot .plotly .modebar{" in css


# ------------------------------------------------ item 11: token hygiene


def test_login_codes_work_once_and_expire():
    from app.edge.login import LoginCodes

    clock = FakeClock()
    codes = LoginCodes(ttl_s=600, clock=clock)
    code, expires = codes.mint()
    assert expires == clock.now + 600 and len(code) >= 20
    assert codes.redeem(code) and not codes.redeem(code)
    late, _ = codes.mint()
    clock.now += 601
    assert not codes.redeem(late)
    assert not codes.redeem("") and not codes.redeem("x" * 30)


def test_the_messages_name_rankwatch_login_as_it_can_be_run_here(monkeypatch, tmp_path):
    """By name on PATH; by its path beside the dashboard's Python otherwise (a `make demo` venv)."""
    import sys
    from pathlib import Path

    from app.edge import login

    beside = Path(sys.executable).parent / "rankwatch"
    assert beside.is_file()  # the venv's console script (pyproject.toml's [project.scripts])
    monkeypatch.setenv("PATH", str(tmp_path))
    assert login._login_command() == f"{beside} login"
    monkeypatch.setenv("PATH", str(beside.parent))
    assert login._login_command() == "rankwatch login"


def test_the_login_routes(app, client):
    r = client.post("/api/login-code", json={}, headers=AUTH)
    assert r.status_code == 201, r.get_json()
    minted = r.get_json()
    assert minted["login_url"] == f"http://localhost/#login={minted['code']}"
    assert TOKEN not in minted["login_url"]
    first = client.post("/api/login", json={"code": minted["code"]})
    assert first.status_code == 200 and first.get_json() == {"token": TOKEN}
    again = client.post("/api/login", json={"code": minted["code"]})
    assert again.status_code == 401 and "used up or expired" in again.get_json()["error"]
    assert client.post("/api/login-code", json={}).status_code == 401  # minting needs the token
    # Guessing codes backs off like guessing tokens.
    statuses = [client.post("/api/login", json={"code": f"guess{i}"}).status_code for i in range(30)]
    assert statuses.count(401) <= 6 and 429 in statuses


def test_serve_prints_a_single_use_url_and_never_the_token(run_dir, tmp_path, monkeypatch, start_server):
    from app.edge.login import mint_login_url

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("RANKWATCH_TOKEN", raising=False)
    server = start_server(run_dir, tmp_path / "dash.log", env={"XDG_RUNTIME_DIR": str(runtime)})
    log = server.log()
    printed = re.search(r"open (http://\S+#login=(\S+))", log)
    assert printed, log
    code = printed[2]
    token = _post(server.url + "/api/login", {"code": code})["token"]
    assert token not in log  # the token itself is printed nowhere
    with pytest.raises(urllib.error.HTTPError) as used:
        _post(server.url + "/api/login", {"code": code})
    assert used.value.code == 401
    # The server file is private, and a new link can be minted from it.
    files = list((runtime / "rankwatch").iterdir())
    assert len(files) == 1 and (files[0].stat().st_mode & 0o777) == 0o600
    assert ((runtime / "rankwatch").stat().st_mode & 0o777) == 0o700
    fresh = mint_login_url(run_dir=str(run_dir))
    assert fresh.startswith(server.url + "/#login=") and token not in fresh
    assert _post(server.url + "/api/login", {"code": fresh.split("#login=")[1]})["token"] == token
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "login", "--url", server.url],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.startswith(server.url + "/#login="), out
    server.stop()
    assert not list((runtime / "rankwatch").iterdir())  # removed at exit


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


# ------------------------------------------------ item 14: a re-sent connect


def snapshots(sio) -> int:
    return sum(1 for e in sio.get_received() if e["name"] == "ranks_snapshot")


def test_a_re_sent_connect_gets_no_second_snapshot(app, client, run_dir):
    from app.extensions import socketio

    write_job(run_dir, 2)
    sio = socketio.test_client(app, flask_test_client=client)
    try:
        assert snapshots(sio) == 1
        for _ in range(20):
            sio.emit("connect")
            sio.emit("connect", {"token": "x"})
        sio.emit("disconnect")  # an event named so, not a disconnect
        sio.emit("connect")
        assert snapshots(sio) == 0
        assert sio.is_connected()
        # A real second connection still gets its own.
        other = socketio.test_client(app, flask_test_client=client)
        assert snapshots(other) == 1
        other.disconnect()
    finally:
        sio.disconnect()


def test_a_re_sent_connect_over_raw_polling_is_refused(app, client, run_dir):
    """What the review sent: ``42["connect"]`` on the long-polling transport, again and again."""
    r = client.get("/socket.io/?EIO=4&transport=polling")
    sid = json.loads(r.data[1:])["sid"]
    url = f"/socket.io/?EIO=4&transport=polling&sid={sid}"
    assert client.post(url, data="40", content_type="text/plain;charset=UTF-8").status_code == 200
    first = client.get(url).get_data(as_text=True)
    assert "ranks_snapshot" in first or "ranks_snapshot" in client.get(url).get_data(as_text=True)
    for data in (
        '42["connect"]',
        '42 ["connect",{}]',
        '4212["disconnect"]',
        '42/,["connect"]',
        '3\x1e42["connect"]',
    ):
        r = client.post(url, data=data, content_type="text/plain;charset=UTF-8")
        assert r.status_code == 400, (data, r.status_code)
        assert r.get_json() == {
            "error": "a client may not send an event named connect or disconnect",
            "status": 400,
        }
    ok = client.post(url, data='42["some_event",{}]', content_type="text/plain;charset=UTF-8")
    assert ok.status_code == 200
    client.post(url, data="1", content_type="text/plain;charset=UTF-8")  # close
