"""A real Slurm on the loopback, for the Slurm tests (fixture ``slurm`` in conftest).

Debian's ``munged``, ``slurmctld`` and ``slurmd`` (``apt-get install slurm-wlm
munge``; ``.ci/run`` installs them), started as root with a ``slurm.conf``
generated in the test's own directory: one node with this machine's CPUs,
its own state and spool directories, its own munge socket and key, and free
ports, so that two tests (``-n 2``) or a developer's system Slurm never meet.
Clients (``sbatch``, ``squeue``...) find it through ``SLURM_CONF``, which
``env`` carries; ``run`` calls them with it.

``unavailable()`` says why Slurm cannot run here (not root, not installed);
the fixture skips with that reason, except under ``CI=true``, where it fails:
CI always runs the Slurm tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.liveserver import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "sinfo", "scontrol", "scancel", "srun")
START_TIMEOUT_S = 60.0  # a failure guard; the start waits on sinfo's answer
# Credentials' lifetime, and so a requeued job's wait before it runs again (AuthInfo's cred_expire).
CRED_EXPIRE_S = 20


def unavailable() -> str | None:
    """Why this machine cannot run the Slurm tests, or None."""
    missing = [n for n in (*DAEMONS, *CLIENTS) if shutil.which(n) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which runs jobs as their users: they need root"
    return None


class SlurmError(AssertionError):
    pass


class Slurm:
    """One controller and one node; ``start()`` returns once ``sinfo`` shows the node idle."""

    def __init__(self, tmp_path: Path, kill_wait_s: int = 30, cpus: int | None = None):
        self.dir = Path(tmp_path) / "slurm"
        self.kill_wait_s = kill_wait_s
        self.cpus = cpus or os.cpu_count() or 1
        self.host = socket.gethostname()
        # One name per instance: a node name also names the node's state in slurmctld's files.
        self.node = f"rw{free_port()}"
        self.partition = "rw"
        self.conf = self.dir / "slurm.conf"
        self.munge_socket = self.dir / "munge" / "munge.socket"
        self.procs: dict[str, subprocess.Popen] = {}
        # The jobs' environment (sbatch's --export=ALL) as a user's who activated the venv: the
        # template runs `rankwatch` and `msrun` from PATH, and `make test` calls the venv's python
        # without putting its bin/ on PATH.
        venv_bin = os.path.dirname(sys.executable)
        path = os.environ.get("PATH", "")
        self.env = {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": path if path.split(os.pathsep)[0] == venv_bin else f"{venv_bin}{os.pathsep}{path}",
        }
        for var in [v for v in self.env if v.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_"))]:
            if var != "SLURM_CONF":
                # The tests may themselves run inside a Slurm job: its variables would steer the clients.
                del self.env[var]

    # ----------------------------------------------------------------- start

    def start(self) -> Slurm:
        try:
            self._write_files()
            self._start_munged()
            self._start("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
            self._wait(
                lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, "slurmctld answers"
            )
            self._start("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node])
            self._wait(lambda: self.node_state() == "idle", f"node {self.node} idle")
        except BaseException:
            self.stop()
            raise
        return self

    def _write_files(self) -> None:
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        # munged insists on a key only its user reads, in directories others cannot write.
        os.chmod(self.dir / "munge", 0o700)
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        ctld_port, d_port = free_port(), free_port()
        d = self.dir
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=rankwatch",
                    f"SlurmctldHost={self.host}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={d_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    # cred_expire is also how long a requeued job waits before it runs again (120 s by
                    # default): slurmd refuses to start it while it still holds the job's revoked
                    # credential ("Job credential revoked"), so the tests shorten the wait, never skip it.
                    f"AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
                    f"StateSaveLocation={d}/state",
                    f"SlurmdSpoolDir={d}/spool",
                    f"SlurmctldPidFile={d}/run/slurmctld.pid",
                    f"SlurmdPidFile={d}/run/slurmd.pid",
                    f"SlurmctldLogFile={d}/log/slurmctld.log",
                    f"SlurmdLogFile={d}/log/slurmd.log",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    # No cgroup here (a container): processes tracked by their parents, no task binding.
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    f"KillWait={self.kill_wait_s}",
                    # A requeued job waits BatchStartTimeout-ish before it runs again; keep the tests short.
                    "MinJobAge=300",
                    "SlurmdParameters=config_overrides",
                    f"NodeName={self.node} NodeHostname={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} "
                    "RealMemory=1 State=UNKNOWN",
                    f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def _start_munged(self) -> None:
        m = self.dir / "munge"
        self._start(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",  # as root, and in /tmp (world-writable, sticky)
                f"--socket={self.munge_socket}",
                f"--key-file={m / 'munge.key'}",
                f"--pid-file={m / 'munged.pid'}",
                f"--seed-file={m / 'munged.seed'}",
                f"--log-file={self.dir / 'log' / 'munged.log'}",
            ],
        )
        self._wait(self.munge_socket.exists, "munged's socket")

    def _start(self, name: str, argv: list[str]) -> None:
        out = open(self.dir / "log" / f"{name}.out", "ab")
        # A session of its own: stop() ends the daemon and whatever it forked (slurmstepd).
        self.procs[name] = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        out.close()

    def _wait(self, ready, what: str, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise SlurmError(f"{name} exited ({proc.returncode}) waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out waiting for {what}\n{self.logs()}")
            time.sleep(0.2)

    # --------------------------------------------------------------- clients

    def run(self, argv: list[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} -> {r.returncode}: {r.stderr}\n{self.logs()}")
        return r

    def node_state(self) -> str:
        r = self.run(["sinfo", "-h", "-n", self.node, "-o", "%T"], check=False)
        return r.stdout.strip() if r.returncode == 0 else ""

    def sbatch(self, script: Path, *args: str, cwd: Path | None = None, env: dict | None = None) -> str:
        """Submit; ``env`` (the job's environment, sbatch's --export=ALL) is laid over the clients'."""
        r = subprocess.run(
            ["sbatch", "--parsable", *args, str(script)],
            env={**self.env, **(env or {}), "SLURM_CONF": str(self.conf)},
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=60,
        )
        if r.returncode != 0:
            raise SlurmError(f"sbatch -> {r.returncode}: {r.stderr}\n{self.logs()}")
        return r.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, Reason, ExitCode...); {} once it is gone."""
        r = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        if r.returncode != 0:
            return {}
        fields = {}
        for token in r.stdout.split():
            key, sep, value = token.partition("=")
            if sep:
                fields[key] = value
        return fields

    def wait_job(self, job_id: str, ready, what: str, timeout_s: float = 300.0) -> dict[str, str]:
        """Polls the job until ``ready(fields)``; a failure guard, not a timing."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if ready(fields):
                return fields
            if time.monotonic() > deadline:
                raise SlurmError(f"timed out waiting for job {job_id}: {what}; last {fields}\n{self.logs()}")
            time.sleep(0.5)

    # ------------------------------------------------------------------ stop

    def logs(self, tail: int = 40) -> str:
        out = []
        for f in sorted((self.dir / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def stop(self) -> None:
        # Jobs first (their steps are slurmstepd, outside slurmd's session), then the daemons, newest first.
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--partition", self.partition], check=False, timeout=20)
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._kill_steps()

    def _kill_steps(self) -> None:
        """slurmstepd daemonises out of slurmd's session: end what still holds a file of this Slurm open
        (a step logs to slurmd's log)."""
        mine = str(self.dir)
        for pid_dir in Path("/proc").iterdir():
            if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
                continue
            try:
                held = any(os.readlink(fd).startswith(mine) for fd in (pid_dir / "fd").iterdir())
            except OSError:
                continue
            if held:
                try:
                    os.kill(int(pid_dir.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def demo_script(
    tmp_path: Path, run_dir: Path, train_args: list[str], script: Path | None = None, **opts
) -> Path:
    """The batch script ``rankwatch slurm template`` prints for the 2-rank CPU demo, written to a file.

    The demo's training (train.py) with its MNIST sample in the run directory; ``opts`` are the
    template's options (``signal_s=...``, ``max_restarts=...``).
    """
    import sys

    from tests.helpers.jobs import BATCH, SAMPLES
    from trainer_bridge.demo.__main__ import TRAIN_SCRIPT
    from trainer_bridge.demo.mnist import write_mnist

    run_dir.mkdir(parents=True, exist_ok=True)
    data = write_mnist(run_dir / "mnist", samples=SAMPLES)
    train = [str(script or TRAIN_SCRIPT), "--run-dir", str(run_dir), "--data-dir", str(data), "--step-log"]
    train += ["--batch-size", str(BATCH)]
    args = ["--job-name", "rw-test", "--workers-per-node", "2", "--cpus-per-task", str(os.cpu_count() or 1)]
    args += ["--master-port", str(free_port()), "--run-dir", str(run_dir)]
    for key, value in opts.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "slurm", "template", *args, "--", *train, *train_args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    path = tmp_path / "job.sbatch"
    path.write_text(out)
    return path
