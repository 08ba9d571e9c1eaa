"""The run directory is untrusted: every file the dashboard reads is validated (issue 13, items 2 and 4).

Each test first writes what a buggy or hostile rank could write, then checks
that the rank is shown ``corrupt`` (or the file ignored) with a reason that
names the problem, that every other rank and route goes on, and that the
operator can still stop the job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.app import AUTH
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles, schema


def write_raw(run_dir, rank: int, data: bytes | str) -> None:
    path = runfiles.heartbeat_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    runfiles.atomic_write_bytes(path, data.encode() if isinstance(data, str) else data, fsync=False)


def healthy_job(run_dir, world: int = 3) -> None:
    write_job(run_dir, world)
    for r in range(world):
        write_heartbeat(run_dir, heartbeat(r, world, seq=1))


def rows(client) -> dict[int, dict]:
    resp = client.get("/api/ranks")
    assert resp.status_code == 200, resp.get_data(as_text=True)
    return {row["rank"]: row for row in resp.get_json()["ranks"]}


def wait_for(check, what: str, timeout: float = 15.0):
    """Poll ``check()`` until it returns a truthy value (the view refreshes once a tick)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        time.sleep(0.05)
    return got


def health_of(client, rank: int, wanted: str) -> dict | None:
    row = rows(client)[rank]
    return row if row["health"] == wanted else None


def assert_operator_can_stop(client, run_dir) -> None:
    """The stop path never depends on a rank's file: GET answers, POST writes the flag."""
    assert client.get("/api/exit").status_code == 200
    resp = client.post("/api/exit", json={"reason": "hostile file test"}, headers=AUTH)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    flag = runfiles.read_flag(run_dir)
    assert flag.exit and flag.request_id == resp.get_json()["request_id"]
    assert client.get("/api/exit").status_code == 200


def hostile(field: str, value) -> str:
    """Rank 1's heartbeat with ``field`` replaced by ``value`` (already JSON text)."""
    beat = heartbeat(1, 3, seq=2)
    beat[field] = "@@"
    return json.dumps(beat).replace('"@@"', value)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("cpu_percent", "9" * 401, "cpu_percent"),  # a 401-digit number where a float belongs
        ("pid", "-1", "pid"),  # psutil.Process(-1) raised, on this host
        ("stop", '{"stage": "seen", "at": [1, 2]}', "stop.at"),
        ("sync_every", "1000000000", "sync_every"),  # GET /api/exit sized an allocation by it
        ("time", '"yesterday"', "time"),
        ("rank", "true", "rank"),
        ("warnings", json.dumps(["x" * 600]), "warnings.0"),
        ("step_times_ms", json.dumps([1.0] * 500), "step_times_ms"),
    ],
)
def test_one_bad_field_makes_that_rank_corrupt_and_nothing_else(client, run_dir, field, value, named):
    healthy_job(run_dir)
    assert {r["health"] for r in rows(client).values()} == {"healthy"}
    write_raw(run_dir, 1, hostile(field, value))
    wait_for(lambda: health_of(client, 1, "corrupt"), "corrupt")
    got = rows(client)
    assert f"rank_1.json: {named}" in got[1]["reason"]
    assert "showing its last valid heartbeat" in got[1]["reason"]
    assert got[1]["global_step"] is not None  # the last valid figures stay
    assert got[0]["health"] == got[2]["health"] == "healthy"
    assert_operator_can_stop(client, run_dir)


def test_a_flag_nested_100000_deep_is_an_error_not_a_crash(client, run_dir):
    healthy_job(run_dir)
    runfiles.flag_path(run_dir).write_text("[" * 100_000)
    body = client.get("/api/exit").get_json()
    assert body["flag_error"] and "allowed" in body["flag_error"]  # refused unread: too large
    runfiles.flag_path(run_dir).write_text("[" * 20_000 + "]" * 20_000)
    body = client.get("/api/exit").get_json()
    assert "nested too deeply" in body["flag_error"]
    assert_operator_can_stop(client, run_dir)


def test_job_json_with_a_million_ranks_is_refused(client, run_dir):
    healthy_job(run_dir)
    write_job(run_dir, 1_000_000)
    body = wait_for(
        lambda: (b := client.get("/api/ranks").get_json())["run"]["message"].count("job.json") and b,
        "job.json refused",
    )
    assert body["world_size"] == 3 and len(body["ranks"]) == 3  # from the heartbeats
    assert "world_size" in body["run"]["message"]
    assert_operator_can_stop(client, run_dir)


def test_a_heartbeat_name_with_a_huge_rank_is_ignored(client, run_dir):
    healthy_job(run_dir)
    write_raw(run_dir, 99_999_999, json.dumps(heartbeat(99_999_999 % schema.MAX_RANKS, 3)))
    assert sorted(rows(client)) == [0, 1, 2]


def test_a_200_mb_heartbeat_is_refused_unread(client, run_dir):
    healthy_job(run_dir)
    path = runfiles.heartbeat_path(run_dir, 1)
    with open(path, "r+b") as f:  # sparse: 200 MB on paper, nothing on disk
        f.truncate(200 * 2**20)
    got = {1: wait_for(lambda: health_of(client, 1, "corrupt"), "corrupt")}
    assert "209715200 bytes" in got[1]["reason"]
    resp = client.get("/api/ranks")
    assert len(resp.get_data()) < 64 * 1024  # never served whole


def test_a_heartbeat_that_claims_another_rank_is_corrupt(client, run_dir):
    healthy_job(run_dir)
    write_raw(run_dir, 2, json.dumps(heartbeat(0, 3, seq=5)))
    row = wait_for(lambda: health_of(client, 2, "corrupt"), "corrupt")
    assert "holds the heartbeat of rank 0" in row["reason"]


def test_a_valid_heartbeat_after_a_bad_one_heals_the_rank(client, run_dir):
    healthy_job(run_dir)
    write_raw(run_dir, 1, "{not json")
    row = wait_for(lambda: health_of(client, 1, "corrupt"), "corrupt")
    assert "not valid JSON" in row["reason"]
    write_heartbeat(run_dir, heartbeat(1, 3, seq=3))
    wait_for(lambda: health_of(client, 1, "healthy"), "healthy again")


def test_a_heartbeat_from_the_future_is_clamped_and_flagged(client, run_dir):
    """Skew kept a rank whose process is gone healthy, and blanked every chart (item 12)."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = time.time()
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2, seq=1, now=now))
    future = heartbeat(1, 2, seq=1, now=now + 3600, pid=gone.pid, started_at=now - 10)
    write_heartbeat(run_dir, future)
    got = rows(client)
    assert got[1]["clock_skew_s"] >= 3590
    assert "ahead of the dashboard's" in got[1]["reason"]
    assert got[1]["heartbeat_age_s"] < 5
    history = client.get("/api/history").get_json()
    assert history["t"] and history["t"][-1] <= time.time() + 2  # no column in the future
    # Time passes; the clamped heartbeat ages, the probe finds the process gone.
    wait_for(lambda: health_of(client, 1, "dead"), "dead", timeout=30)


def test_history_lines_are_validated(run_dir):
    from app.run.heartbeats import read_history_tail

    healthy_job(run_dir, 1)
    with open(runfiles.history_path(run_dir, 0), "ab") as f:
        f.write(b'{"time": "x"}\n{"time": 5, "loss": [1]}\n' + b"[" * 5000 + b"\n")
        f.write(b'{"time": 7.5, "global_step": 9}\n')
    points = read_history_tail(run_dir, 0, 10)  # (t, global step, loss, step time)
    assert points[-1][:2] == (7.5, 9)
    assert all(isinstance(t, float) for t, *_ in points)


# ------------------------------------------------------------------ fuzzing

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated_heartbeat(draw) -> bytes:
    """A real heartbeat with some fields replaced by arbitrary JSON, or plain garbage."""
    kind = draw(st.sampled_from(["mutate", "garbage", "deep"]))
    if kind == "garbage":
        return draw(st.binary(max_size=200))
    if kind == "deep":
        depth = draw(st.integers(min_value=100, max_value=30_000))
        return b'{"rank": 1, "x": ' + b"[" * depth + b"]" * depth + b"}"
    beat = heartbeat(1, 3, seq=7)
    for name in draw(st.lists(st.sampled_from(sorted(beat)), min_size=1, max_size=4, unique=True)):
        beat[name] = draw(JSON)
    return json.dumps(beat).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=mutated_heartbeat(), job=JSON, flag=st.one_of(JSON.map(json.dumps), st.binary(max_size=60)))
def test_fuzzed_files_never_break_a_route_or_the_stop(client, run_dir, data, job, flag):
    healthy_job(run_dir)
    write_raw(run_dir, 1, data)
    runfiles.atomic_write_bytes(runfiles.job_path(run_dir), json.dumps(job).encode())
    flag_bytes = flag.encode() if isinstance(flag, str) else flag
    runfiles.atomic_write_bytes(runfiles.flag_path(run_dir), flag_bytes)
    os.utime(runfiles.heartbeat_path(run_dir, 1))  # a new stat key however fast the examples come
    for route in ("/api/ranks", "/api/summary", "/api/history", "/api/ranks/1", "/api/exit", "/metrics"):
        resp = client.get(route)
        assert resp.status_code < 500, (route, resp.get_data(as_text=True)[:500])
    got = rows(client)
    # Rank 1 may be anything a valid heartbeat can say (a mutated one may well be
    # stalled); the others are untouched.
    assert got[0]["health"] == got[2]["health"] == "healthy"
    resp = client.post("/api/exit", json={"reason": "fuzz"}, headers=AUTH)
    assert resp.status_code == 202, resp.get_data(as_text=True)
    assert runfiles.read_flag(run_dir).exit
