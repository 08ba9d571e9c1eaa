"""Issue 13, item 3: deep verify needed no token, ran without bound, and believed any header.

12 requests started 12 MindSpore processes (4.8 GB); a 64-byte file
claiming a 40000x40000 tensor made the worker allocate 6.5 GB and then
report the truncated file as ``ok``. The worker here is the real one
(``verify_worker.py`` with MindSpore); the files are crafted by hand.
"""

from __future__ import annotations

import sys
import time

import psutil
import pytest

from app.checkpoints.verify import _Worker
from tests.helpers import ckptcraft
from tests.helpers.app import AUTH, make_app, wait_for_event
from tests.helpers.ckptcraft import HOSTILE_CKPT, HOSTILE_SAFETENSORS, ckpt, entry, tensor
from tests.helpers.heartbeats import write_job
from trainer_bridge.rundir.safeio import open_file

SET = "checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt#g"
WAIT = 180


def rank_file(global_step: int, params: int = 1) -> bytes:
    weights = [entry(f"layer{i}.weight", tensor([2, 2], "Float32", b"\0" * 16)) for i in range(params)]
    return ckpt(*weights, global_step=global_step)


@pytest.fixture
def app(run_dir):
    write_job(run_dir, 2)
    for g in (8, 16):
        for r in range(2):
            ckptcraft.write(run_dir / f"checkpoints/rank_{r}/rankwatch-1_{g}.ckpt", rank_file(g, params=3))
    app = make_app(run_dir, CHECKPOINT_SCAN_S=0.05)
    yield app
    app.extensions["rankwatch"].watcher.stop()


def listed(client, prefix: str) -> str:
    """The id of the set whose id starts with ``prefix``, once a re-scan lists it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ids = [s["id"] for s in client.get("/api/checkpoints").get_json()["sets"]]
        found = [i for i in ids if i.startswith(prefix)]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no set {prefix}* in {ids}")


def test_verify_needs_the_token(client):
    for headers in ({}, {"Authorization": "Bearer wrong-token-000000000000"}):
        r = client.post("/api/checkpoints/verify", json={"set": SET + "8"}, headers=headers)
        assert r.status_code == 401, r.get_json()
    # Nothing was started.
    assert client.get("/api/checkpoints/verify", query_string={"set": SET + "8"}).status_code == 404


def test_one_verify_at_a_time(client, sio):
    assert client.post("/api/checkpoints/verify", json={"set": SET + "8"}, headers=AUTH).status_code == 202
    other = client.post("/api/checkpoints/verify", json={"set": SET + "16"}, headers=AUTH)
    assert other.status_code == 409 and "one runs at a time" in other.get_json()["error"]
    same = client.post("/api/checkpoints/verify", json={"set": SET + "8"}, headers=AUTH)
    assert same.status_code == 409
    done = wait_for_event(sio, "checkpoint_verify", lambda e: e["state"] != "running", timeout=WAIT)
    assert done["state"] == "ok", done
    assert client.post("/api/checkpoints/verify", json={"set": SET + "16"}, headers=AUTH).status_code == 202
    wait_for_event(sio, "checkpoint_verify", lambda e: e["state"] != "running", timeout=WAIT)


@pytest.mark.parametrize(
    "name, data",
    [
        ("model-1_4.ckpt", HOSTILE_CKPT["40000x40000 in 26 bytes"]),
        ("model-1_4.safetensors", HOSTILE_SAFETENSORS["40000x40000 in 64 bytes"]),
    ],
)
def test_a_header_claiming_more_than_the_file_is_refused_before_loading(client, sio, run_dir, name, data):
    """The review's tiny file: refused as corrupt by the reader, never given to MindSpore."""
    st = ckptcraft.write(run_dir / "st/rank_0" / name, data)
    assert st.stat().st_size < 200
    set_id = listed(client, "st/")
    assert client.post("/api/checkpoints/verify", json={"set": set_id}, headers=AUTH).status_code == 202
    done = wait_for_event(sio, "checkpoint_verify", lambda e: e["state"] != "running", timeout=WAIT)
    assert done["state"] == "failed"
    files = client.get("/api/checkpoints/verify", query_string={"set": set_id}).get_json()["files"]
    assert not files[0]["ok"] and files[0]["error"].startswith("not loaded: "), files
    assert files[0]["seconds"] is None  # no load was attempted


@pytest.fixture
def worker():
    """A verify worker process (app/checkpoints/verify.py), closed after the test."""
    worker = _Worker(sys.executable)
    yield worker
    worker.close()


def test_the_worker_s_memory_limit_stops_what_the_reader_would_have(run_dir, worker):
    """Below the reader: the review's file given to the worker directly.

    MindSpore 2.10 loads a .ckpt whose tensor claims 40000x40000 with no
    content as 6.4 GB of zeros and reports success (measured: 6.6 GB peak,
    "ok"). Under the worker's memory limit the allocation fails instead.
    """
    path = ckptcraft.write(run_dir / "x/model-1_1.ckpt", HOSTILE_CKPT["40000x40000 in 26 bytes"])
    fd, _ = open_file(str(run_dir), "x/model-1_1.ckpt")
    result = worker.load(str(path), fd, "ckpt")
    if result is None:  # the loader died of it: also a failure, not an "ok"
        result = {"ok": False, "error": worker.died()}
    peak = psutil.Process(worker.proc.pid).memory_info().rss if worker.proc.poll() is None else 0
    assert result["ok"] is False, result
    assert "memory limit" in result["error"] or "MemoryError" in result["error"], result
    assert peak < 2 * 1024**3, peak


def test_a_file_cut_between_entries_is_not_ok(client, sio, run_dir):
    whole = rank_file(24, params=3)
    cut = ckpt(*[entry(f"layer{i}.weight", tensor([2, 2], "Float32", b"\0" * 16)) for i in range(2)])
    assert whole.startswith(cut)  # a clean prefix: well-formed protobuf
    ckptcraft.write(run_dir / "checkpoints/rank_0/rankwatch-1_24.ckpt", whole)
    ckptcraft.write(run_dir / "checkpoints/rank_1/rankwatch-1_24.ckpt", cut)
    listed(client, SET + "24")
    r = client.post("/api/checkpoints/verify", json={"set": SET + "24"}, headers=AUTH)
    assert r.status_code == 202, r.get_json()
    done = wait_for_event(sio, "checkpoint_verify", lambda e: e["state"] != "running", timeout=WAIT)
    assert done["state"] == "failed", done
    files = {
        f["rank"]: f
        for f in client.get("/api/checkpoints/verify", query_string={"set": SET + "24"}).get_json()["files"]
    }
    assert files[0]["ok"] and not files[1]["ok"], files
    assert files[1]["error"].startswith("probably truncated"), files[1]
