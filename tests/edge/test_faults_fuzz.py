"""Malformed input to every route and every Socket.IO event: a clear 4xx, never a 500, no change.

Hypothesis generates requests for every route in ``app.url_map`` (every
method it takes, plus some it does not): JSON bodies of random shapes,
random bytes, oversized bodies, unicode in several encodings, bodies with
the documented fields holding wrong types; query strings with ``../``,
``%2e%2e``, absolute paths, NUL bytes and unicode digits; and
Content-Type, Authorization, Origin and Sec-Fetch-Site variants. Every
answer must be below 500; every ``/api/`` error must have the one shape
``{"error": str, "status": int}``; and nothing may change: the flag file's
bytes, the audit trail (a refused attempt is audited only once it has passed
the token and body checks, which these requests never do) and the
checkpoint files.

The app and its run directory are built once per module (hypothesis runs
hundreds of examples against them); each example checks the state after.
"""

from __future__ import annotations

import json
import os
import re
import tracemalloc
import urllib.parse
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app import create_app
from app.extensions import socketio
from tests.helpers import ckptcraft
from tests.helpers.app import AUTH, FAST_SETTINGS, TOKEN
from tests.helpers.checkpoints import save_bridge_set
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

MAX_BODY = 4096  # small, so oversized bodies are cheap to generate
EXAMPLES = 200  # per route and test: the test client answers in about a millisecond

# ---------------------------------------------------------------- the fixture


@pytest.fixture(scope="module")
def fuzz_run(tmp_path_factory) -> Path:
    """A run directory with a 2-rank job, a served (re-armed) flag and one checkpoint set."""
    run = tmp_path_factory.mktemp("fuzz-run")
    write_job(run, 2)
    for r in range(2):
        for seq in (1, 2):
            write_heartbeat(run, heartbeat(r, 2, seq=seq))
    runfiles.write_flag(run, False, rearmed_after="req-1", last_request={"request_id": "req-1"})
    save_bridge_set(run, 8)
    return run


@pytest.fixture(scope="module")
def fuzz_app(fuzz_run):
    app = create_app(
        {
            "RUN_DIR": str(fuzz_run),
            "TESTING": True,
            **FAST_SETTINGS,
            "TOKEN": TOKEN,
            "MAX_BODY_BYTES": MAX_BODY,
            "CHECKPOINT_SCAN_S": 0.2,
        }
    )
    yield app
    app.extensions["rankwatch"].watcher.stop()


def fingerprint(run: Path, app) -> dict:
    """Everything a refused request must leave as it was."""
    files = {}
    for path in sorted(run.rglob("*")):
        rel = path.relative_to(run).as_posix()
        if path.is_file() and not rel.startswith(f"{runfiles.STATE_DIR}/audit.sqlite3"):
            st_ = path.stat()
            files[rel] = (st_.st_size, st_.st_mtime_ns)
    return {
        "flag": runfiles.flag_path(run).read_bytes(),
        "files": files,
        "audit": len(app.extensions["rankwatch"].stop.audit.rows()),
    }


# ---------------------------------------------------------------- what to send


def routes(app) -> list[tuple[str, tuple[str, ...]]]:
    """(rule, methods) for every rule: /api/, the pages and the static files."""
    out = []
    for rule in app.url_map.iter_rules():
        out.append((rule.rule, tuple(sorted(rule.methods - {"HEAD", "OPTIONS"}))))
    return sorted(out)


# The routes, known at collection so that each gets its own test and examples.
# create_app starts nothing (no thread, no scan), so this is cheap.
ROUTES = routes(create_app({"TESTING": True, "TOKEN": TOKEN}))
STATIC = Path(__file__).resolve().parents[2] / "static"


TRAVERSAL = [
    "../",
    "..",
    "../../etc/passwd",
    "%2e%2e/%2e%2e/etc/passwd",
    "%2e%2e%2f",
    "..%2f",
    "..%5c..%5cwindows",
    "/etc/passwd",
    "//etc/passwd",
    "\\\\server\\share",
    "\x00",
    "checkpoints/../../x",
    "checkpoints/rank_0/rankwatch-1_8.ckpt\x00.txt",
    "rankwatch/audit.sqlite3",
    "graceful_exit.json",
    "~root/.ssh/id_rsa",
    "checkpoints/rank_0/rankwatch-1_8.ckpt",
    "-1",
    "0",
    "1e9",
    "9" * 5000,
    "²",
    "١٢",
    " 5",
    "5 ",
    "NaN",
    "null",
    "[]",
    "{}",
    "dead,stalled",
    ",,",
    "healthy,\u2028",
]
# Keys the routes read, and others.
QUERY_KEYS = ["path", "set", "limit", "points", "health", "rank", "token", "x", "__proto__", ""]
text = st.text(max_size=40)
query_value = st.one_of(st.sampled_from(TRAVERSAL), text)
query = st.one_of(
    st.dictionaries(st.sampled_from(QUERY_KEYS) | text, query_value, max_size=4).map(
        lambda d: urllib.parse.urlencode(d, safe="%")
    ),
    st.lists(
        st.sampled_from(
            [
                "path=",
                "set=",
                "limit=",
                "points=",
                "health=",
                "%00",
                "%2e%2e",
                "&",
                "=",
                "%",
                "%zz",
                "..",
                "/",
            ]
        )
        | text.map(urllib.parse.quote),
        max_size=6,
    ).map("".join),
)

json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ["reason", "who", "force", "token", "set", "GracefulExit", "request_id"]
# The documented fields, with values of any type (gets past the unknown-field check).
known_fields = st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=4)


def encode(value) -> bytes:
    return json.dumps(value).encode()


body = st.one_of(
    st.just(b""),
    json_value.map(encode),
    known_fields.map(encode),
    st.binary(max_size=300),
    st.text(max_size=100).flatmap(
        lambda t: st.sampled_from(
            [
                t.encode("utf-8"),
                t.encode("utf-16"),
                t.encode("utf-8", "surrogatepass"),
                encode({"reason": t}),
                encode({"reason": t}).replace(b'"', b"'"),
            ]
        )
    ),
    st.integers(MAX_BODY - 10, 4 * MAX_BODY).map(lambda n: encode({"reason": "x" * n})),
    st.just(b'{"reason": "' + b"\xff\xfe" * 10 + b'"}'),
    st.just(b'{"reason": "a", "reason": 5}'),
    st.just(b"[" * 5000 + b"]" * 5000),  # deep nesting
)

CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-8",
    "application/json; charset=utf-16",
    "application/json; charset=bogus",
    "APPLICATION/JSON",
    "application/problem+json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zz",
    "multipart/form-data",
    "",
    "application/json\x7f",
]
WRONG_AUTH = [
    None,
    "",
    "Bearer",
    "Bearer ",
    "Bearer wrong",
    "bearer wrong",
    "Basic Zm9vOmJhcg==",
    f"Bearer {TOKEN}x",
    f"Token {TOKEN}",
    f"Bearer {TOKEN[:-1]}",
    "Bearer \u00e9\u00e8",
    "Bearer " + "A" * 5000,
    f"{TOKEN}",
]
RIGHT_AUTH = [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"Bearer   {TOKEN}  "]
ORIGINS = [None, None, "http://localhost", "http://evil.example", "null"]
FETCH_SITES = [None, None, "same-origin", "cross-site", "none", "same-site"]
METHODS_EXTRA = ["GET", "POST", "PUT", "DELETE", "PATCH"]


@st.composite
def request_for(draw, rule: str, methods: tuple[str, ...], auth: list[str | None]):
    path = rule
    for name in re.findall(r"<(?:\w+:)?(\w+)>", rule):
        value = draw(
            st.one_of(st.integers(-3, 10**30).map(str), st.sampled_from(TRAVERSAL), st.text(max_size=10))
        )
        path = re.sub(rf"<(?:\w+:)?{name}>", urllib.parse.quote(value, safe=""), path)
    method = draw(st.sampled_from(methods) | st.sampled_from(METHODS_EXTRA))
    headers = {}
    for name, choices in (
        ("Content-Type", CONTENT_TYPES),
        ("Authorization", auth),
        ("Origin", ORIGINS),
        ("Sec-Fetch-Site", FETCH_SITES),
    ):
        value = draw(st.sampled_from(choices))
        if value is not None:
            headers[name] = value
    return method, path, draw(query), draw(body), headers


def send(client, method, path, query_string, data, headers):
    url = path + ("?" + query_string if query_string else "")
    return client.open(url, method=method, data=data, headers=headers)


def check_answer(response, path: str, query_string: str, known_files: set[str]) -> None:
    status = response.status_code
    assert status < 500, (status, response.get_data()[:500])
    if path.startswith("/api/") and status >= 400:
        body = response.get_json(silent=True)
        assert isinstance(body, dict) and set(body) == {"error", "status"}, response.get_data()[:300]
        assert isinstance(body["error"], str) and body["error"]
        assert body["status"] == status
    if path == "/api/checkpoints/file" and status < 300:
        # Only a listed checkpoint is ever served.
        asked = urllib.parse.parse_qs(query_string).get("path", [""])[0]
        assert asked in known_files, asked
    if path.startswith("/static/") and status < 300:
        # Only files under static/ are ever served.
        served = (STATIC / urllib.parse.unquote(path[len("/static/") :])).resolve()
        assert served.is_relative_to(STATIC), path


# ---------------------------------------------------------------- the tests

SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


def test_every_route_is_fuzzed(fuzz_app):
    """The routes fuzzed are the app's: every /api/ route, the pages, the static files."""
    assert ROUTES == routes(fuzz_app)
    rules = {rule for rule, _ in ROUTES}
    assert {
        "/api/ranks",
        "/api/exit",
        "/api/exit/cancel",
        "/api/exit/rearm",
        "/api/session",
        "/api/checkpoints/file",
        "/api/checkpoints/delete",
        "/",
        "/static/<path:filename>",
    } <= rules


@pytest.mark.parametrize("rule, methods", ROUTES, ids=[r for r, _ in ROUTES])
def test_malformed_requests_without_the_token_change_nothing(fuzz_app, fuzz_run, rule, methods):
    client = fuzz_app.test_client()
    before = fingerprint(fuzz_run, fuzz_app)
    known = {f["path"] for s in client.get("/api/checkpoints").get_json()["sets"] for f in s["files"]}

    @SETTINGS
    @given(request_for(rule, methods, WRONG_AUTH))
    def run(req):
        method, path, query_string, data, headers = req
        response = send(client, method, path, query_string, data, headers)
        check_answer(response, path, query_string, known)
        if (
            method != "GET"
            and path.startswith("/api/")
            and path not in ("/api/session", "/api/checkpoints/verify")
        ):
            # State-changing routes: nothing passes without the token.
            assert response.status_code >= 400, (path, response.get_data()[:200])
        assert fingerprint(fuzz_run, fuzz_app) == before

    run()


def invalid(value) -> bytes:
    """A body no route accepts: an unknown field, or not a JSON object at all."""
    if isinstance(value, dict):
        return encode({**value, "zz_unknown_field": 1})
    return encode(value) if not isinstance(value, bytes) else value


POSTS = [rule for rule, methods in ROUTES if "POST" in methods]


@pytest.mark.parametrize("rule", POSTS)
def test_malformed_bodies_with_the_token_are_4xx_and_change_nothing(fuzz_app, fuzz_run, rule):
    client = fuzz_app.test_client()
    before = fingerprint(fuzz_run, fuzz_app)
    bad_body = st.one_of(
        known_fields,
        st.lists(json_value, max_size=3),
        st.text(max_size=20),
        st.integers(),
        st.binary(min_size=1, max_size=100).filter(lambda b: not b.strip().startswith(b"{")),
    ).map(invalid)

    @SETTINGS
    @given(
        bad_body,
        st.sampled_from(RIGHT_AUTH),
        st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", None]),
    )
    def run(data, auth, content_type):
        headers = {"Authorization": auth}
        if content_type:
            headers["Content-Type"] = content_type
        response = client.post(rule, data=data, headers=headers)
        check_answer(response, rule, "", set())
        assert 400 <= response.status_code < 500, (rule, data[:100], response.get_json())
        assert fingerprint(fuzz_run, fuzz_app) == before

    run()


@pytest.mark.parametrize("value", ["²", "9" * 5000, "١٢", "0x10", "-1", "1" * 30])
@pytest.mark.parametrize("url", ["/api/audit?limit={}", "/api/history?points={}"])
def test_integer_query_parameters_are_4xx_or_answered(fuzz_app, url, value):
    """Regressions: unicode digits and 5000-digit numbers passed ``str.isdigit`` and
    then crashed ``int()``."""
    r = fuzz_app.test_client().get(url.format(urllib.parse.quote(value)))
    assert r.status_code in (200, 400), r.get_data()[:300]
    if r.status_code == 400:
        assert set(r.get_json()) == {"error", "status"}


def test_oversized_body_is_413_in_the_error_shape(fuzz_app, fuzz_run):
    before = fingerprint(fuzz_run, fuzz_app)
    r = fuzz_app.test_client().post(
        "/api/exit",
        data=encode({"reason": "x" * (2 * MAX_BODY)}),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and r.get_json()["status"] == 413
    assert fingerprint(fuzz_run, fuzz_app) == before


# ---------------------------------------------------------------- Socket.IO

socket_payload = st.one_of(json_value, st.binary(max_size=100), st.text(max_size=200))


def registered_events() -> list[str]:
    return sorted({event for event, _, _ in socketio.handlers})


def test_socket_garbage_to_every_handler_and_unknown_events(fuzz_app, fuzz_run):
    """Unknown events and any payload: no crash, no error event, the server still serves."""
    events = registered_events()
    assert "connect" in events
    before = fingerprint(fuzz_run, fuzz_app)
    flask_client = fuzz_app.test_client()

    @settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.sampled_from(events) | st.text(min_size=1, max_size=30),
        socket_payload,
        st.lists(socket_payload, max_size=3),
        json_value,
    )
    def run(event, payload, extra, auth):
        sio = socketio.test_client(
            fuzz_app, flask_test_client=flask_client, auth=auth if isinstance(auth, dict) else None
        )
        try:
            if isinstance(auth, dict) and isinstance(auth.get("token"), str):
                assert not sio.is_connected()  # a wrong token is refused (issue 32, P11)
                return
            assert sio.is_connected()
            first = [e["name"] for e in sio.get_received()]
            assert "ranks_snapshot" in first
            if event not in ("connect", "disconnect"):
                sio.emit(event, payload, *extra)
            received = sio.get_received()
            assert all(not e["name"].startswith("error") for e in received), received
            text = json.dumps(received, default=str)
            assert "Traceback" not in text
        finally:
            if sio.is_connected():
                sio.disconnect()

    run()
    # Still serving, and nothing changed.
    assert flask_client.get("/api/ranks").status_code == 200
    assert fingerprint(fuzz_run, fuzz_app) == before


def test_socket_connect_with_garbage_auth_still_gets_the_snapshot(fuzz_app):
    for auth in ({"token": None}, {"token": 5}, {"\x00": "\ud7ff"}, {"a": {"b": [1, 2, None]}}):
        sio = socketio.test_client(fuzz_app, auth=auth)
        try:
            assert sio.is_connected()
            assert any(e["name"] == "ranks_snapshot" for e in sio.get_received())
        finally:
            sio.disconnect()


def test_no_run_dir_path_is_served_outside_the_checkpoints(fuzz_app, fuzz_run):
    """A direct check of the worst case: the flag, the audit file and /etc/passwd are never sent."""
    client = fuzz_app.test_client()
    for rel in (
        "graceful_exit.json",
        "rankwatch/audit.sqlite3",
        "rankwatch/job.json",
        "/etc/passwd",
        "../" * 8 + "etc/passwd",
        "%2e%2e/%2e%2e/etc/passwd",
        os.path.join(str(fuzz_run), "graceful_exit.json"),
    ):
        r = client.get("/api/checkpoints/file?" + urllib.parse.urlencode({"path": rel}))
        assert r.status_code in (400, 404), (rel, r.status_code)


# ---------------------------------------------------------------- Engine.IO underneath


def polling_session(client) -> str:
    r = client.get("/socket.io/?EIO=4&transport=polling")
    assert r.status_code == 200, r.data
    return json.loads(r.data[1:])["sid"]


packet_text = st.one_of(
    st.sampled_from(
        [
            "0",
            "1",
            "2",
            "3",
            "4",
            "5",
            "6",
            "7",
            "40",
            "41",
            "42",
            "4x",
            "b",
            "b!!",
            '42["connect"]',
            '42["ranks_snapshot",{}]',
            "42[1,2,3]",
            "43[]",
            "44",
            '40{"token":5}',
            "42" + "[" * 2000,
            "2probe",
            "3probe",
        ]
    ),
    st.text(max_size=40).map(lambda t: "4" + t),
    st.text(max_size=20),
)
eio_body = st.one_of(
    st.lists(packet_text, max_size=4).map(lambda ps: "\x1e".join(ps).encode("utf-8", "surrogatepass")),
    st.binary(max_size=60),
)


def test_engineio_polling_refusal_has_the_error_shape(fuzz_app):
    client = fuzz_app.test_client()
    sid = polling_session(client)
    r = client.post(
        f"/socket.io/?EIO=4&transport=polling&sid={sid}", data="2", content_type="text/plain;charset=UTF-8"
    )
    assert r.status_code == 400
    assert r.get_json() == {"error": "unexpected Engine.IO packet type", "status": 400}


def test_engineio_polling_garbage_is_refused_without_500_or_hang(fuzz_app, fuzz_run):
    """Raw long-polling traffic below the Socket.IO test client: python-engineio hung a
    request thread for good on a POSTed PING/NOOP/unknown packet (app/edge/sockguard.py)."""
    client = fuzz_app.test_client()
    before = fingerprint(fuzz_run, fuzz_app)

    @settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        eio_body,
        st.sampled_from(["", "&sid=nope", "&t=%00", "&EIO=3", "&transport=websocket"]),
        st.booleans(),
    )
    def run(data, junk, open_first):
        sid = polling_session(client) if open_first else "nope"
        r = client.post(
            f"/socket.io/?EIO=4&transport=polling&sid={sid}{junk}",
            data=data,
            content_type="text/plain;charset=UTF-8",
        )
        assert r.status_code < 500, (data, r.status_code, r.data[:200])
        r = client.get(f"/socket.io/?EIO=4&transport=polling{junk}")
        assert r.status_code < 500, (junk, r.status_code)

    run()
    assert client.get("/api/ranks").status_code == 200
    assert fingerprint(fuzz_run, fuzz_app) == before


# ---------------------------------------------------------------- checkpoint headers
#
# The files, not only the routes (issue 13): Hypothesis writes .ckpt protobuf
# and .safetensors headers with any dims, shapes, types, offsets, nesting and
# lengths, then cuts, pads or flips them. Invariants: the reader never raises
# and stays within a memory bound; the index and the bridge's resume scan
# never raise; no checkpoint route answers 500.

BIG_INTS = [2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 40000, -1, -(2**63)]
CKPT_TYPES = [
    "Float32",
    "Float16",
    "BFloat16",
    "Int64",
    "Int32",
    "Int8",
    "UInt8",
    "Bool",
    "Float64",
    "str",
    "Int4",
]
ST_TYPES = ["F32", "F16", "BF16", "I64", "I32", "I8", "U8", "BOOL", "F64", "F8_E4M3", "C64"]
dim = st.one_of(st.integers(0, 8), st.sampled_from(BIG_INTS), st.integers(-(2**70), 2**70))
dims = st.one_of(st.lists(dim, max_size=6), st.lists(dim, min_size=60, max_size=300))
ckpt_tensor = st.builds(
    lambda d, t, c, p: ckptcraft.tensor(d, t, c, packed=p),
    dims,
    st.sampled_from(CKPT_TYPES) | st.text(max_size=8),
    st.binary(max_size=48),
    st.booleans(),
)
ckpt_entry = st.builds(
    lambda tag, body: ckptcraft.entry(tag, body),
    st.text(min_size=1, max_size=12) | st.sampled_from(["global_step", "epoch_num", "step_num", "batch_num"]),
    ckpt_tensor | st.binary(max_size=40),
)
ckpt_body = st.lists(ckpt_entry, min_size=1, max_size=6).map(lambda es: ckptcraft.ckpt(*es))
st_entry = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from(ST_TYPES) | st.text(max_size=6),
        "shape": st.one_of(st.lists(dim, max_size=6), st.lists(dim, min_size=60, max_size=200), json_value),
        "data_offsets": st.one_of(
            st.lists(dim, min_size=2, max_size=2), st.lists(dim, max_size=3), json_value
        ),
    }
)
st_header = st.dictionaries(
    st.text(max_size=10) | st.just("__metadata__"), st_entry | json_value, max_size=5
).map(lambda h: json.dumps(h).encode())
nested = st.integers(10, 50_000).map(lambda n: b'{"w":' + b"[" * n + b"]" * n + b"}")
st_body = st.builds(
    lambda header, data: ckptcraft.safetensors(header, data), st_header | nested, st.binary(max_size=64)
) | st.binary(min_size=8, max_size=80)


@st.composite
def damaged(draw, body):
    """A generated body, then cut, padded, flipped or given a CRC trailer, or left whole."""
    data = draw(body)
    how = draw(st.sampled_from(["whole", "cut", "pad", "flip", "crc"]))
    if how == "cut" and len(data) > 1:
        data = data[: draw(st.integers(1, len(data) - 1))]
    elif how == "pad":
        data += draw(st.binary(min_size=1, max_size=32))
    elif how == "flip" and data:
        i = draw(st.integers(0, len(data) - 1))
        data = data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    elif how == "crc":
        data += b"crc_num" + draw(st.binary(min_size=10, max_size=10))
    return data


checkpoint_file = st.one_of(
    st.tuples(st.just(".ckpt"), damaged(ckpt_body)), st.tuples(st.just(".safetensors"), damaged(st_body))
)
# What reading one generated header may allocate: far below what its numbers claim.
READ_MEMORY_BOUND = 32 * 1024 * 1024


def good_rank(global_step: int) -> bytes:
    return ckptcraft.ckpt(
        ckptcraft.entry("w", ckptcraft.tensor([2], "Float32", b"\0" * 8)), global_step=global_step
    )


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(checkpoint_file)
def test_checkpoint_headers_never_raise_in_the_reader_index_or_resume_scan(tmp_path_factory, example):
    from trainer_bridge.bridge import find_resume_point, served_requests
    from trainer_bridge.rundir import ckptindex, ckptmeta

    ext, data = example
    run = tmp_path_factory.mktemp("ckpt-fuzz")
    for r in (0, 1):
        ckptcraft.write(run / f"checkpoints/rank_{r}/rankwatch-1_8.ckpt", good_rank(8))
    ckptcraft.write(run / f"checkpoints/rank_1/rankwatch-1_9{ext}", good_rank(9))
    path = ckptcraft.write(run / f"checkpoints/rank_0/rankwatch-1_9{ext}", data)

    tracemalloc.start()
    try:
        meta = ckptmeta.read_meta(path, with_params=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta.status in ("ok", "corrupt")
    assert peak < READ_MEMORY_BOUND + 8 * len(data), peak
    json.dumps(meta.to_dict())
    if meta.ok and meta.param_bytes is not None:
        assert meta.param_bytes <= len(data)

    for world in (2, None):
        index = ckptindex.scan(run, world_size=world)
        served_requests(index)
        point = find_resume_point(index, 0)
        assert point is not None  # the good set at step 8 is always there
        assert ckptmeta.read_meta(point.path).ok
        json.dumps(index.to_dict())


@pytest.fixture(scope="module")
def ckpt_fuzz_app(tmp_path_factory):
    run = tmp_path_factory.mktemp("ckpt-routes-fuzz")
    write_job(run, 2)
    for r in (0, 1):
        ckptcraft.write(run / f"checkpoints/rank_{r}/rankwatch-1_8.ckpt", good_rank(8))
    app = create_app(
        {
            "RUN_DIR": str(run),
            "TESTING": True,
            **FAST_SETTINGS,
            "TOKEN": TOKEN,
            "OPERATOR_WRITES_PER_MIN": 10**6,
        }
    )
    yield app, run
    app.extensions["rankwatch"].watcher.stop()


@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(checkpoint_file, min_size=1, max_size=3), st.booleans())
def test_no_checkpoint_route_answers_500_with_generated_headers(ckpt_fuzz_app, examples, delete):
    app, run = ckpt_fuzz_app
    client = app.test_client()
    written = []
    for i, (ext, data) in enumerate(examples):
        written.append(ckptcraft.write(run / f"fuzz/rank_{i % 2}/net-1_{i + 20}{ext}", data))
    app.extensions["rankwatch"].checkpoints.index(0, force=True)
    body = client.get("/api/checkpoints")
    assert body.status_code == 200, body.get_data()[:300]
    sets = body.get_json()["sets"]
    for s in sets:
        for url, query in (
            ("/api/checkpoints/resume", {"set": s["id"]}),
            ("/api/checkpoints/verify", {"set": s["id"]}),
        ):
            r = client.get(url, query_string=query)
            assert r.status_code < 500, (url, r.get_data()[:300])
        for f in s["files"]:
            r = client.get("/api/checkpoints/file", query_string={"path": f["path"]})
            assert r.status_code < 500, r.get_data()[:300]
        if delete and s["id"].startswith("fuzz/"):
            r = client.post(
                "/api/checkpoints/delete",
                json={"set": s["id"], "reason": "fuzz", "force": True},
                headers=AUTH,
            )
            assert r.status_code < 500, r.get_data()[:300]
    for path in written:
        path.unlink(missing_ok=True)
    # The good set was never touched, and is still the one the bridge resumes from.
    assert client.get("/api/checkpoints").get_json()["bridge_resume"].endswith("#g8")
