"""The bridge in one process: a tiny real training run, asserting on what it wrote."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")
import mindspore.dataset as ds  # noqa: E402
from mindspore import nn  # noqa: E402
from mindspore.train import Callback, Model  # noqa: E402

from trainer_bridge import GracefulExitBridge, handover  # noqa: E402
from trainer_bridge.rundir import runfiles  # noqa: E402
from trainer_bridge.rundir.ckptmeta import read_meta  # noqa: E402

STEPS_PER_EPOCH = 8


class _Source:
    def __getitem__(self, i):
        x = np.full((4,), i % 3, np.float32)
        return x, np.array(i % 2, np.int32)

    def __len__(self):
        return STEPS_PER_EPOCH * 4


class _Steps(Callback):
    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_step_end(self, run_context):
        self.seen.append(run_context.original_args().cur_step_num)


def _model():
    """(the dataset, a ``Model`` of a 2-layer net over it), seeded alike every time."""
    ms.set_seed(0)
    data = ds.GeneratorDataset(_Source(), ["x", "y"], shuffle=False).batch(4)
    net = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 2))
    model = Model(
        net,
        nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
        nn.Momentum(net.trainable_params(), 0.01, 0.9),
    )
    return data, model


def _train(run_dir, epochs=2, flag_script=None, **bridge_kwargs):
    """Train a 2-layer net; return (bridge, steps seen). ``flag_script``: see _FlagScript."""
    data, model = _model()
    bridge = GracefulExitBridge(run_dir, heartbeat_interval_s=0.05, **bridge_kwargs)
    steps = _Steps()
    callbacks = [bridge, steps]
    if flag_script:
        callbacks.append(_FlagScript(run_dir, [bridge], flag_script))
    initial_epoch = bridge.resume(data)
    model.train(epochs, data, callbacks=callbacks, dataset_sink_mode=False, initial_epoch=initial_epoch)
    return bridge, steps.seen


def test_heartbeat_after_a_finished_run(tmp_path):
    _, seen = _train(tmp_path)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["schema"] == runfiles.HEARTBEAT_SCHEMA
    assert hb["state"] == "finished" and hb["stop"] is None
    assert hb["global_step"] == seen[-1] == 2 * STEPS_PER_EPOCH
    assert (hb["epoch"], hb["step"]) == (2, STEPS_PER_EPOCH)
    assert isinstance(hb["loss"], float) and hb["batch_size"] == 4
    assert hb["rss_bytes"] > 0 and hb["world_size"] == 1
    # As psutil reads them (the reporter reads /proc itself, see trainer_bridge/procstats.py).
    import psutil

    assert 0.5 < hb["rss_bytes"] / psutil.Process().memory_info().rss < 2
    assert hb["cpu_percent"] is not None and hb["cpu_percent"] >= 0
    # The process's CPU so far, which a training process has used plenty of (MindSpore's import alone).
    assert hb["cpu_seconds"] >= 0.1 and hb["cpu_seconds"] == round(hb["cpu_seconds"], 3)
    job = runfiles.read_json(runfiles.job_path(tmp_path))
    assert job["world_size"] == 1
    history = runfiles.history_path(tmp_path, 0).read_text().splitlines()
    assert history and all("global_step" in json.loads(line) for line in history)


def test_history_rotates_at_its_segment_size_and_survives_removal(tmp_path, monkeypatch):
    # The reporter tracks the size its appends return instead of a stat per
    # heartbeat: the rotation must still happen at the bound, and a history
    # removed under it must be started again, not lost for the run.
    monkeypatch.setattr(runfiles, "HISTORY_SEGMENT_BYTES", 1500)
    path = runfiles.history_path(tmp_path, 0)

    class RemoveOnce(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == STEPS_PER_EPOCH and path.exists():
                path.unlink()

    data, model = _model()
    bridge = GracefulExitBridge(tmp_path, heartbeat_interval_s=0.001, poll_interval_s=0.001)

    class Slow(Callback):
        def on_train_step_end(self, run_context):
            # Several heartbeats per step, whatever the machine's speed: wait for the history to move.
            start = bridge._engine.reporter._seq
            while bridge._engine.reporter._seq < start + 3:
                threading.Event().wait(0.001)

    model.train(2, data, callbacks=[bridge, RemoveOnce(), Slow()], dataset_sink_mode=False)
    # The end waits at most 5 s for the reporter's thread (it never holds up training's end): on a
    # loaded host its last tick may still rotate the history, so read once the thread is gone.
    thread = bridge._engine.reporter.handover.thread
    if thread is not None:
        thread.join()
    rotated = path.with_name(path.name + ".1")
    assert rotated.is_file() and path.is_file()
    for segment in (path, rotated):
        assert 0 < segment.stat().st_size <= 1500
        assert all("global_step" in json.loads(line) for line in segment.read_text().splitlines())
    # The newest line is the last heartbeat's step.
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["global_step"] == 2 * STEPS_PER_EPOCH


def test_a_missing_run_directory_is_made(tmp_path):
    run_dir = tmp_path / "not" / "made"
    _, seen = _train(run_dir, epochs=1)
    hb = runfiles.read_json(runfiles.heartbeat_path(run_dir, 0))
    assert hb["state"] == "finished" and hb["global_step"] == seen[-1] == STEPS_PER_EPOCH
    assert hb["warnings"] == []
    assert runfiles.attempts_path(run_dir).is_file()


def test_flag_stops_saves_and_the_served_flag_does_not_stop_the_resume(tmp_path):
    runfiles.write_flag(tmp_path, True, request_id="req-a")
    _, seen = _train(tmp_path)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    stop = hb["stop"]
    assert hb["state"] == "exited" and stop["stage"] == "exited"
    assert stop["request_id"] == "req-a" and seen[-1] == stop["stop_step"]
    meta = read_meta(tmp_path / stop["checkpoint"]["path"])
    assert meta.ok and meta.extras["step_num"] == stop["stop_step"]
    assert meta.extras["rankwatch_request_id"] == "req-a"

    _, seen2 = _train(tmp_path)  # the flag still says 1, for the served request
    assert seen2[0] == stop["stop_step"] + 1 and seen2[-1] == 2 * STEPS_PER_EPOCH
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["state"] == "finished" and hb["resumed_from"]["global_step"] == stop["stop_step"]

    # A new request does stop it. The finished run saved nothing, so this
    # launch, too, resumes from the newest complete set: the first stop's.
    runfiles.write_flag(tmp_path, True, request_id="req-b")
    _, seen3 = _train(tmp_path)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["state"] == "exited" and hb["stop"]["request_id"] == "req-b"
    assert seen3[0] == stop["stop_step"] + 1 and seen3[-1] == hb["stop"]["stop_step"]


def test_unwritable_state_dir_never_stops_training(tmp_path, caplog):
    (tmp_path / runfiles.STATE_DIR).write_text("not a directory")  # every write fails
    _, seen = _train(tmp_path)
    assert seen[-1] == 2 * STEPS_PER_EPOCH
    assert "training continues" in caplog.text


def test_garbage_flag_is_ignored(tmp_path, caplog):
    runfiles.flag_path(tmp_path).write_bytes(b'{"GracefulExit": 1')
    _, seen = _train(tmp_path)
    assert seen[-1] == 2 * STEPS_PER_EPOCH
    assert "ignoring unreadable stop flag" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync_interval_s": 0}, "sync_interval_s"),
        ({"heartbeat_interval_s": -1}, "heartbeat_interval_s"),
        ({"max_sync_every": 0}, "max_sync_every"),
        ({"max_overhead": 1.5}, "max_overhead"),
        ({"resume_step": 0}, "resume_step"),
    ],
)
def test_bad_arguments_fail_fast_naming_class_and_argument(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=f"GracefulExitBridge: {message}"):
        GracefulExitBridge(tmp_path, **kwargs)


class _FlagScript(Callback):
    """Writes the flag at given steps; after a write it makes the bridge read it at once."""

    def __init__(self, run_dir, bridge_holder, script):
        super().__init__()
        self.run_dir, self.holder, self.script = run_dir, bridge_holder, script

    def on_train_step_end(self, run_context):
        step = run_context.original_args().cur_step_num
        if step in self.script:
            runfiles.write_flag(self.run_dir, **self.script[step])
            self.holder[0]._engine.reporter.read_flag_now()


def test_cancel_before_the_agreement_withdraws_the_request(tmp_path):
    data, model = _model()
    # Agreements at steps 1, 5, 9, ...: the request is seen at 2 and cancelled at 3.
    bridge = GracefulExitBridge(tmp_path, sync_interval_s=1000, max_sync_every=4)
    script = _FlagScript(
        tmp_path,
        [bridge],
        {2: {"exit": True, "request_id": "req-c"}, 3: {"exit": False, "cancelled": "req-c"}},
    )
    seen = []

    class Watch(Callback):
        def on_train_step_end(self, run_context):
            seen.append(bridge._engine.reporter.request is not None)

    model.train(2, data, callbacks=[bridge, script, Watch()], dataset_sink_mode=False)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert seen[1] is True and seen[2] is False  # seen at step 2, withdrawn at step 3
    assert hb["state"] == "finished" and hb["stop"] is None
    assert hb["global_step"] == 2 * STEPS_PER_EPOCH


def test_bare_native_flag_stops_once_and_is_stale_for_the_resume(tmp_path):
    runfiles.flag_path(tmp_path).write_text('{"GracefulExit": 1}')  # no request id, as a human writes it
    _, seen = _train(tmp_path)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["state"] == "exited" and hb["stop"]["request_id"] == "native-flag"
    _, seen2 = _train(tmp_path)  # the same file, older than the checkpoint: served
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["state"] == "finished" and seen2[0] == seen[-1] + 1


def test_resume_step_pins_an_older_set_and_a_served_flag_stays_served(tmp_path, monkeypatch):
    runfiles.write_flag(tmp_path, True, request_id="req-1")
    _, first = _train(tmp_path)  # stops at the first agreement
    # Relaunch: resumes from the first set, and a new request stops it again later.
    _, second = _train(
        tmp_path, max_sync_every=2, flag_script={first[-1] + 3: {"exit": True, "request_id": "req-2"}}
    )
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["stop"]["request_id"] == "req-2" and second[-1] > first[-1] + 3

    # Pin the older set; the flag still says req-2, which the ranks saved for.
    monkeypatch.setenv("RANKWATCH_RESUME_STEP", str(first[-1]))
    _, third = _train(tmp_path)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert third[0] == first[-1] + 1 and hb["state"] == "finished"
    assert hb["resumed_from"]["global_step"] == first[-1]

    monkeypatch.setenv("RANKWATCH_RESUME_STEP", "999")
    with pytest.raises(
        ValueError,
        match=r"resume_step=999, .* no checkpoint set complete .* "
        rf"\(complete sets: \[{first[-1]}, {second[-1]}\]\)",
    ):
        _train(tmp_path)


class _Params(dict):
    """MindSpore's cb_params: a dict whose keys read as attributes."""

    def __getattr__(self, name):
        return self[name]

    def __setattr__(self, name, value):
        self[name] = value


class _RunContext:
    def __init__(self, params):
        self.params, self.stop_requested = params, False

    def original_args(self):
        return self.params

    def request_stop(self):
        self.stop_requested = True


def test_sink_mode_counts_steps_from_cur_step_num(tmp_path):
    # On Ascend with dataset_sink_mode=True the step hooks run once per sink
    # of sink_size steps (CPU calls them every step, so no real run shows it).
    net = nn.Dense(4, 2)
    params = _Params(train_network=net, cur_epoch_num=1, batch_num=100, cur_step_num=0, net_outputs=None)
    ctx = _RunContext(params)
    bridge = GracefulExitBridge(tmp_path, max_sync_every=1000)
    bridge.on_train_begin(ctx)
    for sink in range(1, 5):
        bridge.on_train_step_begin(ctx)
        params.cur_step_num = 25 * sink
        params.net_outputs = ms.Tensor(np.array([0.5], np.float32))
        bridge.on_train_step_end(ctx)
    bridge.on_train_end(ctx)
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert (hb["global_step"], hb["step"], hb["state"]) == (100, 100, "finished")
    assert hb["loss"] == 0.5 and bridge.global_step == 100 and not bridge.stopped


class _Indexed:
    """Row i holds i, so a batch tells its data position."""

    def __getitem__(self, i):
        return np.full((4,), i, np.float32), np.array(i % 2, np.int32)

    def __len__(self):
        return STEPS_PER_EPOCH * 4


def _functional(run_dir, epochs=2, flag_at=None, **bridge_kwargs):
    """A functional loop (value_and_grad + optimizer) through bridge.loop; return what it saw."""
    ms.set_seed(0)
    data = ds.GeneratorDataset(_Indexed(), ["x", "y"], shuffle=False).batch(4)
    net = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 2))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.001, 0.9)

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    @ms.jit
    def train_step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    bridge = GracefulExitBridge(run_dir, heartbeat_interval_s=0.05, max_sync_every=2, **bridge_kwargs)
    seen = []
    for x, y in bridge.loop(data, network=net, optimizer=opt, epochs=epochs):
        if not seen:
            first_moment = opt.moments[0].asnumpy().copy()
        loss = train_step(x, y)
        bridge.report(loss=loss)
        seen.append((bridge.global_step, int(x.asnumpy()[0, 0]) // 4, int(opt.global_step.asnumpy()[0])))
        if bridge.global_step == flag_at:
            runfiles.write_flag(run_dir, True, request_id="req-loop")
            bridge._engine.reporter.read_flag_now()
    return bridge, seen, first_moment


def test_loop_stops_saves_network_and_optimizer_and_resumes_at_the_same_data_position(tmp_path):
    bridge, seen, _ = _functional(tmp_path, flag_at=5)
    assert bridge.stopped
    stop_step = seen[-1][0]
    assert stop_step in (5, 6)  # the next agreement after the flag (every 2 steps)
    assert [s for s, _, _ in seen] == list(range(1, stop_step + 1))
    assert [pos for _, pos, _ in seen] == [(s - 1) % STEPS_PER_EPOCH for s in range(1, stop_step + 1)]
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["state"] == "exited" and hb["stop"]["stop_step"] == stop_step
    assert isinstance(hb["loss"], float) and hb["batch_size"] == 4
    path = tmp_path / hb["stop"]["checkpoint"]["path"]
    assert path.name == f"rankwatch-1_{stop_step}.ckpt"
    saved = ms.load_checkpoint(str(path))
    assert int(saved["global_step"].asnumpy()[0]) == stop_step  # the optimizer's own step
    assert {"0.weight", "moments.0.weight", "learning_rate", "momentum"} <= set(saved)
    meta = read_meta(path)
    assert (
        meta.ok and meta.extras["step_num"] == stop_step and meta.extras["rankwatch_request_id"] == "req-loop"
    )

    # Relaunch, the flag still up for the served request: resume, same data position, optimizer state.
    again, seen2, first_moment = _functional(tmp_path)
    assert not again.stopped
    assert seen2[0] == (stop_step + 1, stop_step % STEPS_PER_EPOCH, stop_step + 1)
    assert seen2[-1][0] == 2 * STEPS_PER_EPOCH
    np.testing.assert_array_equal(first_moment, saved["moments.0.weight"].asnumpy())
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert hb["state"] == "finished" and hb["resumed_from"]["global_step"] == stop_step


def test_loop_left_early_ends_the_rank_finished(tmp_path):
    ms.set_seed(0)
    data = ds.GeneratorDataset(_Indexed(), ["x", "y"], shuffle=False).batch(4)
    net = nn.Dense(4, 2)
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    bridge = GracefulExitBridge(tmp_path)
    for _ in bridge.loop(data, network=net, optimizer=opt, epochs=1):
        if bridge.global_step == 3:
            break
    hb = runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))
    assert (hb["state"], hb["global_step"]) == ("finished", 2) and not bridge.stopped


def _reporter_thread() -> bool:
    return any(t.name == "rankwatch-reporter" and t.is_alive() for t in threading.enumerate())


def test_loop_steps_with_no_reporter_thread_and_a_pause_brings_it_back(tmp_path, monkeypatch):
    """While agreements come, the training thread does the reporter's work (handover.py)."""
    # Only a deliberate stall may bar the hand-over (test_reporter_handover.py), not a loaded disk.
    monkeypatch.setattr(handover, "SLOW_TICK_S", 5.0)
    ms.set_seed(0)
    data = ds.GeneratorDataset(_Indexed(), ["x", "y"], shuffle=False).batch(4)
    net = nn.Dense(4, 2)
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    bridge = GracefulExitBridge(tmp_path, heartbeat_interval_s=0.25, poll_interval_s=0.05, max_sync_every=2)

    def beat():
        return runfiles.read_json(runfiles.heartbeat_path(tmp_path, 0))

    seen, since = [], None
    deadline = time.monotonic() + 120  # a failure guard only: each phase ends on its event
    for _ in bridge.loop(data, network=net, optimizer=opt, epochs=10**6):
        assert time.monotonic() < deadline, f"stuck after phases {seen}"
        thread = _reporter_thread()
        if "handed" not in seen:
            if not thread:
                seen.append("handed")
                since = beat()["seq"]
        elif "beats" not in seen:
            if thread:
                since = beat()["seq"]  # this machine held an agreement back: count afresh
            elif beat()["seq"] >= since + 3:
                seen.append("beats")  # heartbeats written at agreements, with no thread
                assert beat()["bridge_cost"]["reporter_thread"] is False
        elif "paused" not in seen:
            # A pause in the steps (an evaluation, a hang): the thread comes back and beats.
            while not _reporter_thread():
                assert time.monotonic() < deadline, "the reporter thread never came back"
                time.sleep(0.01)
            since = beat()["seq"]
            while beat()["seq"] < since + 3:
                assert time.monotonic() < deadline, "no heartbeats during the pause"
                time.sleep(0.01)
            seen.append("paused")
        elif not thread:
            break  # handed over again once the steps resumed
    assert seen == ["handed", "beats", "paused"]
    hb = beat()
    assert hb["state"] == "finished" and hb["bridge_cost"]["reporter_thread_starts"] >= 2


class _Position(Callback):
    """After the bridge's step end: its epoch and step in epoch against LossMonitor's own counters."""

    def __init__(self, bridge):
        super().__init__()
        self.bridge = bridge
        self.seen = []

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        monitor = (cb.cur_epoch_num, (cb.cur_step_num - 1) % cb.batch_num + 1)
        self.seen.append(((self.bridge.epoch, self.bridge.step_in_epoch), monitor))


def test_bridge_epoch_and_step_in_epoch_are_loss_monitors(tmp_path):
    data = ds.GeneratorDataset(_Source(), ["x", "y"], shuffle=False).batch(4)
    net = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 2))
    model = Model(
        net,
        nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
        nn.Momentum(net.trainable_params(), 0.01, 0.9),
    )
    bridge = GracefulExitBridge(tmp_path, heartbeat_interval_s=0.05)
    assert (bridge.epoch, bridge.step_in_epoch) == (0, 0)  # before training
    position = _Position(bridge)
    model.train(2, data, callbacks=[bridge, position], dataset_sink_mode=False)
    assert len(position.seen) == 2 * STEPS_PER_EPOCH
    assert all(ours == monitor for ours, monitor in position.seen), position.seen


def test_a_rollbacks_skip_moves_the_data_and_the_step_count_on_both_front_ends(tmp_path, monkeypatch):
    """Issue 34: RANKWATCH_SKIP_FROM/RANKWATCH_SKIP_BATCHES on a pinned resume (what rankwatch launch sets)."""
    from trainer_bridge.rundir import attempts

    loop_dir, train_dir = tmp_path / "loop", tmp_path / "train"
    _, seen, _ = _functional(loop_dir, flag_at=3)
    stop = seen[-1][0]
    monkeypatch.setenv("RANKWATCH_RESUME_STEP", str(stop))
    monkeypatch.setenv("RANKWATCH_SKIP_FROM", str(stop + 2))
    monkeypatch.setenv("RANKWATCH_SKIP_BATCHES", "3")
    data_step = stop + 4  # SKIP_FROM - 1 + SKIP_BATCHES
    again, seen2, _ = _functional(loop_dir)
    # The loop: the step count and the data position both jump; the optimizer's own step counts updates.
    assert seen2[0] == (data_step + 1, data_step % STEPS_PER_EPOCH, stop + 1)
    assert [s for s, _, _ in seen2] == list(range(data_step + 1, 2 * STEPS_PER_EPOCH + 1))
    start = [r for r in attempts.read_lines(loop_dir)[0] if r["kind"] == "start"][-1]
    assert start["skipped"] == [stop + 1, data_step] and start["first_step"] == data_step + 1
    assert start["resumed_from"]["global_step"] == stop
    # Model.train: bridge.resume(dataset) gives the epoch and the set_init_step of the data step.
    monkeypatch.delenv("RANKWATCH_RESUME_STEP")
    train_dir.mkdir()
    runfiles.write_flag(train_dir, True, request_id="req-1")
    first = _train_indexed(train_dir)
    stop = first[-1][0]
    monkeypatch.setenv("RANKWATCH_RESUME_STEP", str(stop))
    monkeypatch.setenv("RANKWATCH_SKIP_FROM", str(stop + 1))
    monkeypatch.setenv("RANKWATCH_SKIP_BATCHES", str(STEPS_PER_EPOCH))  # past the epoch's end
    second = _train_indexed(train_dir, epochs=3)
    # Each step trains the batch of its own data position: (global step, batch within its epoch).
    expected = [
        (g, (g - 1) % STEPS_PER_EPOCH) for g in range(stop + STEPS_PER_EPOCH + 1, 3 * STEPS_PER_EPOCH + 1)
    ]
    assert second == expected
    # Without a pin, the skip is not the bridge's business: the newest set (the same one) and no jump.
    monkeypatch.delenv("RANKWATCH_RESUME_STEP")
    third = _train_indexed(train_dir)
    assert third == [(g, (g - 1) % STEPS_PER_EPOCH) for g in range(stop + 1, 2 * STEPS_PER_EPOCH + 1)]


class _Batches(Callback):
    """(global step, the batch's position within its epoch) of every step ``Model.train`` trains."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        x = cb.train_dataset_element[0].asnumpy()
        self.seen.append((cb.cur_step_num, int(x[0, 0]) // 4))


def _train_indexed(run_dir, epochs=2):
    ms.set_seed(0)
    data = ds.GeneratorDataset(_Indexed(), ["x", "y"], shuffle=False).batch(4)
    net = nn.SequentialCell(nn.Dense(4, 8), nn.ReLU(), nn.Dense(8, 2))
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    model = Model(net, loss, nn.Momentum(net.trainable_params(), 0.001, 0.9))
    bridge = GracefulExitBridge(run_dir, heartbeat_interval_s=0.05)
    batches = _Batches()
    initial_epoch = bridge.resume(data)
    model.train(
        epochs, data, callbacks=[bridge, batches], dataset_sink_mode=False, initial_epoch=initial_epoch
    )
    return batches.seen
