"""``python -m trainer_bridge.demo --run-dir RUN --ranks N``: a real msrun CPU job.

It writes synthetic MNIST-format files under ``RUN/mnist`` (nothing can be
downloaded), then launches ``msrun`` with N workers running
``trainer_bridge/demo/train.py`` (LeNet5 with the bridge attached). With
``--dashboard`` it also starts ``python -m app`` on the same run directory
and keeps it up after the job ends, until Ctrl-C.

Relaunching the same command resumes from the newest complete checkpoint set.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from trainer_bridge.demo.mnist import write_mnist

TRAIN_SCRIPT = Path(__file__).with_name("train.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def msrun_command(run_dir: Path, ranks: int, train_args: list[str], master_port: int) -> list[str]:
    """The msrun command line; msrun itself runs ``python`` from PATH (see ``job_env``)."""
    return [
        sys.executable, "-m", "mindspore.parallel.cluster.run",
        f"--worker_num={ranks}", f"--local_worker_num={ranks}",
        "--master_addr=127.0.0.1", f"--master_port={master_port}",
        "--join=True", f"--log_dir={run_dir / 'msrun_logs'}",
        str(TRAIN_SCRIPT), *train_args,
    ]


def job_env() -> dict:
    """msrun starts workers as a bare ``python``: put this interpreter's directory first."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("GLOG_v", "3")  # MindSpore's C++ log level: errors only
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def parse_args(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m trainer_bridge.demo",
                                description=__doc__.splitlines()[0],
                                epilog="Unknown options go to train.py (see its --help).")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--ranks", type=int, default=2, help="msrun workers (default 2)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=6000, help="synthetic MNIST samples (default 6000)")
    p.add_argument("--step-delay", type=float, default=0.05,
                   help="seconds each rank sleeps per step, so a human can watch (default 0.05)")
    p.add_argument("--master-port", type=int, default=0, help="msrun master port (default: a free one)")
    p.add_argument("--dashboard", action="store_true", help="also start the dashboard on the run dir")
    p.add_argument("--host", default="127.0.0.1", help="dashboard host")
    p.add_argument("--port", type=int, default=5000, help="dashboard port")
    return p.parse_known_args(argv)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    if args.ranks < 1:
        raise SystemExit("--ranks must be at least 1")
    run_dir = args.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    data_dir = write_mnist(run_dir / "mnist", samples=args.samples)
    train_args = ["--run-dir", str(run_dir), "--data-dir", str(data_dir), "--epochs", str(args.epochs),
                  "--step-delay", str(args.step_delay), *extra]
    env = job_env()
    dashboard = None
    if args.dashboard:
        dashboard = subprocess.Popen([sys.executable, "-m", "app", "--run-dir", str(run_dir),
                                      "--host", args.host, "--port", str(args.port)], env=env)
    cmd = msrun_command(run_dir, args.ranks, train_args, args.master_port or free_port())
    print(f"rankwatch demo: {args.ranks} ranks, run dir {run_dir}", flush=True)
    job = subprocess.Popen(cmd, env=env)
    try:
        code = job.wait()
        print(f"rankwatch demo: job exited with {code}; worker logs in {run_dir / 'msrun_logs'}",
              flush=True)
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
