"""The msrun command line ``rankwatch launch`` runs, rewritten for a supervisor that owns the job.

* ``--join`` is always ``False``. With ``--join True`` msrun polls its
  workers once a second and SIGKILLs every survivor's process group at the
  first non-zero exit, with no grace (seeds/README.md, "Checked facts about
  faults"): the decision to end an attempt, and when, would be msrun's. With
  ``False`` msrun starts the scheduler and the workers and returns; the
  supervisor, as their child subreaper, inherits them and joins them itself.
  Whatever the user passed, the job behaves the same.
* ``--master_port`` is a fresh free port for every attempt on one node: the
  previous attempt's scheduler may have left the port in TIME_WAIT, or
  another job may have taken it. With several nodes (``--local_worker_num``
  below ``--worker_num``) every node must name the same port: the first
  attempt keeps the user's, and each relaunch takes the one node 0 chose
  (``nodes.py``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

MSRUN_MODULE = "mindspore.parallel.cluster.run"


class NotMsrun(ValueError):
    """The command is not an msrun launch."""


@dataclass
class Msrun:
    """An msrun command, split: the launcher, its options (in order), the script and its arguments."""

    head: list[str]
    original: list[str] = field(
        default_factory=list
    )  # as the user wrote it (run as is where TTP owns recovery)
    options: list[tuple[str, str]] = field(default_factory=list)
    script: list[str] = field(default_factory=list)

    def get(self, name: str, default: str | None = None) -> str | None:
        found = [v for k, v in self.options if k == name]
        return found[-1] if found else default

    def int_option(self, name: str, default: int) -> int:
        try:
            return int(self.get(name, str(default)))
        except ValueError:
            return default

    @property
    def worker_num(self) -> int:
        return self.int_option("--worker_num", 8)  # msrun's defaults

    @property
    def local_worker_num(self) -> int:
        return self.int_option("--local_worker_num", 8)

    @property
    def single_node(self) -> bool:
        return self.local_worker_num >= self.worker_num

    @property
    def log_dir(self) -> str:
        return self.get("--log_dir", "") or ""

    def argv(self, master_port: int | None) -> list[str]:
        """The command for one attempt: ``--join=False``, and ``master_port`` when given."""
        out = list(self.head)
        for name, value in self.options:
            if name == "--join" or (name == "--master_port" and master_port is not None):
                continue
            out.append(f"{name}={value}")
        if master_port is not None:
            out.append(f"--master_port={master_port}")
        out.append("--join=False")
        return out + self.script


def parse(argv: list[str]) -> Msrun:
    """Split ``msrun ...`` or ``python -m mindspore.parallel.cluster.run ...``; NotMsrun otherwise.

    Every msrun option takes a value (``--opt=v`` or ``--opt v``); the first
    word that is not an option is the script, and what follows is its own.
    """
    if not argv:
        raise NotMsrun("no command after --")
    if os.path.basename(argv[0]) == "msrun":
        start = 1
    elif (
        MSRUN_MODULE in argv[:4]
        and argv.index(MSRUN_MODULE) > 0
        and argv[argv.index(MSRUN_MODULE) - 1] == "-m"
    ):
        start = argv.index(MSRUN_MODULE) + 1
    else:
        raise NotMsrun(
            f"{argv[0]!r} is not msrun: rankwatch launch supervises `msrun ...` or "
            f"`python -m {MSRUN_MODULE} ...`"
        )
    cmd = Msrun(head=argv[:start], original=list(argv))
    i = start
    while i < len(argv):
        word = argv[i]
        if not word.startswith("--"):
            cmd.script = argv[i:]
            break
        if "=" in word:
            name, value = word.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise NotMsrun(f"msrun option {word} has no value")
            name, value = word, argv[i + 1]
            i += 2
        cmd.options.append((name, value))
    if not cmd.script:
        raise NotMsrun("the msrun command names no training script")
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
