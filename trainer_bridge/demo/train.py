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
from mindspore.common.initializer import TruncatedNormal
from mindspore.train import Callback, Model, OnRequestExit

from trainer_bridge import GracefulExitBridge
from trainer_bridge.runfiles import flag_path


def create_dataset(data_dir: str, batch_size: int, rank: int, world: int) -> ds.Dataset:
    """The seed's LeNet pipeline: resize to 32x32, rescale, normalise, HWC->CHW."""
    mnist = ds.MnistDataset(data_dir, num_shards=world, shard_id=rank, shuffle=True)
    image_ops = [
        vision.Resize((32, 32), interpolation=vision.Inter.LINEAR),
        vision.Rescale(1.0 / 0.3081, -0.1307 / 0.3081),
        vision.Rescale(1.0 / 255.0, 0.0),
        vision.HWC2CHW(),
    ]
    mnist = mnist.map(transforms.TypeCast(ms.int32), input_columns="label")
    mnist = mnist.map(image_ops, input_columns="image")
    return mnist.batch(batch_size, drop_remainder=True)


class LeNet5(nn.Cell):
    """LeNet5 exactly as in MindSpore's graceful-exit sample."""

    def __init__(self, num_class: int = 10, channel: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channel, 6, 5, pad_mode="valid", has_bias=False,
                               weight_init=TruncatedNormal(0.02))
        self.conv2 = nn.Conv2d(6, 16, 5, pad_mode="valid", has_bias=False,
                               weight_init=TruncatedNormal(0.02))
        self.fc1 = nn.Dense(16 * 5 * 5, 120, TruncatedNormal(0.02), TruncatedNormal(0.02))
        self.fc2 = nn.Dense(120, 84, TruncatedNormal(0.02), TruncatedNormal(0.02))
        self.fc3 = nn.Dense(84, num_class, TruncatedNormal(0.02), TruncatedNormal(0.02))
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

    A rank can be slowed alone (``RANKWATCH_DEMO_SLOW_RANK``) to show a
    straggler; its peers then wait for it in the gradient AllReduce.
    """

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    def on_train_step_end(self, run_context):
        time.sleep(self.delay_s)


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
    p.add_argument("--mode", choices=["graph", "pynative"], default="graph")
    p.add_argument("--no-bridge", action="store_true", help="train without the bridge (baseline)")
    p.add_argument("--native-exit", action="store_true",
                   help="attach mindspore's OnRequestExit on RUN/graceful_exit.json instead")
    p.add_argument("--sync-interval", type=float, default=0.5, help="bridge: seconds between agreements")
    p.add_argument("--step-log", action="store_true", help="print one line per step")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE,
                   device_target="CPU")
    rank, world = 0, 1
    if os.environ.get("MS_ROLE"):  # set by msrun
        from mindspore.communication import get_group_size, get_rank, init
        init()
        rank, world = get_rank(), get_group_size()
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL,
                                     gradients_mean=True, device_num=world)
    # One seed on every rank: data parallelism needs identical initial weights.
    ms.set_seed(args.seed)

    dataset = create_dataset(args.data_dir, args.batch_size, rank, world)
    net = LeNet5()
    loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    model = Model(net, loss, opt)

    callbacks = []
    initial_epoch = 0
    if args.native_exit:
        callbacks.append(OnRequestExit(file_name="LeNet", directory=args.run_dir,
                                       config_file=str(flag_path(args.run_dir))))
    elif not args.no_bridge:
        bridge = GracefulExitBridge(args.run_dir, sync_interval_s=args.sync_interval)  # bridge
        initial_epoch = bridge.resume(dataset)                                        # bridge
        callbacks.append(bridge)
    delay = args.step_delay + (args.slow_delay if rank == args.slow_rank else 0.0)
    if delay > 0:
        callbacks.append(Pacer(delay))
    if args.step_log:
        callbacks.append(StepLog())
    model.train(args.epochs, dataset, callbacks=callbacks, dataset_sink_mode=False,
                initial_epoch=initial_epoch)


if __name__ == "__main__":
    main()
