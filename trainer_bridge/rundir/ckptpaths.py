"""What a checkpoint file is, read from where it lies: the walk of a run directory and ``classify``.

``ckptindex`` groups what these find into sets. Layouts recognised, by
where the file lies relative to the run directory:

=====================  =================================================================
origin                 layout
=====================  =================================================================
``graceful stop``      ``checkpoints/rank_{r}/rankwatch-{E}_{S}.ckpt`` (``runfiles.checkpoint_path``)
``TTP``                ``.../tft_saved_checkpoints-step_{G}/rank_{r}/ttp_rank_{r}-{E}_{S}.ckpt``
``native OnRequestExit`` ``.../rank_{id}/{name}_train.ckpt`` (and ``_eval``, ``.mindir``)
``periodic``           anything else with a rank in its path: ``rank_3``, ``rank3``,
                       ``device_3``, or a bare number under a directory whose name
                       mentions ckpt, checkpoint or rank (``ckpt_of_rank/3/``)
=====================  =================================================================

A file with no rank in its path is taken as rank 0 of a single-process job.
The walk skips the ``rankwatch/`` state directory, hidden and ``*.tmp`` files,
TTP's ``…-step_{G}_tmp`` directories (a save in progress or abandoned),
MindSpore's parallel strategy files (``*strategy*.ckpt``, not checkpoints),
symlinks (see ``walk_tree``), and anything deeper than ``MAX_DEPTH`` directories.
Like ``ckptmeta``, this module must not import mindspore.
"""

from __future__ import annotations

import errno
import os
import re

from trainer_bridge.rundir import runfiles
from trainer_bridge.rundir.ckptmeta import FORMATS, TTP_STEP_DIR_RE
from trainer_bridge.rundir.schema import MAX_RANKS

ORIGIN_BRIDGE = "graceful stop"
ORIGIN_TTP = "TTP"
ORIGIN_NATIVE = "native OnRequestExit"
ORIGIN_PERIODIC = "periodic"
ORIGINS = (ORIGIN_BRIDGE, ORIGIN_TTP, ORIGIN_NATIVE, ORIGIN_PERIODIC)

MAX_DEPTH = 8
# The highest rank number believed in a path (the schema's bound on jobs).
MAX_RANK = MAX_RANKS - 1

_RANK_DIR_RE = re.compile(r"(?i)(?:rank|device)[_-]?(\d+)")
_CKPT_PARENT_RE = re.compile(r"(?i)ckpt|checkpoint|rank")
_NAME_RANK_RE = re.compile(r"(?i)(?<![a-z0-9])rank_?(\d+)")
_NAME_STEP_RE = re.compile(r"-\d+_\d+(\.[a-z]+)$")
_TTP_TMP_DIR_RE = re.compile(r"^(?:tft|ttp)_saved_checkpoints-step_\d+_tmp$")
_NATIVE_NAME_RE = re.compile(r"_(?:train|eval)\.(?:ckpt|mindir)$")
_BRIDGE_NAME_RE = re.compile(rf"^{re.escape(runfiles.CHECKPOINT_PREFIX)}-\d+_\d+\.(?:ckpt|safetensors)$")


def walk_tree(root: str, errors: list[str]):
    """Yield ``(relative parts, path, stat)`` for each checkpoint-like file under ``root``.

    Symlinks are never followed: one that stays inside the run directory
    points at files the walk reaches by their own path (following it would
    list them twice), and one that leaves it must not be exposed. Skipping
    them also rules out loops. A folder is listed through a descriptor that
    must be the very directory its parent listed (device and inode): one
    swapped for a symlink in between is not listed (issue 32: retention
    planned on another folder's files).
    """
    stack: list[tuple[str, tuple[str, ...], tuple | None]] = [(root, (), None)]
    while stack:
        dirpath, rel, ident = stack.pop()
        try:
            fd = os.open(dirpath, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                if ident is not None and (st.st_dev, st.st_ino) != ident:
                    raise OSError(errno.ELOOP, "replaced during the listing (not followed)")
                with os.scandir(fd) as it:
                    entries = []
                    for entry in it:
                        try:
                            # Cached in the entry while the descriptor it is relative to is open.
                            entry.stat(follow_symlinks=False)
                        except OSError:
                            continue  # gone since it was listed
                        entries.append(entry)
            finally:
                os.close(fd)
        except OSError as e:
            errors.append(f"cannot list {'/'.join(rel) or '.'}: {(e.strerror or str(e)).lower()}")
            continue
        for entry in entries:
            name = entry.name
            if name.startswith(".") or name.endswith(".tmp") or (not rel and name == runfiles.STATE_DIR):
                continue
            if not _utf8_name(name):
                # The API, the page's URLs and the download header carry paths as
                # text; a name that is not UTF-8 cannot round-trip through them.
                errors.append(f"skipped {'/'.join(rel + (ascii(name),))}: the name is not valid UTF-8")
                continue
            try:
                if entry.is_symlink():
                    continue
                path = os.path.join(dirpath, name)
                if entry.is_dir(follow_symlinks=False):
                    if len(rel) < MAX_DEPTH and not _TTP_TMP_DIR_RE.match(name):
                        # Taken now, while the entry is known not to be a symlink.
                        st = entry.stat(follow_symlinks=False)
                        stack.append((path, rel + (name,), (st.st_dev, st.st_ino)))
                    continue
                ext = os.path.splitext(name)[1].lower()
                if (
                    ext not in FORMATS
                    or (ext == ".ckpt" and "strategy" in name.lower())
                    or not entry.is_file(follow_symlinks=False)
                ):
                    continue
                yield rel + (name,), path, entry.stat(follow_symlinks=False)
            except OSError as e:
                errors.append(f"cannot stat {'/'.join(rel + (name,))}: {(e.strerror or str(e)).lower()}")


def _utf8_name(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # os.fsdecode's surrogate escapes of undecodable bytes
        return False
    return True


def _believable(digits: str) -> bool:
    """A rank number a job can have: ``rank_99999999999`` is a name, and believing it
    would make a set of 10^11 ranks, every one of them missing."""
    return digits.isascii() and len(digits) <= 7 and int(digits) <= MAX_RANK


def classify(rel_parts: tuple[str, ...] | list[str]) -> tuple[str, int, str]:
    """``(origin, rank, layout)`` of a file from its path relative to the run directory.

    ``layout`` is the path with the rank, TTP step directory and
    ``-{epoch}_{step}`` suffix replaced by placeholders: the same string for
    every file of one series on every rank.
    """
    *dirs, name = rel_parts
    dirs_tpl = list(dirs)
    rank = None
    for i in range(len(dirs) - 1, -1, -1):
        m = _RANK_DIR_RE.fullmatch(dirs[i])
        if m and not _believable(m[1]):
            m = None
        if m or (
            dirs[i].isdigit() and _believable(dirs[i]) and i > 0 and _CKPT_PARENT_RE.search(dirs[i - 1])
        ):
            rank = int(m[1]) if m else int(dirs[i])
            dirs_tpl[i] = dirs[i][: m.start(1)] + "{rank}" if m else "{rank}"
            break
    ttp = False
    for i, d in enumerate(dirs):
        m = TTP_STEP_DIR_RE.match(d)
        if m:
            ttp = True
            dirs_tpl[i] = d[: m.start("global_step")] + "{G}"
    name_rank = _NAME_RANK_RE.search(name)
    name_tpl = name
    if name_rank and _believable(name_rank[1]) and (rank is None or int(name_rank[1]) == rank):
        rank = int(name_rank[1])
        name_tpl = name[: name_rank.start(1)] + "{rank}" + name[name_rank.end(1) :]
    name_tpl = _NAME_STEP_RE.sub(r"-{E}_{S}\1", name_tpl)
    layout = "/".join(dirs_tpl + [name_tpl])
    parent_is_rank = bool(dirs) and _RANK_DIR_RE.fullmatch(dirs[-1]) is not None
    if ttp:
        origin = ORIGIN_TTP
    elif (
        len(dirs) == 2
        and dirs[0] == runfiles.CHECKPOINT_DIR
        and re.fullmatch(r"rank_\d+", dirs[1])
        and _BRIDGE_NAME_RE.match(name)
    ):
        origin = ORIGIN_BRIDGE
    elif parent_is_rank and _NATIVE_NAME_RE.search(name):
        origin = ORIGIN_NATIVE
    else:
        origin = ORIGIN_PERIODIC
    return origin, rank if rank is not None else 0, layout
