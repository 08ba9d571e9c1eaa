"""The relaunch command (msrun, its options, the environment) and the loop code of a resume answer.

``job.json`` (``trainer_bridge.rundir.launch``) records msrun's command line and
the ``MS_*``-style variables the job ran with, and whether the bridge was
attached as a callback or through ``bridge.loop``. Every value comes from a
file any rank can write: names are checked, values quoted, lists bounded.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from collections.abc import Mapping

from trainer_bridge.rundir.launch import ENV_NAME, MAX_ARGS, MAX_ENV, is_msrun

# Options the relaunch command sets itself (from the ranks and hosts it sees).
SET_HERE = frozenset({"--worker_num", "--local_worker_num", "--master_addr", "--node_rank", "--join"})
# Options left out: the old launch's port may be taken now (msrun's default, 8118, is used; the
# command's notes say how to choose one).
STALE = frozenset({"--master_port"})
# msrun as the old launch ran it, when that was an absolute path to an msrun script (a venv's
# bin/): the copied command then works in a fresh shell, without activating the venv.
_MSRUN_PATH = re.compile(r"^/[\w./+@-]{1,4000}/msrun$")


def _strings(value, limit: int) -> list[str] | None:
    if isinstance(value, list) and len(value) <= limit and all(isinstance(a, str) for a in value):
        return value
    return None


def msrun_options(job: Mapping, script: str) -> list[str]:
    """msrun's options from ``launcher_argv`` (``--log_dir``, ``--master_port``, ...), minus ``SET_HERE``."""
    launcher = _strings(job.get("launcher_argv"), MAX_ARGS)
    if not launcher or not is_msrun(launcher):
        return []
    start = next(
        i for i, a in enumerate(launcher[:4]) if a.endswith("msrun") or a == "mindspore.parallel.cluster.run"
    )
    end = launcher.index(script, start + 1) if script in launcher[start + 1 :] else len(launcher)
    out, args, i = [], launcher[start + 1 : end], 0
    while i < len(args):
        arg = args[i]
        takes_value = (
            arg.startswith("--") and "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--")
        )
        pair = args[i : i + 2] if takes_value else [arg]
        if arg.split("=", 1)[0] not in SET_HERE | STALE:
            out += pair
        i += len(pair)
    return out


def msrun_program(job: Mapping) -> tuple[str, str | None]:
    """How to start msrun (a command) and, when it is not from the old launch, a note saying so.

    The old launch's absolute ``.../bin/msrun``, or its interpreter with ``-m
    mindspore.parallel.cluster.run``: a bare ``msrun`` failed with "command not
    found" in a shell without the venv activated.
    """
    launcher = _strings(job.get("launcher_argv"), MAX_ARGS)
    if launcher and is_msrun(launcher):
        head = launcher[:4]
        for i, arg in enumerate(head):
            if _MSRUN_PATH.match(arg) and ".." not in arg.split("/"):
                return shlex.quote(arg), None
            if arg == "mindspore.parallel.cluster.run" and i >= 2 and head[i - 1] == "-m":
                python = head[0]
                if python.startswith("/") and ".." not in python.split("/") and len(python) <= 4000:
                    return f"{shlex.quote(python)} -m mindspore.parallel.cluster.run", None
    return "msrun", "msrun must be on PATH: activate the environment the job ran in first"


def job_env(job: Mapping) -> dict[str, str]:
    """The recorded environment, with names a shell reads as names only."""
    env = job.get("env")
    if not isinstance(env, dict) or len(env) > MAX_ENV:
        return {}
    return {k: v for k, v in env.items() if isinstance(k, str) and ENV_NAME.match(k) and isinstance(v, str)}


def env_prefix(env: Mapping[str, str]) -> str:
    return "".join(f"{name}={shlex.quote(value)} " for name, value in env.items())


def loop_code(path_expr: str, head: list[str], where: str, position: Mapping, global_step) -> list[str]:
    """A functional loop's resume (what ``bridge.loop`` does): load both cells, skip the trained rows."""
    lines = [
        *head,
        "# network and optimizer: the cells given to bridge.loop (it saved both)",
        f"params = ms.load_checkpoint({path_expr})",
        "ms.load_param_into_net(network, params)",
        "ms.load_param_into_net(optimizer, params)",
        "",
    ]
    initial_epoch, skip = position["initial_epoch"], position["skip_steps"]
    if initial_epoch is None and global_step is not None:
        lines.append(f"initial_epoch, skip = divmod({global_step}, dataset.get_dataset_size())")
    elif initial_epoch is not None:
        lines.append(f"initial_epoch, skip = {initial_epoch}, {skip}  # saved at {where}")
    else:
        lines.append("initial_epoch, skip = 0, 0  # the files do not say where they were saved")
    return lines + [
        "if initial_epoch < epochs:",
        "    if skip:",
        "        dataset.set_init_step(skip)  # the first epoch of the next iterator only",
        "    iterator = dataset.create_tuple_iterator(num_epochs=epochs - initial_epoch)",
        "    for epoch in range(initial_epoch + 1, epochs + 1):",
        "        for x, y in iterator:",
        "            loss = train_step(x, y)",
    ]


# RFC 1123 labels, plus the underscore some clusters' host names carry.
_HOST_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def is_host_name(host: str) -> bool:
    """Whether ``host`` is an IP address or a DNS host name, and nothing a shell would read as more."""
    if not isinstance(host, str) or not 0 < len(host) <= 253:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return all(_HOST_LABEL.match(label) for label in host.removesuffix(".").split("."))


def relaunch_command(
    job: Mapping, world: int, heartbeats: Mapping[int, dict | None], run_dir: str | None = None
) -> tuple[str | None, list[str]]:
    """The ``msrun`` command that starts the job again, from ``job.json``'s ``argv``.

    msrun runs ``python <script> <args>`` on every worker, so the script's
    own argv follows msrun's options. The node count comes from the hosts
    the heartbeats name; on several nodes the same command runs on each,
    with its ``--node_rank`` from ``$NODE_RANK``. Returns (command or None, notes).

    The operator pastes this into a shell, and every value in it comes from
    files any rank can write: each is quoted with ``shlex.quote``, and a host
    that is not a host name (``n1;touch /tmp/x;#``) refuses the command.
    """
    argv = job.get("argv")
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        return None, [
            "rankwatch/job.json has no argv (the bridge writes it at start), so the "
            "job's command is unknown: relaunch it as you launched it"
        ]
    job_world = job.get("world_size")
    world = job_world if isinstance(job_world, int) and not isinstance(job_world, bool) else world
    by_rank = sorted(
        (r, hb.get("host")) for r, hb in heartbeats.items() if isinstance(hb, dict) and hb.get("host")
    )
    bad = [(r, h) for r, h in by_rank if not is_host_name(h)]
    if bad:
        rank, host = bad[0]
        return None, [
            f"rank {rank} reports the host {host[:100]!r}, which is not a host name, so no "
            "command is offered: relaunch the job as you launched it"
        ]
    hosts = list(dict.fromkeys(h for _, h in by_rank))
    notes = []
    q = shlex.quote
    if len(hosts) > 1:
        if world % len(hosts) == 0:
            local = q(str(world // len(hosts)))
        else:
            local = '"${LOCAL_WORKERS:?set LOCAL_WORKERS to the ranks on this node}"'
            notes.append("set LOCAL_WORKERS to the number of ranks on each node before running it")
        opts = (
            f"--worker_num={q(str(world))} --local_worker_num={local} --master_addr={q(hosts[0])} "
            '--node_rank="${NODE_RANK:?set NODE_RANK to the index of this node}"'
        )
        notes.append(
            f"run it on each of the {len(hosts)} nodes ({', '.join(hosts)}) with NODE_RANK set to "
            f"the node's index, 0 on {hosts[0]}"
        )
    else:
        opts = f"--worker_num={q(str(world))} --local_worker_num={q(str(world))}"
    if not os.path.isabs(argv[0]):
        notes.append(f"{argv[0]} is a relative path: run from the directory the job was launched in")
    more = msrun_options(job, argv[0])
    launcher = _strings(job.get("launcher_argv"), MAX_ARGS) or []
    if any(a.split("=", 1)[0] in STALE for a in launcher):
        notes.append(
            "the old launch's --master_port is left out (it may be taken now): msrun uses 8118; "
            "add --master_port=N for another free port"
        )
    program, program_note = msrun_program(job)
    if program_note:
        notes.append(program_note)
    env = job_env(job)
    if env:
        notes.append(
            "the job ran with "
            + ", ".join(f"{k}={v}" for k, v in env.items())
            + ": the command sets them again"
        )
    # The command starts the job alone: say that the dashboard is not part of it (issue 33, section 5).
    notes.append(
        "it starts the job only: a dashboard already following this run directory (this one) shows "
        "it as the next attempt; to have a failure relaunched by itself, put "
        f"`rankwatch launch --run-dir {q(run_dir) if run_dir else 'RUN'} --` before it"
    )
    more_text = f"{shlex.join(more)} " if more else ""
    return f"{env_prefix(env)}{program} {opts} {more_text}--join=True {shlex.join(argv)}", notes
