"""The demo's functional-loop worker: LeNet5 trained as MindSpore's data-parallel tutorial does.

No ``Model`` and no callbacks: ``ms.value_and_grad``, ``nn.DistributedGradReducer``
and ``optimizer(grads)`` in a jitted step, and a ``for`` loop over the data.
The bridge takes the loop's place: the lines marked ``# bridge`` are all it
takes. ``python -m trainer_bridge.demo --loop`` launches it under ``msrun``;
it takes ``train.py``'s options, of which it uses the training ones
(``--epochs``, ``--batch-size``, ``--lr``, ``--seed``, ``--mode``,
``--step-delay``, ``--sync-interval``, ``--step-log``, ``--no-shuffle``,
``--no-bridge``).

With ``--step-log`` each step prints ``step G epoch E t T data CRC opt_step N``:
the global step, a CRC of the batch's labels (where in the data it is) and
the optimizer's own step counter (whether its state was resumed); at the end
it prints ``bridge.stopped True|False``.
"""

from __future__ import annotations

import time
import zlib

import mindspore as ms
from mindspore import nn

from trainer_bridge import GracefulExitBridge
from trainer_bridge.demo.train import LeNet5, create_dataset, hang_here, init_job, parse_args


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = init_job(args)  # msrun's communication, data parallel, one seed on every rank

    dataset = create_dataset(args.data_dir, args.batch_size, rank, world, shuffle=not args.no_shuffle)
    net = LeNet5()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), args.lr, 0.9)

    def forward(x, y):
        return loss_fn(net(x), y)

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    if world > 1:
        grad_reducer = nn.DistributedGradReducer(opt.parameters)  # mean of the ranks' gradients

        @ms.jit
        def train_step(x, y):
            loss, grads = grad_fn(x, y)
            opt(grad_reducer(grads))
            return loss

    else:

        @ms.jit
        def train_step(x, y):
            loss, grads = grad_fn(x, y)
            opt(grads)
            return loss

    if args.no_bridge:
        iterator = dataset.create_tuple_iterator(num_epochs=args.epochs)
        rows = (row for _ in range(args.epochs) for row in iterator)
        bridge = None
    else:
        bridge = GracefulExitBridge(args.run_dir, sync_interval_s=args.sync_interval)  # bridge
        rows = bridge.loop(dataset, network=net, optimizer=opt, epochs=args.epochs)  # bridge
    delay = args.step_delay + (args.slow_delay if rank == args.slow_rank else 0.0)
    step = 0
    for x, y in rows:
        loss = train_step(x, y)
        if bridge is not None:
            bridge.report(loss=loss)  # bridge
            step = bridge.global_step
        else:
            step += 1
        if delay > 0:
            time.sleep(delay)
        if rank == args.hang_rank and step == args.hang_at:
            print(f"hanging at step {step} (--hang-rank)", flush=True)
            hang_here()
        if args.step_log:
            crc = zlib.crc32(y.asnumpy().tobytes())
            print(
                f"step {step} epoch {bridge.epoch if bridge else (step - 1) // dataset.get_dataset_size() + 1} "
                f"t {time.monotonic():.4f} "
                f"data {crc:08x} opt_step {int(opt.global_step.asnumpy()[0])}",
                flush=True,
            )
    if bridge is not None:
        print(f"bridge.stopped {bridge.stopped}", flush=True)


if __name__ == "__main__":
    main()
