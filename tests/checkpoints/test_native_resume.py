"""The resume code offered for an OnRequestExit set, run as offered against a real set.

A real ``OnRequestExit`` stop (one process, ``MS_ENABLE_GRACEFUL_EXIT=1``,
the flag armed from the start, so it stops after step 1) writes
``RUN/rank_0/LeNet_train.ckpt``. The dashboard's ``GET /api/checkpoints/resume``
code is then executed in a real training script, with OnRequestExit attached
as before: OnRequestExit's own reload at train begin must load the weights
(it raised a shape error on ``global_step`` before), and training goes on.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from app import create_app
from tests.helpers.app import FAST_SETTINGS, TOKEN, operator
from tests.helpers.jobs import JOB_TIMEOUT_S
from trainer_bridge.demo.mnist import write_mnist
from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.msrun

# The script around the offered code: what a user's graceful-exit sample has in scope.
SCRIPT = textwrap.dedent(
    """\
    import sys
    import mindspore as ms
    from mindspore import nn
    from mindspore.train import Callback, Model, OnRequestExit
    from trainer_bridge.demo.train import LeNet5, StepLog, create_dataset

    run, data, flag, code_path = sys.argv[1:5]
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    ms.set_seed(7)  # not the stopped run's seed: the weights must come from the file
    saved = ms.load_checkpoint(run + "/rank_0/LeNet_train.ckpt")


    class Loaded(Callback):
        # After OnRequestExit's on_train_begin: the network holds the saved weights.
        def on_train_begin(self, run_context):
            net = run_context.original_args().train_network
            same = all(
                (p.asnumpy() == saved[p.name].asnumpy()).all() for p in net.get_parameters() if "conv" in p.name
            )
            print("loaded", same, flush=True)


    dataset = create_dataset(data, 32, 0, 1, shuffle=False)
    net = LeNet5()
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  nn.Momentum(net.trainable_params(), 0.01, 0.9))
    callbacks = [OnRequestExit(file_name="LeNet", directory=run, config_file=flag), Loaded(), StepLog()]
    epochs = int(sys.argv[5])
    exec(compile(open(code_path).read(), "offered", "exec"))
    print("done", flush=True)
    """
)


def run_py(args, tmp_path, name, env=None) -> str:
    out = tmp_path / f"{name}.out"
    with open(out, "wb") as f:
        proc = subprocess.run(
            [sys.executable, *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "GLOG_v": "3", **(env or {})},
            timeout=JOB_TIMEOUT_S,
        )
    text = out.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    return text


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run directory with a real OnRequestExit set saved after step 1 (10 steps per epoch)."""
    tmp = tmp_path_factory.mktemp("native")
    run = tmp / "run"
    data = write_mnist(run / "mnist", samples=320)
    runfiles.flag_path(run).write_text(json.dumps({"GracefulExit": 1}))
    args = ["-m", "trainer_bridge.demo.train", "--run-dir", str(run), "--data-dir", str(data)]
    text = run_py(
        [*args, "--epochs", "3", "--native-exit", "--no-bridge", "--step-log", "--no-shuffle"],
        tmp,
        "stop",
        env={"MS_ENABLE_GRACEFUL_EXIT": "1"},
    )
    assert "step 1 epoch 1" in text and "step 2 " not in text, text[-2000:]
    assert (run / "rank_0" / "LeNet_train.ckpt").is_file()
    runfiles.flag_path(run).write_text(json.dumps({"GracefulExit": 0}))
    return run, data


def offered(run) -> dict:
    app = create_app({"RUN_DIR": str(run), "TESTING": True, "TOKEN": TOKEN, **FAST_SETTINGS})
    client = app.test_client()
    sets = client.get("/api/checkpoints").get_json()["sets"]
    (native,) = [s for s in sets if s["origin"] == "native OnRequestExit" and "_train" in s["id"]]
    return client.get(
        "/api/checkpoints/resume", query_string={"set": native["id"]}, headers=operator()
    ).get_json()


def test_the_offered_code_makes_onrequestexits_own_reload_work_and_training_goes_on(stopped_run, tmp_path):
    run, data = stopped_run
    info = offered(run)
    code = info["code"]
    assert "no automatic resume" not in code and "loads it again by itself" in info["how"]
    assert "def on_request_exit_resume(" in code
    code_path = tmp_path / "offered.py"
    code_path.write_text(code)
    flag = str(runfiles.flag_path(run))
    text = run_py(["-c", SCRIPT, str(run), str(data), flag, str(code_path), "2"], tmp_path, "resume")
    assert "loaded True" in text, text[-3000:]
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    # Step 1 was trained before the stop: the first epoch's other 9, then the whole second.
    assert len(steps) == 9 + 10, steps
    assert "done" in text


def test_the_offered_code_ends_cleanly_when_the_set_covers_the_epochs_asked_for(stopped_run, tmp_path):
    run, data = stopped_run
    code_path = tmp_path / "offered.py"
    code_path.write_text(offered(run)["code"])
    flag = str(runfiles.flag_path(run))
    # The set was saved after step 1 of epoch 1: asking for 0 epochs leaves nothing to train.
    text = run_py(["-c", SCRIPT, str(run), str(data), flag, str(code_path), "0"], tmp_path, "past")
    assert "past the 0 epochs asked for: nothing to train" in text, text[-3000:]
    assert "done" in text and "step " not in text.replace("after step", "")
