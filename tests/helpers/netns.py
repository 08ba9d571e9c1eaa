"""Two "nodes" on one machine: Linux network namespaces joined by a veth pair.

A real multi-node ``msrun`` job needs each node to own its address: two
launchers in one network namespace both think they are the master (both
see ``127.0.0.1`` as local) and both start a scheduler, and the loser's
``msrun`` exits 1. Here node 0 and node 1 each get a namespace, an address
on a private /24 and a host name of their own (``unshare --uts``), so node 0
alone runs the scheduler and node 1's workers reach it across the veth,
as on two machines. They share the file system, as cluster nodes share the
run directory (tests that want no shared directory give each node its own path).

``TwoNodes(uplink=True)`` also joins node 0 to the root namespace by a second
veth pair on a /30 of its own (``root_addr`` here, ``uplink_addr`` in node 0):
the test process can then reach a server in node 0 (Redis, on the address
node 1 reaches too) without routing between the namespaces.

``launch`` starts the demo job on both nodes (``WORLD`` ranks); ``steps_logged``
and ``launcher_logs`` read what it printed.

``TwoNodes`` creates everything on entry and removes it on exit (also after
a failure); ``skip_reason()`` says why a machine cannot do it (not root, no
``ip``), so the test is skipped with that reason there. CI runs as root.
"""

from __future__ import annotations

import fcntl
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.helpers.jobs import BATCH, SAMPLES
from trainer_bridge.demo.__main__ import job_env
from trainer_bridge.demo.mnist import write_mnist

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "trainer_bridge" / "demo" / "train.py"

# The two-node jobs' ranks (``local_workers`` 2 on each node), and how long a launch may take on a busy host.
WORLD = 4
LAUNCH_TIMEOUT_S = 240


def skip_reason() -> str | None:
    """Why network namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2, util-linux)"
    probe = f"rwprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


UPLINK_LOCK = "/tmp/rankwatch-netns-uplink.lock"


def _free_uplink() -> tuple[str, str]:
    """(root side, node side) of a 10.78.X.0/30 that no device of the root namespace holds."""
    held = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for x in random.sample(range(10, 250), 240):
        if f"10.78.{x}." not in held:
            return f"10.78.{x}.2", f"10.78.{x}.1"
    raise RuntimeError("no free 10.78.X.0/30 for a test's uplink")


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@dataclass
class Node:
    index: int
    netns: str
    addr: str
    hostname: str

    def prefix(self) -> list[str]:
        """Run a command inside this node: its network namespace and its own host name."""
        return ["ip", "netns", "exec", self.netns, *self.hostname_prefix()]

    def hostname_prefix(self) -> list[str]:
        """Run a command with this node's host name only (in the caller's network)."""
        return ["unshare", "--uts", "sh", "-c", f'hostname {self.hostname} && exec "$@"', "node"]


class TwoNodes:
    """Two namespaced nodes, ``nodes[0]`` (the master) and ``nodes[1]``, joined by a veth pair."""

    def __init__(self, uplink: bool = False):
        tag = uuid.uuid4().hex[:6]
        subnet = 10 + int(tag[:2], 16) % 200  # a private /24 per test run
        self.nodes = [
            Node(i, f"rw{tag}n{i}", f"10.77.{subnet}.{i + 1}", f"rwnode{i}-{tag}") for i in range(2)
        ]
        self._veth = (f"rw{tag}a", f"rw{tag}b")
        self._uplink = (f"rw{tag}r", f"rw{tag}u") if uplink else None
        self.root_addr: str | None = None  # the uplink's /30, chosen free on entry (``_free_uplink``)
        self.uplink_addr: str | None = None
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> TwoNodes:
        try:
            for node in self.nodes:
                _run("ip", "netns", "add", node.netns)
                _run("ip", "-n", node.netns, "link", "set", "lo", "up")
            a, b = self._veth
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            for node, dev in zip(self.nodes, self._veth, strict=True):
                _run("ip", "link", "set", dev, "netns", node.netns)
                _run("ip", "-n", node.netns, "addr", "add", f"{node.addr}/24", "dev", dev)
                _run("ip", "-n", node.netns, "link", "set", dev, "up")
            if self._uplink:
                root_dev, node_dev = self._uplink
                netns = self.nodes[0].netns
                _run("ip", "link", "add", root_dev, "type", "veth", "peer", "name", node_dev)
                _run("ip", "link", "set", node_dev, "netns", netns)
                with open(UPLINK_LOCK, "a") as lock:
                    # Several workers' uplinks share the root namespace: two on one /30 would route one
                    # test's connections to the other's node (a refused connection). Chosen and added
                    # under a lock, among the /30s no device here holds.
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    self.root_addr, self.uplink_addr = _free_uplink()
                    _run("ip", "addr", "add", f"{self.root_addr}/30", "dev", root_dev)
                _run("ip", "link", "set", root_dev, "up")
                _run("ip", "-n", netns, "addr", "add", f"{self.uplink_addr}/30", "dev", node_dev)
                _run("ip", "-n", netns, "link", "set", node_dev, "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for proc in self._procs:
            kill_tree(proc)
        for node in self.nodes:
            # Deleting a namespace also deletes the veth end inside it, and its peer.
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
        if self._uplink:  # gone with node 0's namespace, unless the setup failed before moving it there
            subprocess.run(["ip", "link", "del", self._uplink[0]], capture_output=True)

    def msrun_argv(
        self,
        node: int,
        run_dir: Path,
        train_args: list[str],
        *,
        local_workers: int = 2,
        master_port: int = 8118,
    ) -> list[str]:
        """Node ``node``'s msrun command line for the demo's worker (the master: node 0's address)."""
        master = self.nodes[0]
        return [
            sys.executable, "-m", "mindspore.parallel.cluster.run",
            f"--worker_num={local_workers * len(self.nodes)}", f"--local_worker_num={local_workers}",
            f"--node_rank={node}", f"--master_addr={master.addr}", f"--master_port={master_port}",
            "--join=True", f"--log_dir={run_dir / 'msrun_logs'}",
            str(TRAIN_SCRIPT), *train_args,
        ]  # fmt: skip

    def msrun(
        self,
        node: int,
        run_dir: Path,
        train_args: list[str],
        *,
        local_workers: int = 2,
        master_port: int = 8118,
        log_path: Path,
    ) -> subprocess.Popen:
        """Start node ``node``'s msrun launcher (its own process group) with the demo's worker."""
        argv = self.msrun_argv(
            node, run_dir, train_args, local_workers=local_workers, master_port=master_port
        )
        return self._start([*self.nodes[node].prefix(), *argv], log_path)

    def supervised(
        self,
        node: int,
        run_dir: Path,
        train_args: list[str],
        launch_args: list[str],
        *,
        local_workers: int,
        master_port: int,
        log_path: Path,
        env: dict | None = None,
    ) -> subprocess.Popen:
        """Node ``node``'s ``rankwatch launch`` around its msrun (one supervisor per node); ``env`` is
        added to the job's environment."""
        argv = self.msrun_argv(
            node, run_dir, train_args, local_workers=local_workers, master_port=master_port
        )
        launch = [sys.executable, "-m", "app.cli", "launch", "--run-dir", str(run_dir), *launch_args, "--"]
        return self._start([*self.nodes[node].prefix(), *launch, *argv], log_path, env)

    def _start(self, cmd: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
        out = open(log_path, "ab")
        proc = subprocess.Popen(
            cmd,
            env={**job_env(), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        out.close()
        self._procs.append(proc)
        return proc


def kill_tree(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a launcher's process group and every descendant (msrun gives each worker its own group)."""
    if proc.poll() is not None:
        return
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    for child in tree:
        try:
            child.send_signal(sig)
        except psutil.Error:
            pass
    if sig == signal.SIGKILL:
        proc.wait()


def steps_logged(run_dir, rank: int) -> list[int]:
    """Global steps rank ``rank`` printed (``--step-log``); msrun rewrites the log at each launch."""
    text = (run_dir / "msrun_logs" / f"worker_{rank}.log").read_text(errors="replace")
    return [int(m) for m in re.findall(r"^step (\d+) epoch", text, re.M)]


def launch(nodes: TwoNodes, run_dirs: list, tmp_path, tag: str) -> list[subprocess.Popen]:
    """Both launchers; node ``n`` trains in ``run_dirs[n]`` (the same path twice for a shared directory)."""
    procs = []
    for n, run_dir in enumerate(run_dirs):
        data = write_mnist(run_dir / "mnist", samples=SAMPLES)
        args = ["--run-dir", str(run_dir), "--data-dir", str(data), "--epochs", "50"]
        args += ["--batch-size", str(BATCH), "--step-delay", "0.05", "--step-log"]
        procs.append(nodes.msrun(n, run_dir, args, log_path=tmp_path / f"{tag}-node{n}.log"))
    return procs


def launcher_logs(tmp_path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("*.log"))
