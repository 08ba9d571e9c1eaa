"""How to resume from a checkpoint set: the relaunch command, where training continues, the load code.

The checkpoint browser's "Resume" answer (``GET /api/checkpoints/resume``)
and ``rankwatch checkpoints --resume`` both come from ``advice``; the set
the bridge itself resumes from is ``bridge_default``.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import shlex
from collections.abc import Mapping
from importlib import resources

from app.checkpoints import relaunch
from app.checkpoints.relaunch import relaunch_command
from trainer_bridge.rundir import ckpthealth, ckptindex, runfiles
from trainer_bridge.rundir.ckptindex import CheckpointFile, CheckpointSet, Index
from trainer_bridge.rundir.ckptpaths import ORIGIN_BRIDGE, ORIGIN_NATIVE, ORIGIN_TTP
from trainer_bridge.rundir.listing import first_of

TTP_NOTE = (
    "TTP saves one copy per replica group, not one per rank, so a TTP set can list "
    "missing ranks and still be resumable: a missing rank loads the copy of a rank "
    "in its replica group."
)
BRIDGE_DEFAULT_NOTE = (
    "The bridge resumes from this set when the job is relaunched unchanged "
    "(the newest complete graceful-stop set)."
)


TTP_NOTE = (
    "TTP saves one copy per replica group, not one per rank, so a TTP set can list "
    "missing ranks and still be resumable: a missing rank loads the copy of a rank "
    "in its replica group."
)


def bridge_default(index: Index, unhealthy: Mapping[str, str] | None = None) -> CheckpointSet | None:
    """The set the bridge loads on an unchanged relaunch (``ckptindex.resume_set``, the bridge's own choice).

    ``unhealthy``: ``ckpthealth.unhealthy`` of this index, when the caller has it already.
    """
    if unhealthy is None:
        unhealthy = ckpthealth.unhealthy(index.run_dir, index)
    return ckptindex.resume_set(index, unhealthy=unhealthy)


def ranks_text(ranks, word: bool = False) -> str:
    """``1, 2, 3``; with ``word``, ``rank 1`` or ``ranks 1, 2, 3`` (a real plural, not "rank(s)")."""
    ranks = list(ranks)
    shown = first_of(ranks, 12)
    return (f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}") if word else shown


def _describe(cset: CheckpointSet | None) -> str:
    if cset is None:
        return "no set (it resumes only from its own saves, and has none: it would start from scratch)"
    where = f"global step {cset.global_step}" if cset.global_step is not None else cset.id
    return f"the {cset.origin} set at {where}"


def _position(cset: CheckpointSet) -> dict:
    """Where training restarts: ``initial_epoch`` and the batches to skip in that epoch.

    Steps per epoch come from the files (``batch_num``, which ModelCheckpoint,
    OnRequestExit and the bridge store), else from the epoch, step and global
    step together; when neither tells, the code asks the dataset.
    """
    per_epoch = next(
        (
            f.meta.extras.get("batch_num")
            for f in cset.files
            if f.ok and isinstance(f.meta.extras.get("batch_num"), int) and f.meta.extras["batch_num"] > 0
        ),
        None,
    )
    g, epoch, step = cset.global_step, cset.epoch, cset.step
    if per_epoch is None and None not in (g, epoch, step) and epoch > 1 and (g - step) % (epoch - 1) == 0:
        per_epoch = (g - step) // (epoch - 1) or None
    initial_epoch = skip = None
    if g is not None and per_epoch:
        initial_epoch, skip = divmod(g, per_epoch)
    elif g is None and epoch is not None and step is not None:
        initial_epoch, skip = epoch - 1, step
    return {"steps_per_epoch": per_epoch, "initial_epoch": initial_epoch, "skip_steps": skip}


def _literal(text: str) -> str:
    """``text`` as the inside of a double-quoted Python f-string."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("{", "{{").replace("}", "}}")


def _rank_template(f: CheckpointFile, layout: str) -> str:
    """``f``'s path as f-string text with its rank number replaced by ``{rank}``."""
    out = []
    for part, tpl in zip(f.path.split("/"), layout.split("/"), strict=False):
        at = tpl.find("{rank}")
        digits = re.match(r"\d+", part[at:]) if at >= 0 and part[:at] == tpl[:at] else None
        out.append(
            _literal(part[:at]) + "{rank}" + _literal(part[at + digits.end() :]) if digits else _literal(part)
        )
    return "/".join(out)


def load_code(run_dir: str, cset: CheckpointSet, position: Mapping, *, loop: bool = False) -> str:
    """Python that loads ``cset`` on every rank and starts training where it stopped.

    ``loop``: the job trained in a functional loop (``bridge.loop``), not ``Model.train``.
    """
    files = {r: cset.file_for(r) for r in range(cset.world_size)}
    files = {r: f for r, f in files.items() if f is not None}
    templates = {_rank_template(f, cset.layout) for f in files.values()}
    if cset.origin == ORIGIN_NATIVE and len(templates) == 1 and not cset.ranks_missing:
        return _native_code(run_dir, templates.pop())
    fmt = next((f.meta.format for f in files.values()), "ckpt")
    extra = ', format="safetensors"' if fmt == "safetensors" else ""
    lines = [
        "import mindspore as ms",
        "from mindspore.communication import get_rank",
        "",
        f"run = {json.dumps(os.path.realpath(run_dir))}  # the run directory",
        "rank = get_rank()",
    ]
    if not files:
        return "# no rank has a readable file in this set: there is nothing to load\n"
    if len(templates) == 1:
        path_expr = f'f"{{run}}/{templates.pop()}"'
    else:
        # The names differ beyond the rank (rare): list each rank's file.
        lines.append("paths = {" + ", ".join(f"{r}: {json.dumps(f.path)}" for r, f in files.items()) + "}")
        path_expr = 'f"{run}/{paths[rank]}"'
    if cset.ranks_missing:
        lines.append(
            f"# no readable file for {ranks_text(cset.ranks_missing, True)} in this set"
            + (" (TTP: load a replica's copy)" if cset.origin == ORIGIN_TTP else "")
        )
    where = (
        f"global step {cset.global_step}"
        if cset.global_step is not None
        else f"epoch {cset.epoch}, step {cset.step}"
    )
    if loop:
        return "\n".join(relaunch.loop_code(path_expr, lines, where, position, cset.global_step)) + "\n"
    lines += [
        "# train_net: the cell being trained, optimizer included (the bridge loads Model's",
        "# train network), so the optimizer state resumes too",
        f"ms.load_checkpoint({path_expr}, net=train_net{extra})",
        "",
    ]
    per_epoch, initial_epoch, skip = (
        position["steps_per_epoch"],
        position["initial_epoch"],
        position["skip_steps"],
    )
    if initial_epoch is not None:
        basis = f", {per_epoch} steps per epoch" if per_epoch else ""
        lines.append(
            f"# saved at {where}{basis}: {initial_epoch} epoch(s) done, {skip} batch(es) into the next"
        )
        if skip:
            lines.append(f"dataset.set_init_step({skip})  # skips {skip} batches, in the first epoch only")
        lines.append(f"model.train(epochs, dataset, callbacks=callbacks, initial_epoch={initial_epoch})")
    elif cset.global_step is not None:
        lines += [
            f"# saved at {where}; the steps per epoch are not in the files, so ask the dataset",
            f"initial_epoch, skip = divmod({cset.global_step}, dataset.get_dataset_size())",
            "if skip:",
            "    dataset.set_init_step(skip)  # skips that many batches, in the first epoch only",
            "model.train(epochs, dataset, callbacks=callbacks, initial_epoch=initial_epoch)",
        ]
    else:
        lines += [
            "# the files do not say at which step they were saved: train from the start of",
            "# the data, with the weights loaded",
            "model.train(epochs, dataset, callbacks=callbacks)",
        ]
    return "\n".join(lines) + "\n"


@functools.cache
def _function_source(module_file: str, name: str) -> str:
    """The source of top-level function ``name`` in ``trainer_bridge/<module_file>``, read as text."""
    text = (resources.files("trainer_bridge") / module_file).read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.get_source_segment(text, node) + "\n"


def _native_code(run_dir: str, template: str) -> str:
    """An OnRequestExit set: OnRequestExit reloads it itself once its ``global_step`` fits.

    The function offered is ``trainer_bridge.native``'s own source, the one
    the demo runs, so the code shown is the code tested; it is read as a
    file, never imported: the dashboard runs none of the trainer's code.
    """
    source = _function_source("native.py", "on_request_exit_resume")
    return (
        "\n".join(
            [
                "# OnRequestExit saved this set, and its on_train_begin loads the file again by itself;",
                "# that load fails on the global_step it appended (shape () against the optimizer's (1,))",
                "# until the function below rewrites it. Run this before model.train, on every rank.",
                "import mindspore as ms",
                "",
                "",
                source.rstrip(),
                "",
                "",
                f"run = {json.dumps(os.path.realpath(run_dir))}  # the run directory",
                'rank = ms.get_context("device_id")  # OnRequestExit names rank_<N> after the device id',
                f'initial_epoch, skip = on_request_exit_resume(f"{{run}}/{template}", epochs)',
                "if initial_epoch < epochs:",
                "    if skip:",
                "        dataset.set_init_step(skip)  # the stopped epoch's finished batches, first epoch only",
                "    # callbacks: OnRequestExit with the same file_name and directory as before: it loads the file",
                "    model.train(epochs, dataset, callbacks=callbacks, initial_epoch=initial_epoch)",
            ]
        )
        + "\n"
    )


def advice(run_dir: str, index: Index, cset: CheckpointSet, heartbeats: Mapping[int, dict | None]) -> dict:
    """How to resume from ``cset`` of ``index``: the relaunch command and the code that loads it."""
    default = bridge_default(index)
    job = runfiles.read_json_or_none(runfiles.job_path(run_dir))
    job = job if isinstance(job, dict) else {}
    command, command_notes = relaunch_command(job, cset.world_size, heartbeats, run_dir)
    loop = job.get("front_end") == "loop" and cset.origin == ORIGIN_BRIDGE
    position = _position(cset)
    is_default = default is not None and default.id == cset.id
    if cset.origin == ORIGIN_NATIVE:
        how = (
            "OnRequestExit saved this set and loads it again by itself when the script starts: "
            "run the code below before model.train (it makes the file loadable and aligns the "
            "data), then relaunch the job as it was launched."
        )
    elif is_default:
        how = (
            "Relaunch the job unchanged: the bridge loads this set on every rank at train "
            "begin and continues with the next step. The code below is what it does, for a "
            "script without the bridge."
        )
    elif (
        default is not None
        and cset.complete
        and cset.global_step is not None
        and cset.global_step == default.global_step
    ):
        # The periodic set saved at the stop step beside the bridge's own: the same point in
        # training, and pinning its step would load the bridge's set anyway (the headline says so).
        how = (
            f"An unchanged relaunch resumes from global step {cset.global_step} already: the bridge "
            f"loads {_describe(default)}, saved at the same step as this one (marked ★), so there is "
            "nothing to pin. For a script without the bridge, the code below loads this set."
        )
    elif cset.complete and cset.global_step is not None:
        how = (
            f"The bridge would resume from {_describe(default)}; pin this set instead by "
            f"relaunching with {runfiles.RESUME_STEP_ENV}={cset.global_step} in the environment (or "
            f"GracefulExitBridge(run_dir, resume_step={cset.global_step})). For a script "
            "without the bridge, the code below loads the set."
        )
        if command:
            command = f"{runfiles.RESUME_STEP_ENV}={shlex.quote(str(cset.global_step))} {command}"
    else:
        how = (
            "Load this set with the code below before model.train, then relaunch."
            + (
                f" With the bridge attached, construct it with resume=False, or it loads "
                f"{_describe(default)} over this set."
                if default is not None
                else ""
            )
            + (
                " The bridge cannot pin it: it is incomplete or its global step is unknown."
                if cset.origin == ORIGIN_BRIDGE
                else ""
            )
        )
    warnings = []
    if not cset.complete:
        warnings.append(
            f"this set is incomplete: {ranks_text(cset.ranks_missing, True)} "
            f"{'has' if len(cset.ranks_missing) == 1 else 'have'} no "
            "readable file"
            + (f". {TTP_NOTE}" if cset.origin == ORIGIN_TTP else ", so those ranks cannot load it")
        )
    return {
        "set": cset.id,
        "origin": cset.origin,
        "complete": cset.complete,
        "epoch": cset.epoch,
        "step": cset.step,
        "global_step": cset.global_step,
        "world_size": cset.world_size,
        "ranks_missing": list(cset.ranks_missing),
        "bridge_default": is_default,
        "bridge_resume": default.id if default else None,
        "how": how,
        "command": command,
        "command_notes": command_notes,
        **position,
        "code": load_code(run_dir, cset, position, loop=loop),
        "warnings": warnings,
    }
