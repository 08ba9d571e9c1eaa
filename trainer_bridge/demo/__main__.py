"""``python -m trainer_bridge.demo [--run-dir RUN] [--ranks N] [--dashboard]``: a real msrun CPU job.

It writes synthetic MNIST-format files under ``RUN/mnist`` (nothing can be
downloaded), then launches ``msrun`` with N workers running
``trainer_bridge/demo/train.py`` (LeNet5 with the bridge attached, and a
periodic per-rank ``ModelCheckpoint``). By default it trains for at least
``--minutes`` (15) at a pace a person can follow, or until it is stopped.
With ``--dashboard`` it also starts the dashboard on the same run directory,
prints the one line to open, and keeps the dashboard up after the job ends,
until Ctrl-C. msrun's and the dashboard's own output go to log files in the
run directory, so the terminal stays readable.

Relaunching the same command resumes from the newest complete checkpoint set
of a graceful stop.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from trainer_bridge.demo.mnist import write_mnist

TRAIN_SCRIPT = Path(__file__).with_name("train.py")
# --loop: the same job as a functional loop (ms.value_and_grad + bridge.loop).
LOOP_SCRIPT = Path(__file__).with_name("train_loop.py")
# The dashboard's start-up line naming the URL to open (app/server.py, announce).
OPEN_PREFIX = "Rankwatch: open "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_command(
    run_dir: Path, ranks: int, train_args: list[str], master_port: int, script: Path = TRAIN_SCRIPT
) -> list[str]:
    """The msrun command line; msrun itself runs ``python`` from PATH (see ``job_env``)."""
    return [
        sys.executable,
        "-m",
        "mindspore.parallel.cluster.run",
        f"--worker_num={ranks}",
        f"--local_worker_num={ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={master_port}",
        "--join=True",
        f"--log_dir={run_dir / 'msrun_logs'}",
        str(script),
        *train_args,
    ]


def job_env() -> dict:
    """msrun starts workers as a bare ``python``: put this interpreter's directory first."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("GLOG_v", "3")  # MindSpore's C++ log level: errors only
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def parse_args(
    argv=None, prog: str = "python -m trainer_bridge.demo"
) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(
        prog=prog,
        description=__doc__.splitlines()[0].split(": ", 1)[-1],
        epilog="Unknown options go to train.py (see python trainer_bridge/demo/train.py --help).",
    )
    p.add_argument("--run-dir", type=Path, default=Path("runs/demo"), help="default runs/demo")
    p.add_argument("--ranks", type=int, default=2, help="msrun workers (default 2)")
    p.add_argument(
        "--minutes",
        type=float,
        default=15.0,
        help="train for at least this long (default 15): the epochs are sized from the "
        "step delay, which every step waits at least; ignored with --epochs",
    )
    p.add_argument("--epochs", type=int, default=None, help="train exactly this many epochs instead")
    p.add_argument("--samples", type=int, default=6000, help="synthetic MNIST samples (default 6000)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    p.add_argument(
        "--step-delay",
        type=float,
        default=0.05,
        help="seconds each rank sleeps per step, so a human can watch (default 0.05)",
    )
    p.add_argument(
        "--ckpt-every",
        type=int,
        default=300,
        metavar="N",
        help="a periodic ModelCheckpoint every N steps per rank, keeping the newest 5, so "
        "the checkpoint browser has complete sets while the job runs (default 300; 0: none)",
    )
    p.add_argument(
        "--loop",
        action="store_true",
        help="train as a functional loop (train_loop.py: ms.value_and_grad and bridge.loop) "
        "instead of Model.train with the callback",
    )
    p.add_argument("--master-port", type=int, default=0, help="msrun master port (default: a free one)")
    p.add_argument("--dashboard", action="store_true", help="also start the dashboard on the run dir")
    p.add_argument("--host", default="127.0.0.1", help="dashboard host")
    p.add_argument("--port", type=int, default=5000, help="dashboard port")
    return p.parse_known_args(argv)


def epochs_for(args: argparse.Namespace) -> int:
    """Epochs that last at least ``--minutes``: every step sleeps ``--step-delay`` at least."""
    if args.epochs is not None:
        return args.epochs
    if args.step_delay <= 0:
        raise SystemExit("--minutes needs a --step-delay above 0 (or give --epochs)")
    steps_per_epoch = max(1, math.ceil(args.samples / args.ranks) // args.batch_size)
    return max(1, math.ceil(args.minutes * 60 / (steps_per_epoch * args.step_delay)))


def start_dashboard(args: argparse.Namespace, run_dir: Path, env: dict) -> subprocess.Popen:
    """``python -m app`` on the run directory; its output goes to RUN/dashboard.log.

    The demo repeats the dashboard's own "open this URL" line, once, so that
    the terminal shows one line to open.
    """
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "--run-dir",
            str(run_dir),
            "--host",
            args.host,
            "--port",
            str(args.port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    log_path = run_dir / "dashboard.log"

    def relay() -> None:
        told = False
        last = ""
        with open(log_path, "a") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                last = line.strip() or last
                if not told and line.startswith(OPEN_PREFIX):
                    told = True
                    print(f"rankwatch demo: open {line[len(OPEN_PREFIX) :].strip()}", flush=True)
        if not told:
            print(f"rankwatch demo: the dashboard did not start ({last}); see {log_path}", flush=True)

    threading.Thread(target=relay, daemon=True).start()
    return proc


def main(argv=None, prog: str = "python -m trainer_bridge.demo") -> int:
    args, extra = parse_args(argv, prog)
    if args.ranks < 1:
        raise SystemExit("--ranks must be at least 1")
    run_dir = args.run_dir.resolve()
    (run_dir / "msrun_logs").mkdir(parents=True, exist_ok=True)
    data_dir = write_mnist(run_dir / "mnist", samples=args.samples)
    epochs = epochs_for(args)
    train_args = [
        "--run-dir",
        str(run_dir),
        "--data-dir",
        str(data_dir),
        "--epochs",
        str(epochs),
        "--batch-size",
        str(args.batch_size),
        "--step-delay",
        str(args.step_delay),
        "--ckpt-every",
        str(args.ckpt_every),
        *extra,
    ]
    env = job_env()
    dashboard = start_dashboard(args, run_dir, env) if args.dashboard else None
    script = LOOP_SCRIPT if args.loop else TRAIN_SCRIPT
    cmd = msrun_command(run_dir, args.ranks, train_args, args.master_port or free_port(), script)
    launcher_log = run_dir / "msrun_logs" / "launcher.log"
    length = f"{epochs} epochs" if args.epochs is not None else f"at least {args.minutes:g} min"
    print(
        f"rankwatch demo: {args.ranks} ranks training LeNet5 in {run_dir} for {length}, or until "
        f"stopped (worker logs in {run_dir / 'msrun_logs'})",
        flush=True,
    )
    with open(launcher_log, "ab") as out:
        # msrun tails every worker's log to its own output with --join: into a file.
        job = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        code = job.wait()
        print(
            f"rankwatch demo: the job exited with {code}; worker logs in {run_dir / 'msrun_logs'}", flush=True
        )
        if code == 0:
            print("rankwatch demo: run the same command again to resume from its last stop", flush=True)
        if dashboard is not None:
            print("rankwatch demo: the dashboard stays up; Ctrl-C to quit", flush=True)
            dashboard.wait()
    except KeyboardInterrupt:
        code = 130
    finally:
        for proc in (job, dashboard):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return code


if __name__ == "__main__":
    sys.exit(main())
