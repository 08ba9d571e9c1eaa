"""Record the real loss curves that the spike detector's defaults are held to (issue 34).

``.venv/bin/python -m tests.bench.curves [--only demo|quickstart] [--out tests/data/curves]``

Run by hand, not in CI: the demo's whole run takes about 40 minutes here. The
files it writes are committed, and ``tests/incidents/test_spikes_curves.py``
replays them through the detector with its defaults, as heartbeats would
sample them: no detection may come out. Every step's loss of every rank is
kept (six significant digits), so the test can sample them at any rate.

- ``demo``: the demo's own job, as ``python -m trainer_bridge.demo`` runs it
  by default (2 ranks under msrun, LeNet5, the synthetic MNIST, the default
  number of epochs), without its step delay, which changes the pace and not
  the curve. The losses come from MindSpore's ``LossMonitor`` in the worker
  logs.
- ``quickstart``: MindSpore's quick start tutorial (its ``Network`` of three
  ``Dense`` layers, its data pipeline, ``SGD`` at 1e-2, batch 64, its
  functional training step), one process, on the same synthetic MNIST files,
  since nothing can be downloaded here: 30 epochs of 6,000 samples are the
  tutorial's 3 epochs of MNIST's 60,000 in steps.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "tests" / "data" / "curves"
LOSS_LINE = re.compile(r"epoch: \d+ step: \d+, loss is (\S+)")
QUICKSTART_EPOCHS = 30


def demo_defaults() -> SimpleNamespace:
    """The demo's command-line defaults, read from its click command (so the two cannot drift)."""
    from trainer_bridge.demo.__main__ import demo_command

    return SimpleNamespace(**{p.name: p.default for p in demo_command("demo", dashboard=False).params})


def demo_command(run_dir: str = "RUN") -> list[str]:
    """The demo's job with its defaults and every step's loss in the worker logs."""
    from trainer_bridge.demo.__main__ import epochs_for

    defaults = demo_defaults()
    return [
        sys.executable,
        "-m",
        "trainer_bridge.demo",
        *("--run-dir", str(run_dir), "--no-dashboard", "--no-supervise"),
        *("--ranks", str(defaults.ranks), "--samples", str(defaults.samples)),
        *("--batch-size", str(defaults.batch_size), "--epochs", str(epochs_for(defaults))),
        *("--step-delay", "0", "--ckpt-every", "0", "--monitors"),
    ]


def record_demo(work: Path, logs: Path | None = None) -> dict:
    """Train the demo's job in ``work``, or read the worker logs of one already trained (``--demo-logs``)."""
    cmd = demo_command()
    run_dir = work / "demo"
    if logs is None:
        subprocess.run(demo_command(str(run_dir)), cwd=REPO, check=True)
        logs = run_dir / "msrun_logs"
    ranks = {}
    for rank in range(demo_defaults().ranks):
        log = logs / f"worker_{rank}.log"
        ranks[str(rank)] = [
            float(f"{float(m.group(1)):.6g}")
            for m in map(LOSS_LINE.search, log.read_text(errors="replace").splitlines())
            if m
        ]
    return {
        "name": "demo",
        "what": "the demo's job with its defaults, without its step delay",
        "command": " ".join(["python", *cmd[1:]]),
        "ranks": ranks,
    }


def record_quickstart(work: Path) -> dict:
    """MindSpore's quick start, as its tutorial writes it, in this process."""
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn
    from mindspore.dataset import transforms, vision

    from trainer_bridge.demo.mnist import write_mnist

    ms.set_seed(1)
    data_dir = write_mnist(work / "mnist", samples=6000)

    def datapipe(path, batch_size):
        image_transforms = [
            vision.Rescale(1.0 / 255.0, 0),
            vision.Normalize(mean=(0.1307,), std=(0.3081,)),
            vision.HWC2CHW(),
        ]
        dataset = ds.MnistDataset(str(path), shuffle=True)
        dataset = dataset.map(image_transforms, "image")
        dataset = dataset.map(transforms.TypeCast(ms.int32), "label")
        return dataset.batch(batch_size)

    class Network(nn.Cell):
        def __init__(self):
            super().__init__()
            self.flatten = nn.Flatten()
            self.dense_relu_sequential = nn.SequentialCell(
                nn.Dense(28 * 28, 512),
                nn.ReLU(),
                nn.Dense(512, 512),
                nn.ReLU(),
                nn.Dense(512, 10),
            )

        def construct(self, x):
            return self.dense_relu_sequential(self.flatten(x))

    model = Network()
    loss_fn = nn.CrossEntropyLoss()
    optimizer = nn.SGD(model.trainable_params(), 1e-2)

    def forward_fn(data, label):
        logits = model(data)
        return loss_fn(logits, label), logits

    grad_fn = ms.value_and_grad(forward_fn, None, optimizer.parameters, has_aux=True)

    def train_step(data, label):
        (loss, _), grads = grad_fn(data, label)
        optimizer(grads)
        return loss

    losses = []
    dataset = datapipe(data_dir, 64)
    model.set_train()
    for _ in range(QUICKSTART_EPOCHS):
        for data, label in dataset.create_tuple_iterator():
            losses.append(float(f"{float(train_step(data, label).asnumpy()):.6g}"))
    return {
        "name": "quickstart",
        "what": f"MindSpore's quick start (Network, SGD 1e-2, batch 64), {QUICKSTART_EPOCHS} epochs of the "
        "synthetic MNIST, one process",
        "command": "python -m tests.bench.curves --only quickstart",
        "ranks": {"0": losses},
    }


RECORDERS = {"demo": record_demo, "quickstart": record_quickstart}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.curves", description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=sorted(RECORDERS))
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument(
        "--demo-logs",
        type=Path,
        help="read the demo's curve from the msrun_logs of a job run as demo_command() prints it",
    )
    p.add_argument("--print-demo-command", action="store_true", help="print that command and exit")
    args = p.parse_args(argv)
    if args.print_demo_command:
        print(" ".join(demo_command()))
        return 0
    import mindspore

    args.out.mkdir(parents=True, exist_ok=True)
    for name in [args.only] if args.only else list(RECORDERS):
        with tempfile.TemporaryDirectory(prefix=f"rankwatch-curve-{name}-") as tmp:
            curve = record_demo(Path(tmp), args.demo_logs) if name == "demo" else RECORDERS[name](Path(tmp))
        curve["mindspore"] = mindspore.__version__
        curve["recorded"] = datetime.date.today().isoformat()
        path = args.out / f"{name}.json.gz"
        # mtime 0: the same curve gives the same bytes.
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
            out.write(json.dumps(curve, separators=(",", ":")).encode())
        steps = {rank: len(v) for rank, v in curve["ranks"].items()}
        print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: steps per rank {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
