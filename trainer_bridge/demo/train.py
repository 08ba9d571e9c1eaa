"""The demo's worker: LeNet5 on MNIST-format files, data parallel, bridge attached.

``msrun`` starts one of these per rank (``python -m trainer_bridge.demo``
builds the command). It is also the reference for adding the bridge to a
script: the two lines marked ``# bridge`` are all it takes.

Run alone (one process, no ``msrun``) it trains single-rank, which the
benchmarks use for the native ``OnRequestExit`` baseline.
"""

from __future__ import annotations

import argparse
import os
import time

import mindspore as ms
import mindspore.dataset as ds
import mindspore.dataset.transforms as transforms
import mindspore.dataset.vision as vision
from mindspore import nn
from mindspore.train import (
    Callback,
    CheckpointConfig,
    LossMonitor,
    Model,
    ModelCheckpoint,
    OnRequestExit,
    TimeMonitor,
)

from trainer_bridge import GracefulExitBridge
from trainer_bridge.native import on_request_exit_resume
from trainer_bridge.rundir.rollbacks import LR_SCALE_ENV
from trainer_bridge.rundir.runfiles import flag_path


def create_dataset(data_dir: str, batch_size: int, rank: int, world: int, shuffle: bool = True) -> ds.Dataset:
    """LeNet's MNIST pipeline: resize to 32x32, scale to [0, 1], normalise, HWC->CHW.

    Scaling comes first: MNIST's mean 0.1307 and deviation 0.3081 are of
    pixels in [0, 1]. (The seed normalised the raw 0..255 values and then
    divided by 255, which left inputs near zero and the loss flat at ln 10.)
    """
    mnist = ds.MnistDataset(data_dir, num_shards=world, shard_id=rank, shuffle=shuffle)
    image_ops = [
        vision.Resize((32, 32), interpolation=vision.Inter.LINEAR),
        vision.Rescale(1.0 / 255.0, 0.0),
        vision.Rescale(1.0 / 0.3081, -0.1307 / 0.3081),
        vision.HWC2CHW(),
    ]
    mnist = mnist.map(transforms.TypeCast(ms.int32), input_columns="label")
    mnist = mnist.map(image_ops, input_columns="image")
    return mnist.batch(batch_size, drop_remainder=True)


class LeNet5(nn.Cell):
    """LeNet5 as in MindSpore's graceful-exit sample, with MindSpore's default initialisers.

    The sample draws every weight from TruncatedNormal(0.02): the signal then
    nearly vanishes by the last layer, and the loss sits at ln 10 for about
    700 steps (lr 0.01) before it suddenly drops. The defaults (HeUniform),
    as in MindSpore's LeNet quick start, start learning from the first steps.
    """

    def __init__(self, num_class: int = 10, channel: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channel, 6, 5, pad_mode="valid", has_bias=False)
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid", has_bias=False)
        self.fc1 = nn.Dense(16 * 5 * 5, 120)
        self.fc2 = nn.Dense(120, 84)
        self.fc3 = nn.Dense(84, num_class)
        self.relu = nn.ReLU()
        self.max_pool2d = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()

    def construct(self, x):
        x = self.max_pool2d(self.relu(self.conv1(x)))
        x = self.max_pool2d(self.relu(self.conv2(x)))
        x = self.flatten(x)
        x = self.relu(self.fc1(x))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class Pacer(Callback):
    """Sleeps after each step so a human can watch a small job (``--step-delay``).

    A rank can be slowed alone (``--slow-rank``) to show a straggler: by
    ``--slow-delay`` seconds more per step, or, with ``--slow-factor F``, by F
    times its own median wall step time, measured over its first
    ``--slow-after`` steps (the first, which compiles, left out) and applied
    from then on. Its peers then wait for it in the gradient AllReduce.
    """

    def __init__(self, delay_s: float, factor: float = 0.0, after: int = 10):
        super().__init__()
        self.delay_s = delay_s
        self.factor = factor
        self.after = max(3, after)
        self._ends: list[float] = []

    def on_train_step_end(self, run_context):
        if self.factor and self._ends is not None:
            self._ends.append(time.perf_counter())
            if len(self._ends) == self.after:
                steps = sorted(b - a for a, b in zip(self._ends[1:], self._ends[2:], strict=False))
                measured = steps[len(steps) // 2]
                extra = self.factor * measured
                self.delay_s += extra
                self._ends = None
                print(
                    f"slow rank: median step {measured * 1e3:.1f} ms over steps 3-{self.after}; "
                    f"sleeping {extra * 1e3:.1f} ms more per step from now on",
                    flush=True,
                )
        if self.delay_s > 0:
            time.sleep(self.delay_s)


def hang_here():
    """Sleep for ever: a rank stuck inside Python (``--hang-rank``), named so a stack capture says so."""
    while True:
        time.sleep(3600)


class Hang(Callback):
    """Hangs this rank at the end of global step ``at`` (``--hang-rank R --hang-at S``).

    Its peers then block in the next step's gradient AllReduce: the shape of
    a real hang (a stuck data loader, a deadlocked callback) for the stack
    captures to show.
    """

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.at:
            print(f"hanging at step {self.at} (--hang-rank)", flush=True)
            hang_here()


class Crash(Callback):
    """Raises at the end of global step ``at`` on this rank (``--crash-rank R --crash-at S``): a rank
    that dies of an exception, for the supervisor's tests (``rankwatch launch``)."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.at:
            raise RuntimeError(f"injected crash at global step {self.at} (--crash-rank)")


POISON_ENV = "RANKWATCH_DEMO_POISON_STEP"


class Poison(Callback):
    """``RANKWATCH_DEMO_POISON_STEP=K[:N]``: global steps K..K+N-1 (N 5 by default) are poisoned.

    It stands for bad input batches at those data positions: their update
    is made with a NaN learning rate, so the weights are NaN from step K on
    and every later loss is NaN, on every rank at once, as a bad batch does
    in data parallel. A rollback that skips those steps' batches
    (``RANKWATCH_SKIP_BATCHES``; a global step is a data position) trains
    on clean.
    """

    def __init__(self, spec: str, optimizer):
        super().__init__()
        first, _, count = spec.partition(":")
        self.first, self.count = int(first), int(count or 5)
        self.lr = optimizer.learning_rate
        self.clean = self.lr.asnumpy().copy()

    def on_train_step_begin(self, run_context):
        step = run_context.original_args().cur_step_num  # the step about to run
        poisoned = self.first <= step < self.first + self.count
        self.lr.set_data(ms.Tensor(self.clean * float("nan") if poisoned else self.clean))


def lr_scale() -> float:
    """``RANKWATCH_LR_SCALE``, which a loss-spike rollback's later rungs set: this script opts in."""
    try:
        x = float(os.environ.get(LR_SCALE_ENV) or 1.0)
    except ValueError:
        return 1.0
    return x if 0 < x < float("inf") else 1.0


class StepLog(Callback):
    """Prints one line per step; tests read it to see where a run resumed."""

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        print(f"step {cb.cur_step_num} epoch {cb.cur_epoch_num} t {time.monotonic():.4f}", flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data-dir", required=True, help="directory with the idx files")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps --slow-delay more per step")
    p.add_argument("--slow-delay", type=float, default=0.0)
    p.add_argument(
        "--slow-factor",
        type=float,
        default=0.0,
        help="the slow rank sleeps this many times its own measured step time more "
        "per step, after --slow-after steps (instead of a fixed --slow-delay)",
    )
    p.add_argument(
        "--slow-after",
        type=int,
        default=10,
        help="steps the slow rank measures before --slow-factor applies (default 10)",
    )
    p.add_argument(
        "--hang-rank", type=int, default=-1, help="this rank hangs for ever in hang_here() at --hang-at"
    )
    p.add_argument("--hang-at", type=int, default=20, help="global step after which --hang-rank hangs")
    p.add_argument("--crash-rank", type=int, default=-1, help="this rank raises at --crash-at")
    p.add_argument("--crash-at", type=int, default=20, help="global step after which --crash-rank raises")
    p.add_argument("--mode", choices=["graph", "pynative"], default="graph")
    p.add_argument("--no-bridge", action="store_true", help="train without the bridge (baseline)")
    p.add_argument(
        "--native-exit",
        action="store_true",
        help="attach mindspore's OnRequestExit on RUN/graceful_exit.json instead",
    )
    p.add_argument(
        "--monitors",
        action="store_true",
        help="add MindSpore's LossMonitor and TimeMonitor (what an unmodified script prints; "
        "with --no-bridge the dashboard shows the job from its worker logs)",
    )
    p.add_argument("--sync-interval", type=float, default=0.5, help="bridge: seconds between agreements")
    p.add_argument("--step-log", action="store_true", help="print one line per step")
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=0,
        metavar="N",
        help="also save a periodic checkpoint every N steps, per rank, into "
        "RUN/ckpt_of_rank/{rank}/lenet-{epoch}_{step}.ckpt (ModelCheckpoint, as "
        "in MindSpore's disaster-recovery sample)",
    )
    p.add_argument("--ckpt-keep", type=int, default=5, help="periodic checkpoints kept per rank (default 5)")
    p.add_argument("--lr", type=float, default=0.01, help="Momentum's learning rate (default 0.01)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--no-shuffle",
        action="store_true",
        help="read the samples in file order (tests check data positions)",
    )
    return p.parse_args(argv)


def init_job(args) -> tuple[int, int]:
    """MindSpore's context, and under msrun its communication and data parallelism: (rank, world)."""
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE, device_target="CPU")
    rank, world = 0, 1
    if os.environ.get("MS_ROLE"):  # set by msrun
        from mindspore.communication import get_group_size, get_rank, init

        init()
        rank, world = get_rank(), get_group_size()
        ms.set_auto_parallel_context(
            parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=world
        )
    # One seed on every rank: data parallelism needs identical initial weights.
    ms.set_seed(args.seed)
    return rank, world


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = init_job(args)

    dataset = create_dataset(args.data_dir, args.batch_size, rank, world, shuffle=not args.no_shuffle)
    net = LeNet5()
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), args.lr * lr_scale(), 0.9)
    model = Model(net, loss, opt)

    callbacks = []
    initial_epoch = 0
    if args.native_exit:
        # OnRequestExit reloads its own file at train begin; make it loadable and align the data.
        ckpt = os.path.join(args.run_dir, f"rank_{ms.get_context('device_id')}", "LeNet_train.ckpt")
        initial_epoch, skip = on_request_exit_resume(ckpt, args.epochs)
        if initial_epoch >= args.epochs:
            return
        if skip:
            dataset.set_init_step(skip)
        callbacks.append(
            OnRequestExit(file_name="LeNet", directory=args.run_dir, config_file=str(flag_path(args.run_dir)))
        )
    elif not args.no_bridge:
        bridge = GracefulExitBridge(args.run_dir, sync_interval_s=args.sync_interval)  # bridge
        initial_epoch = bridge.resume(dataset, epochs=args.epochs)  # bridge
        if bridge.finished:
            return  # the set resumed from already covers --epochs (the bridge logged it)
        callbacks.append(bridge)
    slow = rank == args.slow_rank
    delay = args.step_delay + (args.slow_delay if slow else 0.0)
    factor = args.slow_factor if slow else 0.0
    if delay > 0 or factor > 0:
        callbacks.append(Pacer(delay, factor, args.slow_after))
    if os.environ.get(POISON_ENV):
        callbacks.append(Poison(os.environ[POISON_ENV], opt))
    if args.step_log:
        callbacks.append(StepLog())
    if args.monitors:
        # TimeMonitor prints at each epoch's end (its per-step time is the epoch's mean).
        callbacks += [LossMonitor(), TimeMonitor()]
    if rank == args.hang_rank:
        callbacks.append(Hang(args.hang_at))
    if rank == args.crash_rank:
        callbacks.append(Crash(args.crash_at))
    if args.ckpt_every > 0:
        config = CheckpointConfig(save_checkpoint_steps=args.ckpt_every, keep_checkpoint_max=args.ckpt_keep)
        callbacks.append(
            ModelCheckpoint(
                prefix="lenet", config=config, directory=os.path.join(args.run_dir, "ckpt_of_rank", str(rank))
            )
        )
    model.train(
        args.epochs, dataset, callbacks=callbacks, dataset_sink_mode=False, initial_epoch=initial_epoch
    )


if __name__ == "__main__":
    main()
