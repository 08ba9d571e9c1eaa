"""Functional-loop overhead: ``python -m tests.bench.loop [--jobs 4] [--pairs 10] [--sizes lenet tiny] [--quick]``.

Throughput of a functional training loop with ``bridge.loop`` / the same
loop without it (target >= 0.99, the 95% interval's low end >= 0.98), in
``msrun`` jobs by the method of ``tests/bench/ab.py`` (ranks bound to a core
each, MindSpore's threads bounded, side order shuffled per round, warm-up
left out). A side's step is ``ms.value_and_grad`` + ``nn.DistributedGradReducer``
+ ``optimizer(grads)`` in one Cell, over in-memory data, at two step sizes: LeNet5
(batch 32) and a tiny dense net (steps of a few ms). Each bridge side is a
fresh ``GracefulExitBridge`` (its own reporter thread, heartbeats, flag
polls and agreements) and reports its loss every step with
``bridge.report(loss=...)``, as the README's loop example does.

``--variants`` adds sides with one part of the bridge switched off
(``ab.VARIANTS``), to attribute a cost.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.bench import ab


def step_cell():
    """The step as a Cell, not an ``ms.jit`` function (see ``sides``)."""
    import mindspore as ms
    from mindspore import nn

    class Step(nn.Cell):
        """``ms.value_and_grad`` + ``nn.DistributedGradReducer`` + ``optimizer(grads)``, one graph."""

        def __init__(self, net, loss_fn, opt, distributed: bool):
            super().__init__()
            self.net, self.loss_fn, self.opt = net, loss_fn, opt
            self.distributed = distributed
            self.grad_fn = ms.value_and_grad(self.forward, None, opt.parameters)
            self.reducer = nn.DistributedGradReducer(opt.parameters) if distributed else None

        def forward(self, x, y):
            return self.loss_fn(self.net(x), y)

        def construct(self, x, y):
            loss, grads = self.grad_fn(x, y)
            if self.distributed:
                grads = self.reducer(grads)
            self.opt(grads)
            return loss

    return Step


def sides(args, size: str, rank: int) -> dict:
    """The plain loop and the bridge variants at ``size``, the step compiled.

    The step is a Cell: the same body in an ``@ms.jit`` function costs about
    100 ms of CPU per call on MindSpore 2.10's CPU backend (the Cell 10 ms,
    LeNet5 at batch 32), which would hide any per-step cost of the bridge.
    """
    from mindspore import nn

    from trainer_bridge import GracefulExitBridge

    Step = step_cell()
    steps, warmup = ab.plan(args, size)
    batch = ab.SIZES[size]["batch"]
    net, inputs, labels = ab.size_model(size, batch, steps, rank)
    dataset = ab.dataset_of(inputs, labels, batch)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)

    train_step = Step(net, loss_fn, opt, distributed=args.ranks > 1)

    def plain(_round):
        side = ab.Side(warmup)
        for x, y in dataset.create_tuple_iterator(num_epochs=1):
            train_step(x, y)
            side.step_ended()
        return side.done()

    def with_bridge(name):
        def run(i):
            switched_off, kwargs = ab.variant(name)
            with switched_off:
                bridge = GracefulExitBridge(Path(args.run_dir) / f"{size}-{name}-{i}", resume=False, **kwargs)
                side = ab.Side(warmup, bridge)
                for x, y in bridge.loop(dataset, network=net, optimizer=opt, epochs=1):
                    bridge.report(loss=train_step(x, y))
                    side.step_ended()
                return side.done()

        return run

    plain(-1)  # compile the step
    return {ab.BASELINE: plain, **{name: with_bridge(name) for name in args.variants}}


def worker(args) -> None:
    ab.run_worker(args, sides)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ab.add_arguments(p)
    p.add_argument(
        "--variants",
        nargs="+",
        default=["bridge"],
        choices=[v for v in ab.VARIANTS if v != "no-step-begin"],
        help="bridge sides against the plain loop (default: bridge)",
    )
    args = ab.parse(p, argv)
    if args.as_worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(prefix="rankwatch-bench-loop-") as tmp:
        args.run_dir = tmp
        result, load = ab.launch(Path(__file__).resolve(), args, ["--variants", *args.variants])
    ab.print_report(
        "bridge.loop / the same functional loop without it, " + ab.where(args), args, result, load
    )


if __name__ == "__main__":
    main()
