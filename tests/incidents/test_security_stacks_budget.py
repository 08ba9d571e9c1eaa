"""Issue 32, P10: junk stack captures must not add up across ranks.

The attack as the review ran it: 8 ranks, each with 32 junk "captures" of
512 KiB named newer than its real ones. Every tokenless ``GET /api/stacks``
then parsed 128 MiB (0.7 to 1.7 s), and the junk, counted against the
parsed-capture cache, flushed it on every request. What is counted here is
what each request read: the files parsed (a spy that calls through to the
real reader) and the process's own ``rchar`` from ``/proc/self/io``.
"""

from __future__ import annotations

import os
import time

import pytest

from app.incidents import captures
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.incidents import HUNG, fake_capture
from trainer_bridge.rundir import runfiles, stackfiles

pytestmark = pytest.mark.security

WORLD = 8
JUNK_PER_RANK = 32


def rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def plant(run_dir, now: float) -> None:
    write_job(run_dir, WORLD)
    junk = b"{" + b" " * (stackfiles.MAX_CAPTURE_BYTES - 2) + b"}"
    for r in range(WORLD):
        write_heartbeat(run_dir, heartbeat(r, WORLD))
        # A real capture behind the junk: 32 newer junk files hide it.
        fake_capture(run_dir, r, HUNG, at=now - 30)
        folder = runfiles.stack_captures_dir(run_dir, r)
        for i in range(JUNK_PER_RANK):
            (folder / f"{int(now * 1000) + 1000 + i:014d}-request.json").write_bytes(junk)
    # Rank 7's real capture is newer than its junk: it must be found on the
    # first request, however much junk the other ranks spend the budget on.
    fake_capture(run_dir, WORLD - 1, HUNG, at=now + 3600)


def test_junk_captures_across_ranks_cost_one_bounded_read_per_request(client, run_dir, monkeypatch):
    now = time.time()
    plant(run_dir, now)
    parsed = []
    real_load = stackfiles.load_capture

    def counting_load(path):
        parsed.append(os.stat(path).st_size)
        return real_load(path)

    monkeypatch.setattr(stackfiles, "load_capture", counting_load)

    def ask() -> tuple[dict, int, int]:
        parsed.clear()
        before = rchar()
        response = client.get("/api/stacks")
        assert response.status_code == 200
        return response.get_json(), sum(parsed), rchar() - before

    planted = WORLD * JUNK_PER_RANK * stackfiles.MAX_CAPTURE_BYTES
    first, nbytes, io = ask()
    print(
        f"first request: {len(parsed)} files, {nbytes} bytes parsed, rchar {io} (junk planted: {planted} bytes)"
    )
    assert nbytes <= captures.READ_BUDGET_BYTES < planted
    assert io <= captures.READ_BUDGET_BYTES + 4 * 1024 * 1024
    assert first["read"] == {"files": len(parsed), "bytes": nbytes}
    # Round-robin by depth: rank 7's real capture was read before anyone's second junk file.
    assert [WORLD - 1] in [g["ranks"] for g in first["groups"]]
    assert first["unread"], "the budget must have run out on the junk"
    assert not set(first["unread"]) & set(first["missing"])
    assert "not read yet" in first["text"]

    # Later requests read what is left, each within the budget, until every
    # junk file is remembered as invalid; then a request parses nothing.
    requests = 1
    answer = first
    while answer["unread"]:
        assert requests <= planted // captures.READ_BUDGET_BYTES + 1, "the reads made no progress"
        answer, nbytes, io = ask()
        requests += 1
        assert nbytes <= captures.READ_BUDGET_BYTES
        assert io <= captures.READ_BUDGET_BYTES + 4 * 1024 * 1024
    assert answer["missing"] == list(range(WORLD - 1))
    answer, nbytes, _ = ask()
    assert nbytes == 0 and parsed == [] and answer["read"]["bytes"] == 0
    assert answer["missing"] == list(range(WORLD - 1)) and answer["unread"] == []
    print(f"{requests} requests read the planted junk once; the next parsed 0 bytes")

    # The attacker rewrites every junk file (new mtimes): the cost per request stays bounded.
    for r in range(WORLD):
        for path in runfiles.stack_captures_dir(run_dir, r).iterdir():
            if path.stat().st_size == stackfiles.MAX_CAPTURE_BYTES:
                os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))
    answer, nbytes, _ = ask()
    assert 0 < nbytes <= captures.READ_BUDGET_BYTES
    assert [WORLD - 1] in [g["ranks"] for g in answer["groups"]]


def test_one_rank_full_of_junk_still_fits_one_request(client, run_dir):
    """``GET /api/ranks/<rank>/stack`` of a junk-filled rank answers in one request, within the budget."""
    now = time.time()
    plant(run_dir, now)
    response = client.get("/api/ranks/0/stack")
    assert response.status_code == 404  # its 32 newest files are junk: no valid capture among them
    assert "no stack capture of rank 0" in response.get_json()["error"]
    assert client.get(f"/api/ranks/{WORLD - 1}/stack").get_json()["rank"] == WORLD - 1
