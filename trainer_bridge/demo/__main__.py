"""``python -m trainer_bridge.demo [--run-dir RUN] [--ranks N] [--dashboard]``: a real msrun CPU job.

It writes synthetic MNIST-format files under ``RUN/mnist`` (nothing can be
downloaded), then launches ``msrun`` with N workers running
``trainer_bridge/demo/train.py`` (LeNet5 with the bridge attached, and a
periodic per-rank ``ModelCheckpoint``). By default it trains for at least
``--minutes`` (15) at a pace a person can follow, or until it is stopped.
With ``--dashboard`` it first starts the dashboard on the same run directory
(a port in use ends the demo before anything trains), prints the one line
to open, and keeps the dashboard up after the job ends, until Ctrl-C. msrun's and the dashboard's own output go to log files in the
run directory, so the terminal stays readable.

Relaunching the same command resumes from the newest complete checkpoint set
of a graceful stop. With ``--supervise`` (``rankwatch demo``'s default) the
job runs under ``rankwatch launch``: a rank that dies is relaunched from the
newest healthy set, and Ctrl-C asks for a graceful stop (twice: at once).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import click

TRAIN_SCRIPT = Path(__file__).with_name("train.py")
# --loop: the same job as a functional loop (ms.value_and_grad + bridge.loop).
LOOP_SCRIPT = Path(__file__).with_name("train_loop.py")
# The dashboard's start-up line naming the URL to open (app/serve/server.py, announce).
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


CONTEXT = {
    "ignore_unknown_options": True,
    "allow_extra_args": True,
    "help_option_names": ["-h", "--help"],
}


def demo_command(name: str, dashboard: bool) -> click.Command:
    """The demo as a click command; ``rankwatch demo`` starts the dashboard by default, this module not."""

    @click.command(
        name,
        context_settings=CONTEXT,
        epilog="Unknown options go to train.py (python trainer_bridge/demo/train.py --help lists them).",
    )
    @click.option(
        "--run-dir", type=click.Path(file_okay=False, path_type=Path), default="runs/demo", show_default=True
    )
    @click.option("--ranks", type=click.IntRange(min=1), default=2, show_default=True, help="msrun workers.")
    @click.option(
        "--minutes",
        type=float,
        default=15.0,
        show_default=True,
        help="Train for at least this long: the epochs are sized from the step delay, which every "
        "step waits at least; ignored with --epochs.",
    )
    @click.option(
        "--epochs", type=click.IntRange(min=1), default=None, help="Train exactly this many epochs."
    )
    @click.option("--samples", type=int, default=6000, show_default=True, help="Synthetic MNIST samples.")
    @click.option("--batch-size", type=int, default=32, show_default=True, help="Per rank.")
    @click.option(
        "--step-delay",
        type=float,
        default=0.05,
        show_default=True,
        help="Seconds each rank sleeps per step, so a human can watch.",
    )
    @click.option(
        "--ckpt-every",
        type=int,
        default=300,
        show_default=True,
        metavar="N",
        help="A periodic ModelCheckpoint every N steps per rank, keeping the newest 5, so the "
        "checkpoint browser has complete sets while the job runs (0: none).",
    )
    @click.option(
        "--loop",
        is_flag=True,
        help="Train as a functional loop (train_loop.py: ms.value_and_grad and bridge.loop) "
        "instead of Model.train with the callback.",
    )
    @click.option("--master-port", type=int, default=0, help="msrun's master port (default: a free one).")
    @click.option(
        "--dashboard/--no-dashboard",
        default=dashboard,
        show_default=True,
        help="Also serve the dashboard on the run directory (started first: if it cannot start, "
        "nothing trains).",
    )
    @click.option(
        "--supervise/--no-supervise",
        default=dashboard,
        show_default=True,
        help="Run the job under `rankwatch launch`: a rank that dies is relaunched from the newest "
        "healthy set, and Ctrl-C stops the job gracefully (twice: at once).",
    )
    @click.option("--host", default="127.0.0.1", show_default=True, help="The dashboard's interface.")
    @click.option(
        "--port",
        type=click.IntRange(0, 65535),
        default=5000,
        show_default=True,
        help="The dashboard's port; 0 picks a free one.",
    )
    @click.pass_context
    def demo(ctx: click.Context, **options) -> None:
        """Train a real msrun CPU job (LeNet5 on synthetic MNIST), with the dashboard or without.

        It trains for at least --minutes at a pace a person can follow, or
        until stopped; relaunching the same command resumes from the newest
        complete checkpoint set of a graceful stop. msrun's and the
        dashboard's output go to files in the run directory.
        """
        if importlib.util.find_spec("mindspore") is None:
            raise click.ClickException(
                "the demo trains with MindSpore, which is not installed here: pip install 'rankwatch[trainer]'"
            )
        ctx.exit(run(SimpleNamespace(**options), list(ctx.args)))

    return demo


def epochs_for(args: SimpleNamespace) -> int:
    """Epochs that last at least ``--minutes``: every step sleeps ``--step-delay`` at least."""
    if args.epochs is not None:
        return args.epochs
    if args.step_delay <= 0:
        raise SystemExit("--minutes needs a --step-delay above 0 (or give --epochs)")
    steps_per_epoch = max(1, math.ceil(args.samples / args.ranks) // args.batch_size)
    return max(1, math.ceil(args.minutes * 60 / (steps_per_epoch * args.step_delay)))


def running_dashboard(run_dir: Path) -> str | None:
    """A login link to this user's dashboard that serves ``run_dir`` already (``rankwatch login``), or None.

    The first demo keeps its dashboard up after the job ends, and says "run the same command
    again to resume": the second then trains under that dashboard rather than fail on its port.
    """
    try:
        out = subprocess.run(
            [sys.executable, "-m", "app.cli", "login", "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    link = re.search(r"https?://\S+", out.stdout)
    return link[0] if out.returncode == 0 and link else None


def start_dashboard(args: SimpleNamespace, run_dir: Path, env: dict) -> subprocess.Popen | None:
    """``python -m app`` on the run directory, its output in RUN/dashboard.log; None if it did not start.

    Waits until the dashboard prints its "open" line (gunicorn has bound the
    port), so that the job never trains without the dashboard asked for: a
    port in use ends the demo with the dashboard's own message. The demo
    repeats that line, with its single-use login link, on its own output
    only: the log gets the address without the link.
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
        # The link is wanted here (the demo's terminal), not where the dashboard's output goes.
        env={**env, "RANKWATCH_LOGIN_LINK": "always"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    log_path = run_dir / "dashboard.log"
    ready = threading.Event()
    last: list[str] = []

    def relay() -> None:
        with open(log_path, "a") as log:
            for line in proc.stdout:
                if line.startswith(OPEN_PREFIX) and not ready.is_set():
                    url = line[len(OPEN_PREFIX) :].strip()
                    print(f"rankwatch demo: open {url}", flush=True)
                    line = f"{OPEN_PREFIX}{url.split('#', 1)[0]} (login link printed to the terminal only)\n"
                    ready.set()
                log.write(line)
                log.flush()
                if line.strip():
                    last[:] = [*last[-2:], line.strip()]

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        while not ready.wait(0.2):
            if proc.poll() is not None:
                reader.join(timeout=5)
                if ready.is_set():
                    break
                said = "; ".join(last) or f"exit status {proc.returncode}"
                print(f"rankwatch demo: the dashboard did not start ({said}); see {log_path}", flush=True)
                print("rankwatch demo: nothing was trained", flush=True)
                return None
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C, or a signal (run's handler)
        end(proc)
        raise
    return proc


def end(proc: subprocess.Popen | None) -> None:
    """Interrupt ``proc`` as Ctrl-C would, then kill it if it lingers."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None, prog: str = "python -m trainer_bridge.demo") -> None:
    """The demo without the dashboard by default (``rankwatch demo`` starts it)."""
    demo_command("demo", dashboard=False).main(argv, prog_name=prog)


class _Signalled(SystemExit):
    """SIGTERM or SIGHUP: the demo ends as Ctrl-C ends it."""


def _exit_on_signal(signum, _frame):
    # kill, or the terminal closed: end the job and the dashboard as Ctrl-C
    # does (under rankwatch launch, a graceful stop), rather than leave them
    # running (and the port taken) without us.
    raise _Signalled(128 + signum)


def busy(run_dir: Path) -> str | None:
    """Why the demo must not start in ``run_dir``: a job trains there (the bridge's own check), else None.

    Checked before anything starts: a second msrun into a busy run directory truncated the
    running job's logs before its bridge refused (issue 33, section 2).
    """
    from trainer_bridge.rundir import launchguard

    live = launchguard.live_others(run_dir, host=socket.gethostname(), now=time.time())[1]
    if not live:
        return None
    return (
        f"rankwatch demo: {launchguard.refusal(run_dir, live)} With make: make demo RUN=another/dir. "
        "Nothing was started."
    )


def run(args: SimpleNamespace, extra: list[str]) -> int:
    """Launch the job (and the dashboard first); returns the job's exit status."""
    run_dir = args.run_dir.resolve()
    said = busy(run_dir)
    if said:
        print(said, file=sys.stderr, flush=True)
        return 1
    (run_dir / "msrun_logs").mkdir(parents=True, exist_ok=True)
    env = job_env()
    dashboard = job = None
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        if args.dashboard:
            link = running_dashboard(run_dir)
            if link:
                print(
                    f"rankwatch demo: this run directory's dashboard is up already: open {link}", flush=True
                )
            else:
                dashboard = start_dashboard(args, run_dir, env)
                if dashboard is None:
                    return 1
        job = launch(args, extra, run_dir, env)
        code = job.wait()
        print(
            f"rankwatch demo: the job exited with {code}; worker logs in {run_dir / 'msrun_logs'}", flush=True
        )
        if code == 0:
            # A stop from the page or `rankwatch stop` ends the job as Ctrl-C does: the same words.
            said = stopped_line(run_dir)
            print(
                said
                if " stopped gracefully at " in said
                else "rankwatch demo: run the same command again to resume from its last stop",
                flush=True,
            )
        if dashboard is not None and dashboard.poll() is None:
            print("rankwatch demo: the dashboard stays up; Ctrl-C to quit", flush=True)
            dashboard.wait()
    except (KeyboardInterrupt, _Signalled) as e:
        code = 130 if isinstance(e, KeyboardInterrupt) else e.code
        if job is not None and job.poll() is None and getattr(args, "supervise", False):
            code = stop_supervised(job)
            with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP)
                print(stopped_line(run_dir), flush=True)
    finally:
        end(job)
        end(dashboard)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


def stop_supervised(job: subprocess.Popen) -> int:
    """Ctrl-C under ``rankwatch launch``: ask it for the graceful stop and wait; a second Ctrl-C ends it at once."""
    print(
        "rankwatch demo: stopping gracefully: every rank saves at the same step, then exits "
        "(Ctrl-C again ends the job at once)",
        flush=True,
    )
    job.send_signal(signal.SIGINT)
    while True:
        try:
            return job.wait()
        except KeyboardInterrupt:
            job.send_signal(signal.SIGINT)


def stopped_line(run_dir: Path) -> str:
    """What the terminal says once a graceful stop has ended the job: where it stopped, from attempts.jsonl."""
    from trainer_bridge.rundir import attempts

    try:
        rows = attempts.fold(attempts.read_lines(run_dir)[0])
    except OSError:
        rows = []
    last = rows[-1] if rows else {}
    if last.get("end") == "graceful_stop" and last.get("last_step") is not None:
        return (
            f"rankwatch demo: stopped gracefully at global step {last['last_step']}: every rank saved a "
            "checkpoint there; run the same command again to resume from it"
        )
    return (
        "rankwatch demo: the job ended without a graceful stop (see "
        f"{run_dir / 'msrun_logs'}); the same command resumes from the newest complete checkpoint set"
    )


def launch(args: SimpleNamespace, extra: list[str], run_dir: Path, env: dict) -> subprocess.Popen:
    """The training data, then msrun with its output in ``msrun_logs/launcher.log``."""
    from trainer_bridge.demo.mnist import write_mnist

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
    script = LOOP_SCRIPT if args.loop else TRAIN_SCRIPT
    cmd = msrun_command(run_dir, args.ranks, train_args, args.master_port or free_port(), script)
    launcher_log = run_dir / "msrun_logs" / "launcher.log"
    length = f"{epochs} epochs" if args.epochs is not None else f"at least {args.minutes:g} min"
    print(
        f"rankwatch demo: {args.ranks} ranks training LeNet5 in {run_dir} for {length}, or until "
        f"stopped (worker logs in {run_dir / 'msrun_logs'})",
        flush=True,
    )
    if getattr(args, "supervise", False):
        # rankwatch launch (app/supervise) runs msrun as its own child; a session of its own, so that
        # Ctrl-C reaches it once, from run(), as the request for a graceful stop.
        cmd = [sys.executable, "-m", "app.cli", "launch", "--run-dir", str(run_dir), "--", *cmd]
    with open(launcher_log, "ab") as out:
        # msrun tails every worker's log to its own output with --join: into a file.
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=bool(getattr(args, "supervise", False)),
        )


if __name__ == "__main__":
    main()
