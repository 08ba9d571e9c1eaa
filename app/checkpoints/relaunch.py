"""What a relaunch needs beyond the script's argv: msrun's own options, the environment, loop code.

``job.json`` (``trainer_bridge.launch``) records msrun's command line and
the ``MS_*``-style variables the job ran with, and whether the bridge was
attached as a callback or through ``bridge.loop``. Every value comes from a
file any rank can write: names are checked, values quoted, lists bounded.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from trainer_bridge.launch import ENV_NAME, MAX_ARGS, MAX_ENV, is_msrun

# Options the relaunch command sets itself (from the ranks and hosts it sees).
SET_HERE = frozenset({"--worker_num", "--local_worker_num", "--master_addr", "--node_rank", "--join"})


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
        if arg.split("=", 1)[0] not in SET_HERE:
            out += pair
        i += len(pair)
    return out


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
