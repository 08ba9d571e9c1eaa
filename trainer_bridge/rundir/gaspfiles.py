"""The dying gasp's files: the supervisor's request, each rank's answer, the replica's set directory.

``rankwatch launch`` (``app/supervise``) writes the request and reads the
answers; the bridge (``trainer_bridge/gasp.py``) does the opposite. See
that module for the protocol.
"""

from __future__ import annotations

from pathlib import Path

from trainer_bridge.rundir import runfiles

REQUEST = "gasp.json"
TTP_DIR = "ttp_checkpoints"
MAX_REQUEST_BYTES = 64 * 1024


def request_path(run_dir) -> Path:
    return runfiles.state_dir(run_dir) / REQUEST


def answer_path(run_dir, rank: int) -> Path:
    return runfiles.state_dir(run_dir) / f"gasp_rank_{rank}.json"


def set_dir(run_dir, global_step: int, tmp: bool = False) -> Path:
    """MindIO TTP's step directory: ``RUN/ttp_checkpoints/ttp_saved_checkpoints-step_{G}[_tmp]``."""
    return Path(run_dir) / TTP_DIR / f"ttp_saved_checkpoints-step_{global_step}{'_tmp' if tmp else ''}"
