"""Issue 13, item 1: crafted checkpoints must be ``corrupt`` with a reason, never an exception.

A 2.9 KB ``.ckpt`` whose tensor claimed 300 dims of 2^62 made the index scan
raise (formatting a 5,000-digit byte count), so every checkpoint route
answered 500 and the bridge's resume scan would have crashed a relaunch; a
50,000-dim header took seconds, and nested or huge-shape ``.safetensors``
headers did the same. Each file of ``tests/helpers/ckptcraft.py`` is read here by
the reader, the index, the bridge's resume scan and the API.
"""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from app import create_app
from tests.helpers import ckptcraft
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.ckptcraft import HOSTILE_CKPT, HOSTILE_SAFETENSORS, ckpt, entry, tensor
from tests.helpers.heartbeats import write_job
from trainer_bridge.bridge import find_resume_point, served_requests
from trainer_bridge.rundir import ckptindex, ckptmeta, ckptpaths

HOSTILE = [(name, ".ckpt", data) for name, data in HOSTILE_CKPT.items()] + [
    (name, ".safetensors", data) for name, data in HOSTILE_SAFETENSORS.items()
]
IDS = [f"{ext[1:]}: {name}" for name, ext, _ in HOSTILE]
# What reading one hostile header may allocate: a few times the file, far
# below what its numbers claim (petabytes).
MEMORY_BOUND = 32 * 1024 * 1024


def good_rank_file(global_step: int) -> bytes:
    return ckpt(entry("fc.weight", tensor([2, 2], "Float32", b"\0" * 16)), global_step=global_step)


@pytest.mark.parametrize("name, ext, data", HOSTILE, ids=IDS)
def test_a_hostile_header_is_corrupt_with_a_reason_in_bounded_memory(tmp_path, name, ext, data):
    path = ckptcraft.write(tmp_path / f"rankwatch-1_1{ext}", data)
    tracemalloc.start()
    try:
        meta = ckptmeta.read_meta(path, with_params=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta.status == "corrupt", meta
    assert meta.reason and len(meta.reason) < 500, meta.reason
    assert peak < MEMORY_BOUND + 4 * len(data), peak
    meta.to_dict()  # JSON-ready, no giant numbers to format


def test_a_long_header_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    """Bounded time without a clock: the 50,000 dims are not all decoded, one varint each."""
    calls = 0
    varint = ckptmeta._Stream.varint

    def counting(self, what):
        nonlocal calls
        calls += 1
        return varint(self, what)

    monkeypatch.setattr(ckptmeta._Stream, "varint", counting)
    for name in ("50000 dims", "50000 packed dims"):
        calls = 0
        path = ckptcraft.write(tmp_path / "x.ckpt", HOSTILE_CKPT[name])
        meta = ckptmeta.read_meta(path)
        assert meta.status == "corrupt" and "dimensions" in meta.reason, meta.reason
        assert calls < 2 * ckptmeta.MAX_DIMS + 50, (name, calls)


def test_entry_and_field_counts_are_bounded(tmp_path, monkeypatch):
    """A file made of many tiny entries, or one message padded with unknown fields."""
    monkeypatch.setattr(ckptmeta.ckpt, "MAX_ENTRIES", 10)  # where the ckpt parser reads it
    many = ckptcraft.write(
        tmp_path / "many.ckpt", ckpt(*[entry(f"p{i}", tensor([1], "Float32", b"\0" * 4)) for i in range(11)])
    )
    assert ckptmeta.read_meta(many).reason == "not a checkpoint: more than 10 entries"
    padded = tensor([1], "Float32", b"\0" * 4) + (ckptcraft.varint(9 << 3) + b"\x01") * (
        ckptmeta.MAX_FIELDS + 1
    )
    meta = ckptmeta.read_meta(ckptcraft.write(tmp_path / "padded.ckpt", ckpt(entry("w", padded))))
    assert meta.reason == f"not a checkpoint: tensor 'w' has more than {ckptmeta.MAX_FIELDS} fields"


def test_the_reasons_say_what_is_wrong(tmp_path):
    def reason(name, ext, table):
        return ckptmeta.read_meta(ckptcraft.write(tmp_path / f"f{ext}", table[name])).reason

    assert "dimensions" in reason("300 dims of 2^62", ".ckpt", HOSTILE_CKPT)
    assert "needs 6400000000 bytes, the file holds 64" in reason(
        "claims more than the file", ".ckpt", HOSTILE_CKPT
    )
    assert "nested" in reason("nested header", ".safetensors", HOSTILE_SAFETENSORS)
    assert "dimensions" in reason("50000 dims", ".safetensors", HOSTILE_SAFETENSORS)
    assert "truncated" in reason("40000x40000 in 64 bytes", ".safetensors", HOSTILE_SAFETENSORS)


def hostile_run(run, world=2):
    """A good bridge set at step 8, and at step 16 a set whose rank 0 is each hostile file in turn."""
    write_job(run, world)
    for r in range(world):
        ckptcraft.write(run / f"checkpoints/rank_{r}/rankwatch-1_8.ckpt", good_rank_file(8))
        ckptcraft.write(run / f"checkpoints/rank_{r}/rankwatch-2_8.ckpt", good_rank_file(16))
    ckptcraft.write(run / "checkpoints/rank_0/rankwatch-2_8.ckpt", HOSTILE[0][2])
    for i, (_, ext, data) in enumerate(HOSTILE):
        ckptcraft.write(run / f"hostile/rank_0/net-1_{i + 1}{ext}", data)
    # A name that is not UTF-8, and one with a newline and quotes (download headers).
    ckptcraft.write(Path(os.fsdecode(bytes(run) + b"/odd/rank_0/n\xff\xfe-1_1.ckpt")), good_rank_file(1))
    ckptcraft.write(run / 'odd/rank_1/a"b\r\nSet-Cookie: x=1-1_1.ckpt', good_rank_file(1))
    # A rank number no job has, with no world size to bound it.
    ckptcraft.write(run / "other/rank_99999999999/net-1_1.ckpt", good_rank_file(1))


def test_the_index_and_the_bridge_resume_scan_never_raise(tmp_path):
    run = tmp_path / "run"
    hostile_run(run)
    for data in (d for _, _, d in HOSTILE):
        # Each hostile file as rank 0 of the newest bridge set.
        ckptcraft.write(run / "checkpoints/rank_0/rankwatch-2_8.ckpt", data)
        for world in (2, None):
            index = ckptindex.scan(run, world_size=world)
            served_requests(index)
            point = find_resume_point(index, 1)
            # The crafted set is incomplete, so the bridge resumes from the good one.
            assert point is not None and point.global_step == 8, point
            bad = [f for s in index.sets for f in s.files if f.path.startswith("hostile/")]
            assert len(bad) == len(HOSTILE) and not any(f.ok for f in bad)
    # The absurd rank number is not believed: no set claims 10^11 ranks.
    index = ckptindex.scan(run)
    assert all(s.world_size <= ckptpaths.MAX_RANK + 1 for s in index.sets)


def test_every_checkpoint_route_answers_with_hostile_files(tmp_path):
    run = tmp_path / "run"
    hostile_run(run)
    app = create_app({"RUN_DIR": str(run), "TESTING": True, **FAST_SETTINGS})
    client = app.test_client()
    listing = client.get("/api/checkpoints")
    assert listing.status_code == 200, listing.get_data()[:300]
    body = listing.get_json()
    assert body["bridge_resume"] == "checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt#g8"
    for s in body["sets"]:
        r = client.get("/api/checkpoints/resume", query_string={"set": s["id"]})
        assert r.status_code == 200, (s["id"], r.get_data()[:300])
        for f in s["files"]:
            r = client.get("/api/checkpoints/file", query_string={"path": f["path"]})
            assert r.status_code == 200, (f["path"], r.status_code)
    assert any("not valid UTF-8" in e for e in body["errors"]), body["errors"]
    for url in ("/api/ranks", "/api/exit", "/checkpoints", "/"):
        assert client.get(url).status_code == 200, url
    assert os.path.exists(run / "checkpoints/rank_0/rankwatch-1_8.ckpt")
