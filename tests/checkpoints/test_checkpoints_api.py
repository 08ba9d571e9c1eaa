"""The checkpoint browser's API and events on a run directory filled by real MindSpore.

One module-scoped directory holds every layout, written once: bridge sets
(``save_checkpoint`` with the bridge's ``append_dict``, one incomplete), a
real ``Model.train`` with ``ModelCheckpoint`` on two "ranks", a safetensors
series, a series saved with a CRC (one copy flipped afterwards), and a
series whose rank 0 is good and ranks 1-4 are damaged in the four ways a
file goes bad, and a TTP save (one copy per replica group: ranks 0 and 2). Each test copies it into its own run directory, so deletes
never leak between tests. Helpers are shared with the browser test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import mindspore.dataset as mds
import numpy as np
import pytest
from mindspore import nn
from mindspore.train import CheckpointConfig, Model, ModelCheckpoint

from app.checkpoints.indexbody import apply_delta
from tests.helpers.app import AUTH, TOKEN, make_app, operator, wait_for_event, wait_for_index
from tests.helpers.checkpoints import (
    BRIDGE,
    DAMAGED,
    STEPS_PER_EPOCH,
    Small,
    _Samples,
    bridge_id,
    save_bridge_set,
    save_small,
    write_damaged,
)
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

REPO = Path(__file__).resolve().parents[2]
MODELCKPT = "ckpt/rank_{rank}/train-{E}_{S}.ckpt"
SAFETENSORS = "st/rank_{rank}/model-{E}_{S}.safetensors"
CRC = "crc/rank_{rank}/net-{E}_{S}.ckpt"
TTP = "ttp/tft_saved_checkpoints-step_{G}/rank_{rank}/ttp_rank_{rank}-{E}_{S}.ckpt"


def _train_with_modelcheckpoint(run: Path) -> None:
    """2 epochs of 4 steps; ModelCheckpoint saves every 4 steps into ckpt/rank_0 and ckpt/rank_1."""
    data = mds.GeneratorDataset(_Samples(), ["x", "y"], shuffle=False).batch(4)
    net = Small()
    model = Model(
        net,
        nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
        nn.Momentum(net.trainable_params(), 0.01, 0.9),
    )
    config = CheckpointConfig(save_checkpoint_steps=4, keep_checkpoint_max=5)
    callbacks = [
        ModelCheckpoint(prefix="train", directory=str(run / "ckpt" / f"rank_{r}"), config=config)
        for r in (0, 1)
    ]
    model.train(2, data, callbacks=callbacks, dataset_sink_mode=False)


def write_layouts(run: Path) -> None:
    for g in (10, 20):
        save_bridge_set(run, g)
    save_bridge_set(run, 30, ranks=(0,))
    _train_with_modelcheckpoint(run)
    for r in (0, 1):
        save_small(
            run / "st" / f"rank_{r}" / "model-2_7.safetensors",
            {"epoch_num": 2, "step_num": 15, "batch_num": STEPS_PER_EPOCH, "global_step": 15},
            fmt="safetensors",
        )
        save_small(
            run / "crc" / f"rank_{r}" / "net-1_3.ckpt",
            {"epoch_num": 1, "step_num": 3, "batch_num": STEPS_PER_EPOCH, "global_step": 3},
            crc_check=True,
        )
    flipped = run / "crc" / "rank_1" / "net-1_3.ckpt"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a tensor: the structure still parses, the CRC does not match
    flipped.chmod(0o600)
    flipped.write_bytes(bytes(data))
    write_damaged(run, "damaged", "net-1_2.ckpt", global_step=2)
    for r in (0, 2):
        save_small(
            run / "ttp" / "tft_saved_checkpoints-step_12" / f"rank_{r}" / f"ttp_rank_{r}-2_4.ckpt",
            {"epoch_num": 2, "step_num": 12, "batch_num": STEPS_PER_EPOCH, "global_step": 12},
        )


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("layouts")
    write_layouts(run)
    return run


@pytest.fixture
def app(run_dir, layouts):
    """The dashboard on a private copy of every layout, with a fast re-scan."""
    shutil.copytree(layouts, run_dir, dirs_exist_ok=True)
    app = make_app(run_dir, CHECKPOINT_SCAN_S=0.2)
    yield app
    app.extensions["rankwatch"].watcher.stop()


def sets_by_id(client) -> dict[str, dict]:
    return {s["id"]: s for s in client.get("/api/checkpoints").get_json()["sets"]}


def assert_error(response, status: int) -> dict:
    body = response.get_json()
    assert response.status_code == status, body
    assert set(body) == {"error", "status"} and body["status"] == status and body["error"]
    return body


# -- the index ----------------------------------------------------------------------------


def test_sets_are_grouped_by_step_with_the_newest_complete_marked(client):
    body = client.get("/api/checkpoints").get_json()
    sets = {s["id"]: s for s in body["sets"]}
    assert body["newest_complete"] == bridge_id(20)
    assert body["bridge_resume"] == bridge_id(20)
    assert body["world_size_source"] == "layout"
    steps = [s["global_step"] for s in body["sets"]]
    assert steps == sorted(steps, reverse=True)

    newest = sets[bridge_id(20)]
    assert (newest["origin"], newest["complete"], newest["epoch"], newest["step"]) == (
        "graceful stop",
        True,
        3,
        4,
    )
    assert newest["ranks_present"] == [0, 1] and newest["ranks_missing"] == []
    assert [f["path"] for f in newest["files"]] == [
        f"checkpoints/rank_{r}/rankwatch-3_4.ckpt" for r in (0, 1)
    ]
    for f in newest["files"]:
        assert (f["format"], f["status"], f["global_step"]) == ("ckpt", "ok", 20)
        assert f["bytes"] > 0
    assert newest["bytes"] == sum(f["bytes"] for f in newest["files"])
    assert newest["age_s"] >= 0
    assert any("bridge resumes" in n for n in newest["notes"])

    partial = sets[bridge_id(30)]
    assert partial["complete"] is False
    assert partial["ranks_present"] == [0] and partial["ranks_missing"] == [1]
    assert any("no readable file for rank 1:" in n for n in partial["notes"])
    assert sets[bridge_id(10)]["complete"] is True
    assert body["total_bytes"] == sum(s["bytes"] for s in body["sets"])


def test_modelcheckpoint_and_safetensors_layouts(client):
    sets = sets_by_id(client)
    periodic = {s["global_step"]: s for s in sets.values() if s["layout"] == MODELCKPT}
    assert sorted(periodic) == [4, 8]
    assert (periodic[8]["origin"], periodic[8]["epoch"], periodic[8]["step"]) == ("periodic", 2, 4)
    assert all(s["complete"] and s["ranks_present"] == [0, 1] for s in periodic.values())

    st = sets[f"{SAFETENSORS}#g15"]
    assert st["complete"] and {f["format"] for f in st["files"]} == {"safetensors"}
    assert (st["epoch"], st["step"]) == (2, 7)


def test_each_kind_of_damage_is_corrupt_with_a_reason(client):
    damaged = sets_by_id(client)[f"{DAMAGED}#g2"]
    assert damaged["complete"] is False
    assert damaged["ranks_present"] == [0] and damaged["ranks_corrupt"] == [1, 2, 3, 4]
    reasons = {f["rank"]: (f["status"], f["reason"]) for f in damaged["files"]}
    assert reasons[0] == ("ok", None)
    assert reasons[1][0] == "corrupt" and reasons[1][1].startswith("truncated")
    assert reasons[2] == ("corrupt", "empty file")
    assert reasons[3][0] == "corrupt" and reasons[3][1].startswith("not a checkpoint")
    assert reasons[4] == ("corrupt", "not a checkpoint: it looks like JSON")
    assert any("unreadable file on ranks 1, 2, 3, 4" in n for n in damaged["notes"])


def test_a_ttp_set_says_why_missing_ranks_may_not_matter(client, run_dir):
    ttp = sets_by_id(client)[f"{TTP}#g12"]
    assert (ttp["origin"], ttp["complete"], ttp["ranks_missing"]) == ("TTP", False, [1])
    assert any(n.startswith("TTP saves one copy per replica group") for n in ttp["notes"])
    r = client.post("/api/checkpoints/delete", json={"set": ttp["id"], "reason": "old"}, headers=AUTH)
    assert r.get_json()["removed_dirs"] == [
        "ttp/tft_saved_checkpoints-step_12",
        "ttp/tft_saved_checkpoints-step_12/rank_0",
        "ttp/tft_saved_checkpoints-step_12/rank_2",
    ]
    assert (run_dir / "ttp").is_dir() and not any((run_dir / "ttp").iterdir())


def test_world_size_comes_from_the_job(client, run_dir):
    write_job(run_dir, 4)
    body = client.get("/api/checkpoints").get_json()
    assert (body["world_size"], body["world_size_source"]) == (4, "job")
    newest = {s["id"]: s for s in body["sets"]}[bridge_id(20)]
    assert newest["complete"] is False and newest["ranks_missing"] == [2, 3]
    assert body["newest_complete"] is None


def test_the_page_is_listed_in_the_nav(client):
    page = client.get("/checkpoints")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert 'href="/checkpoints" aria-current="page"' in html
    assert 'href="/checkpoints"' in client.get("/").get_data(as_text=True)


def test_a_connecting_client_gets_the_index_and_new_files_arrive_live(sio, client, run_dir):
    first = wait_for_index(sio)
    assert first["newest_complete"] == bridge_id(20) and first["version"] is not None
    save_bridge_set(run_dir, 40)
    pushed = wait_for_index(sio, lambda b: b["newest_complete"] == bridge_id(40))
    assert {s["id"] for s in pushed["sets"]} >= {bridge_id(40), bridge_id(20)}
    # The deltas applied make the index the API gives (but the times of the answer): to a viewer
    # (no token on this socket), as a viewer's GET answers (app.edge.auth.redact_run_dir).
    api = client.get("/api/checkpoints").get_json()
    assert pushed["version"] >= 2 and pushed.pop("version") is not None
    for body in (api, pushed):
        for k in ("now", "scanned_at"):
            body.pop(k)
        for s in body["sets"]:
            s.pop("age_s")
    assert pushed == api


def test_poll_pushes_the_whole_index_then_only_the_sets_that_changed(app, run_dir):
    service = app.extensions["rankwatch"].checkpoints
    event, whole = service.poll(0)
    assert (event, whole["version"], whole["newest_complete"]) == ("checkpoints", 1, bridge_id(20))
    assert service.poll(0) is None
    service.index(0, force=True)
    assert service.poll(0) is None  # a re-scan of unchanged files is not a change
    save_bridge_set(run_dir, 40)
    service.index(0, force=True)
    event, delta = service.poll(0)
    assert (event, delta["version"], delta["base"]) == ("checkpoints_delta", 2, 1)
    # The new set whole; the one before only for what the dashboard says of it (no longer the
    # set the bridge resumes from), without its files.
    new, old = delta["sets"]
    assert new["id"] == bridge_id(40) and len(new["files"]) == 2 and "removed" not in delta
    assert old == {"id": bridge_id(20), "notes": []}
    assert delta["summary"]["newest_complete"] == bridge_id(40)
    assert delta["summary"]["order"][0] == bridge_id(40)
    assert apply_delta(whole, delta)["newest_complete"] == bridge_id(40)
    # A page that holds another version missed a push: it must ask for the whole index.
    assert apply_delta(whole | {"version": 0}, delta) is None
    # One more rank's file in a set: that file alone, with the set's own fields.
    whole = apply_delta(whole, delta)
    save_bridge_set(run_dir, 60, ranks=(0,))
    service.index(0, force=True)
    whole = apply_delta(whole, service.poll(0)[1])
    save_bridge_set(run_dir, 60, ranks=(1,))
    service.index(0, force=True)
    event, delta = service.poll(0)
    [entry] = [s for s in delta["sets"] if s["id"] == bridge_id(60)]
    assert "files" not in entry and [f["rank"] for f in entry["files_changed"]] == [1]
    assert entry["files_removed"] == [] and entry["ranks_present"] == [0, 1]
    whole = apply_delta(whole, delta)
    assert [s["files"] for s in whole["sets"]] == [s["files"] for s in service.body(0)["sets"]]
    service.resend()
    event, again = service.poll(0)
    assert (event, again["version"]) == ("checkpoints", 5)


# -- download -----------------------------------------------------------------------------


def test_download_sends_a_listed_file(client, run_dir):
    rel = "checkpoints/rank_1/rankwatch-3_4.ckpt"
    r = client.get("/api/checkpoints/file", query_string={"path": rel})
    assert r.status_code == 200
    assert r.data == (run_dir / rel).read_bytes()
    assert r.headers["Content-Disposition"] == "attachment; filename=rankwatch-3_4.ckpt"
    assert int(r.headers["Content-Length"]) == len(r.data)


@pytest.fixture
def traps(run_dir, tmp_path):
    """A checkpoint outside the run directory, reachable only through symlinks, and a non-checkpoint."""
    outside = tmp_path / "outside"
    secret = save_small(outside / "rank_0" / "leak-1_1.ckpt")
    (run_dir / "checkpoints" / "rank_0" / "leak-1_1.ckpt").symlink_to(secret)
    (run_dir / "linked").symlink_to(outside, target_is_directory=True)
    audit = run_dir / runfiles.STATE_DIR / "audit.sqlite3"
    audit.parent.mkdir(exist_ok=True)
    audit.write_bytes(b"SQLite format 3\0")
    save_small(run_dir / runfiles.STATE_DIR / "hidden-1_1.ckpt")
    return outside


@pytest.mark.parametrize(
    "query, status",
    [
        ("path=../outside/rank_0/leak-1_1.ckpt", 400),
        ("path=checkpoints/../../outside/rank_0/leak-1_1.ckpt", 400),
        ("path=%2e%2e%2foutside%2frank_0%2fleak-1_1.ckpt", 400),
        ("path=%252e%252e%252foutside", 404),
        ("path=/etc/passwd", 400),
        # A symlink out of the run directory, or through a symlinked directory: the index
        # lists no symlink, so it is not a checkpoint of this run (and safeio never follows one).
        ("path=checkpoints/rank_0/leak-1_1.ckpt", 404),
        ("path=linked/rank_0/leak-1_1.ckpt", 404),
        ("path=rankwatch/audit.sqlite3", 404),  # inside, but not a checkpoint
        ("path=rankwatch/hidden-1_1.ckpt", 404),  # a checkpoint the index does not list
        ("path=checkpoints/rank_0/nothing-1_1.ckpt", 404),
        ("path=", 400),
        ("", 400),
    ],
)
def test_download_refuses_anything_but_a_listed_checkpoint(client, traps, query, status):
    assert_error(client.get(f"/api/checkpoints/file?{query}"), status)


# -- resume -------------------------------------------------------------------------------


def exec_load(code: str, rank: int, net) -> None:
    """Run the generated code up to and including its load, as rank ``rank``, into ``net``."""
    head = code[: code.index("\n", code.index("ms.load_checkpoint("))]
    assert "rank = get_rank()" in head
    exec(compile(head.replace("rank = get_rank()", f"rank = {rank}"), "resume", "exec"), {"train_net": net})


def assert_loaded(net, path: Path, fmt: str = "ckpt") -> None:
    saved = ms.load_checkpoint(str(path), format=fmt)
    for p in net.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), saved[p.name].asnumpy())


def test_resume_from_the_bridge_default_set(client, run_dir):
    write_job(run_dir, 2, argv=["/opt/job/train.py", "--run-dir", str(run_dir), "--epochs", "5"])
    r = client.get("/api/checkpoints/resume", query_string={"set": bridge_id(20)}, headers=operator())
    assert r.status_code == 200
    info = r.get_json()
    assert info["bridge_default"] is True and "unchanged" in info["how"]
    assert info["command"] == (
        f"msrun --worker_num=2 --local_worker_num=2 --join=True "
        f"/opt/job/train.py --run-dir {run_dir} --epochs 5"
    )
    assert (info["steps_per_epoch"], info["initial_epoch"], info["skip_steps"]) == (8, 2, 4)
    code = info["code"]
    compile(code, "resume", "exec")
    assert 'f"{run}/checkpoints/rank_{rank}/rankwatch-3_4.ckpt"' in code
    assert "dataset.set_init_step(4)" in code and "initial_epoch=2" in code
    net = Small()
    exec_load(code, 1, net)
    assert_loaded(net, run_dir / "checkpoints/rank_1/rankwatch-3_4.ckpt")


class _Batches:
    """STEPS_PER_EPOCH batches of 4 samples, each labelled with its batch number."""

    def __getitem__(self, i):
        return np.zeros(16, np.float32), np.array(i // 4, np.int32)

    def __len__(self):
        return 4 * STEPS_PER_EPOCH


def test_resume_of_a_loop_set_gives_loop_code_and_msruns_whole_command(client, run_dir):
    """A bridge.loop job: functional-loop code, run here, and msrun's options and environment kept."""
    script = "/opt/job/train_loop.py"
    write_job(
        run_dir,
        2,
        argv=[script, "--epochs", "3"],
        launcher_argv=[
            "/venv/bin/python",
            "-m",
            "mindspore.parallel.cluster.run",
            "--worker_num=2",
            "--local_worker_num=2",
            "--master_addr=127.0.0.1",
            "--master_port=8118",
            "--join=True",
            "--log_dir",
            "/runs/a b/msrun_logs",
            script,
            "--epochs",
            "3",
        ],
        env={"MS_ENABLE_GRACEFUL_EXIT": "1", "GLOG_v": "2", "bad name;rm": "x"},
        front_end="loop",
    )
    info = client.get(
        "/api/checkpoints/resume", query_string={"set": bridge_id(20)}, headers=operator()
    ).get_json()
    # msrun as the job ran it (its interpreter, absolute: a fresh shell needs no venv), without the
    # old launch's --master_port, which may be taken now (issue 33, section 5).
    assert info["command"] == (
        "MS_ENABLE_GRACEFUL_EXIT=1 GLOG_v=2 /venv/bin/python -m mindspore.parallel.cluster.run "
        "--worker_num=2 --local_worker_num=2 "
        "--log_dir '/runs/a b/msrun_logs' --join=True /opt/job/train_loop.py --epochs 3"
    )
    assert any("--master_port is left out" in n for n in info["command_notes"])
    assert any("MS_ENABLE_GRACEFUL_EXIT=1" in n for n in info["command_notes"])
    # The command is the job's alone; the dashboard and rankwatch launch are said beside it (issue 33).
    assert any(f"`rankwatch launch --run-dir {run_dir} --` before it" in n for n in info["command_notes"])
    code = info["code"]
    assert "model.train" not in code and "ms.load_param_into_net(network, params)" in code
    # Run it as a loop would, as rank 1: the weights load and the rows after the set follow.
    net = Small()
    trained = []
    scope = {
        "network": net,
        # These sets were saved without an optimizer (so global_step is a scalar in them):
        # an optimizer cell would refuse that global_step, as with OnRequestExit's files.
        "optimizer": nn.Cell(),
        # STEPS_PER_EPOCH batches of 4, each labelled with its batch number.
        "dataset": mds.GeneratorDataset(_Batches(), ["x", "y"], shuffle=False).batch(4),
        "epochs": 3,
        "train_step": lambda x, y: trained.append(int(y.asnumpy()[0])),
    }
    exec(compile(code.replace("rank = get_rank()", "rank = 1"), "resume", "exec"), scope)
    assert_loaded(net, run_dir / "checkpoints/rank_1/rankwatch-3_4.ckpt")
    # Saved at global step 20 of 8 per epoch: the third epoch's last 4 batches remain.
    assert trained == [4, 5, 6, 7]


def test_resume_from_an_older_bridge_set_says_how_to_pin_it(client):
    info = client.get(
        "/api/checkpoints/resume", query_string={"set": bridge_id(10)}, headers=operator()
    ).get_json()
    assert info["bridge_default"] is False
    assert "RANKWATCH_RESUME_STEP=10" in info["how"] and "global step 20" in info["how"]
    assert (info["initial_epoch"], info["skip_steps"]) == (1, 2)
    assert info["command"] is None and "job.json" in info["command_notes"][0]


def test_resume_code_for_modelcheckpoint_and_safetensors_loads_the_files(client, run_dir):
    periodic = client.get(
        "/api/checkpoints/resume", query_string={"set": f"{MODELCKPT}#g8"}, headers=operator()
    ).get_json()
    assert (periodic["initial_epoch"], periodic["skip_steps"]) == (2, 0)
    assert "set_init_step" not in periodic["code"] and "initial_epoch=2" in periodic["code"]
    assert "RANKWATCH_RESUME_STEP=8" in periodic["how"]  # else the bridge loads its own set over it
    net = Small()
    exec_load(periodic["code"], 0, net)
    assert_loaded(net, run_dir / "ckpt/rank_0/train-2_4.ckpt")

    st = client.get(
        "/api/checkpoints/resume", query_string={"set": f"{SAFETENSORS}#g15"}, headers=operator()
    ).get_json()
    assert 'format="safetensors"' in st["code"]
    net = Small()
    exec_load(st["code"], 1, net)
    assert_loaded(net, run_dir / "st/rank_1/model-2_7.safetensors", fmt="safetensors")


def test_resume_of_an_incomplete_set_warns_and_multi_node_jobs_get_node_ranks(client, run_dir):
    write_job(run_dir, 2, argv=["train.py"])
    for r, host in ((0, "node-a"), (1, "node-b")):
        write_heartbeat(run_dir, heartbeat(r, 2, host=host))
    info = client.get(
        "/api/checkpoints/resume", query_string={"set": bridge_id(30)}, headers=operator()
    ).get_json()
    assert info["complete"] is False and "rank 1 has no readable file" in info["warnings"][0]
    assert info["command"] == (
        "msrun --worker_num=2 --local_worker_num=1 --master_addr=node-a "
        '--node_rank="${NODE_RANK:?set NODE_RANK to the index of this node}" --join=True train.py'
    )
    assert any("2 nodes" in n for n in info["command_notes"])
    assert any("relative" in n for n in info["command_notes"])


def test_resume_of_an_unknown_set_is_404(client):
    assert_error(
        client.get("/api/checkpoints/resume", query_string={"set": "nope#g1"}, headers=operator()), 404
    )
    assert_error(client.get("/api/checkpoints/resume"), 400)


# -- delete -------------------------------------------------------------------------------


def delete(client, set_id: str, headers=AUTH, **body):
    return client.post(
        "/api/checkpoints/delete", json={"set": set_id, "reason": "disk full", **body}, headers=headers
    )


def test_delete_needs_the_token_and_deletes_nothing_without_it(client, run_dir):
    files = sorted((run_dir / "st").rglob("*.safetensors"))
    assert files and all(f.stat().st_mode & 0o777 == 0o400 for f in files)  # as MindSpore writes them
    assert_error(delete(client, f"{SAFETENSORS}#g15", headers={}), 401)
    assert_error(delete(client, f"{SAFETENSORS}#g15", headers={"Authorization": "Bearer wrong"}), 401)
    assert all(f.exists() for f in files)
    assert client.get("/api/audit").get_json()["rows"] == []


def test_delete_removes_the_files_and_empty_rank_dirs_and_audits(client, sio, run_dir):
    wait_for_index(sio)
    r = delete(client, f"{SAFETENSORS}#g15", who="alice")
    assert r.status_code == 200, r.get_json()
    result = r.get_json()
    assert result["deleted"] == ["st/rank_0/model-2_7.safetensors", "st/rank_1/model-2_7.safetensors"]
    assert result["failed"] == [] and result["removed_dirs"] == ["st/rank_0", "st/rank_1"]
    assert not (run_dir / "st" / "rank_0").exists() and (run_dir / "st").is_dir()
    assert f"{SAFETENSORS}#g15" not in sets_by_id(client)
    pushed = wait_for_index(sio, lambda b: f"{SAFETENSORS}#g15" not in {s["id"] for s in b["sets"]})
    assert pushed["newest_complete"] == bridge_id(20)

    row = client.get("/api/audit").get_json()["rows"][0]
    assert (row["action"], row["who"], row["reason"], row["outcome"]) == (
        "delete",
        "alice",
        "disk full",
        "deleted: 2 files",
    )
    assert json.loads(row["detail"])["files"] == result["deleted"]


def test_delete_keeps_a_rank_dir_that_still_holds_files(client, run_dir):
    r = delete(client, bridge_id(10))
    assert r.status_code == 200
    assert r.get_json()["removed_dirs"] == []
    assert not (run_dir / "checkpoints/rank_0/rankwatch-2_2.ckpt").exists()
    assert (run_dir / "checkpoints/rank_0/rankwatch-3_4.ckpt").exists()


def test_the_newest_complete_set_needs_force(client, run_dir):
    body = assert_error(delete(client, bridge_id(20)), 409)
    assert "newest complete" in body["error"] and "force" in body["error"]
    assert (run_dir / "checkpoints/rank_0/rankwatch-3_4.ckpt").exists()
    refused = client.get("/api/audit").get_json()["rows"][0]
    assert refused["outcome"].startswith("refused: this is the newest complete set")

    assert delete(client, bridge_id(20), force=True).status_code == 200
    body = client.get("/api/checkpoints").get_json()
    assert (body["newest_complete"], body["bridge_resume"]) == (f"{SAFETENSORS}#g15", bridge_id(10))


@pytest.mark.parametrize(
    "payload, status",
    [
        ({"set": BRIDGE + "#g10"}, 400),  # no reason
        ({"set": BRIDGE + "#g10", "reason": "x", "force": "yes"}, 400),
        ({"set": BRIDGE + "#g10", "reason": "x", "extra": 1}, 400),
        ({"set": "unknown#g1", "reason": "x"}, 404),
    ],
)
def test_delete_checks_its_body(client, run_dir, payload, status):
    assert_error(client.post("/api/checkpoints/delete", json=payload, headers=AUTH), status)
    assert (run_dir / "checkpoints/rank_0/rankwatch-2_2.ckpt").exists()


# -- deep verify --------------------------------------------------------------------------


def wait_verified(sio, set_id: str) -> dict:
    return wait_for_event(
        sio, "checkpoint_verify", lambda e: e["set"] == set_id and e["state"] != "running", timeout=180
    )


def test_verify_loads_every_file_in_a_subprocess(client, sio, run_dir):
    r = client.post("/api/checkpoints/verify", headers=AUTH, json={"set": bridge_id(20)})
    assert r.status_code == 202 and r.get_json()["state"] == "running"
    assert_error(client.post("/api/checkpoints/verify", headers=AUTH, json={"set": bridge_id(20)}), 409)
    events = []
    final = wait_for_event(
        sio,
        "checkpoint_verify",
        lambda e: events.append(e) or (e["set"] == bridge_id(20) and e["state"] != "running"),
        timeout=180,
    )
    assert (final["state"], final["ok"], final["done"], final["total"], final["error"]) == (
        "ok",
        True,
        2,
        2,
        None,
    )
    progress = [(e["done"], e["file"], e["ok"]) for e in events if e["state"] == "running"]
    assert progress[-2:] == [
        (1, "checkpoints/rank_0/rankwatch-3_4.ckpt", True),
        (2, "checkpoints/rank_1/rankwatch-3_4.ckpt", True),
    ]

    status = client.get("/api/checkpoints/verify", query_string={"set": bridge_id(20)}).get_json()
    assert status["state"] == "ok" and status["finished_at"] >= status["started_at"]
    entries = len(ms.load_checkpoint(str(run_dir / "checkpoints/rank_0/rankwatch-3_4.ckpt")))
    assert [(f["rank"], f["ok"], f["crc"], f["params"]) for f in status["files"]] == [
        (0, True, False, entries),
        (1, True, False, entries),
    ]
    listed = sets_by_id(client)[bridge_id(20)]
    assert listed["verify"]["state"] == "ok"


def test_verify_reports_each_damaged_file_and_a_crc_mismatch(client, sio):
    assert (
        client.post("/api/checkpoints/verify", headers=AUTH, json={"set": f"{DAMAGED}#g2"}).status_code == 202
    )
    damaged = wait_verified(sio, f"{DAMAGED}#g2")
    assert damaged["state"] == "failed" and damaged["ok"] is False
    assert damaged["error"].startswith("4 of 5 file(s) failed to load")
    files = client.get("/api/checkpoints/verify", query_string={"set": f"{DAMAGED}#g2"}).get_json()["files"]
    assert [f["ok"] for f in files] == [True, False, False, False, False]
    assert all(f["error"] for f in files[1:])

    assert client.post("/api/checkpoints/verify", headers=AUTH, json={"set": f"{CRC}#g3"}).status_code == 202
    assert wait_verified(sio, f"{CRC}#g3")["state"] == "failed"
    crc_files = client.get("/api/checkpoints/verify", query_string={"set": f"{CRC}#g3"}).get_json()["files"]
    assert [(f["rank"], f["ok"], f["crc"]) for f in crc_files] == [(0, True, True), (1, False, True)]
    assert crc_files[1]["error"].startswith("CRC mismatch")
    # The metadata reader cannot see a flipped bit inside a tensor; only the full load does.
    assert sets_by_id(client)[f"{CRC}#g3"]["complete"] is True


def test_verify_and_delete_do_not_overlap(client, sio):
    set_id = f"{SAFETENSORS}#g15"
    assert client.post("/api/checkpoints/verify", headers=AUTH, json={"set": set_id}).status_code == 202
    assert "verify" in assert_error(delete(client, set_id), 409)["error"]
    wait_verified(sio, set_id)


def test_verify_checks_its_request(client):
    assert_error(client.post("/api/checkpoints/verify", data="x", headers=AUTH), 415)
    assert_error(client.post("/api/checkpoints/verify", headers=AUTH, json={"set": "nope#g1"}), 404)
    assert_error(client.get("/api/checkpoints/verify", query_string={"set": "nope#g1"}), 404)
    never = assert_error(client.get("/api/checkpoints/verify", query_string={"set": bridge_id(10)}), 404)
    assert "no deep verify" in never["error"]


def test_the_dashboard_process_never_imports_mindspore(run_dir, layouts):
    """Index, resume and a whole deep verify, with mindspore only in the worker process."""
    shutil.copytree(layouts, run_dir, dirs_exist_ok=True)
    code = f"""
import sys, time
from app import create_app
client = create_app({{"RUN_DIR": {str(run_dir)!r}, "TOKEN": {TOKEN!r}}}).test_client()
set_id = {bridge_id(20)!r}
assert client.get("/api/checkpoints").get_json()["newest_complete"] == set_id
assert client.get("/api/checkpoints/resume", query_string={{"set": set_id}}).status_code == 200
auth = {{"Authorization": "Bearer {TOKEN}"}}
assert client.post("/api/checkpoints/verify", json={{"set": set_id}}, headers=auth).status_code == 202
deadline = time.monotonic() + 180
while client.get("/api/checkpoints/verify", query_string={{"set": set_id}}).get_json()["state"] == "running":
    assert time.monotonic() < deadline, "verify did not finish"
    time.sleep(0.1)
assert client.get("/api/checkpoints/verify", query_string={{"set": set_id}}).get_json()["state"] == "ok"
sys.exit("imported mindspore" if "mindspore" in sys.modules else 0)
"""
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=240)
