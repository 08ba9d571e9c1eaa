"""The dashboard as the tests build it: fast thresholds, one operator token, waiting for events."""

from __future__ import annotations

import time
from pathlib import Path

from app import create_app
from app.checkpoints.indexbody import apply_delta
from app.extensions import socketio
from app.push import CHECKPOINTS_DELTA_EVENT, CHECKPOINTS_EVENT, CHECKPOINTS_INDEX_REQUEST

# The operator token of every test dashboard: long and random-looking, so no weak-token warning.
TOKEN = "Kx9-rankwatch-test-token-7Qz2mW4vT8pL"

# Small thresholds so that a test sees a rank turn stalled, then dead, in seconds.
FAST_SETTINGS = {
    "TICK_S": 0.1,
    # Above the bridge's widest heartbeat gap (about 2 s: agreements stretched by load, or the
    # wake-up after steps stop), or a healthy rank on a loaded host reads stalled between beats.
    "STALL_MIN_S": 2.5,
    "STALL_FACTOR": 5.0,
    "DEAD_AFTER_S": 4.0,
    "PROCESS_CHECK_AFTER_S": 1.0,
    "CHART_REFRESH_S": 0.5,
    # Log-mode warnings wait this long for a bridge's first heartbeat (the default is minutes).
    "BRIDGE_GRACE_S": 2.0,
}


def make_app(run_dir: str | Path | None, **settings):
    """A test dashboard on ``run_dir`` with ``TOKEN`` and ``FAST_SETTINGS``; ``settings`` override."""
    base = {"TESTING": True, "TOKEN": TOKEN, **FAST_SETTINGS}
    if run_dir is not None:
        base["RUN_DIR"] = str(run_dir)
    return create_app(base | settings)


def operator(token: str = TOKEN) -> dict:
    """The headers of a request made with ``token`` (the operator's unless told)."""
    return {"Authorization": f"Bearer {token}"}


# The headers of a request made by the operator.
AUTH = operator()


def wait_for_event(
    sio, names: str | tuple[str, ...], predicate=lambda payload: True, timeout: float = 15.0
) -> dict:
    """Poll ``sio.get_received()`` for an event in ``names`` whose payload passes ``predicate``.

    Events the watcher pushes arrive from its thread; this waits for them with
    a deadline instead of a fixed sleep.
    """
    names = (names,) if isinstance(names, str) else names
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        for event in sio.get_received():
            seen.append(event["name"])
            if event["name"] in names and predicate(event["args"][0]):
                return event["args"][0]
        socketio.sleep(0.02)
    raise AssertionError(f"no matching {names!r} within {timeout} s; got {seen}")


def wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_index(sio, predicate=lambda index: True, timeout: float = 15.0) -> dict:
    """The checkpoint index as the page holds it, once it passes ``predicate``.

    As ``static/js/checkpoints.js`` does: the whole ``checkpoints`` body, each
    ``checkpoints_delta`` applied to it (``apply_delta``), and the whole index
    asked for again (``checkpoints_index``) when a delta was missed. What is
    held is kept on ``sio`` for the next call; other events are dropped.
    """
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        for event in sio.get_received():
            name, payload = event["name"], event["args"][0]
            seen.append(name)
            held = getattr(sio, "rankwatch_index", None)
            if name == CHECKPOINTS_EVENT:
                held = payload
            elif name == CHECKPOINTS_DELTA_EVENT and held is not None:
                held = apply_delta(held, payload)
                if held is None:
                    seen.append(CHECKPOINTS_INDEX_REQUEST)
                    held = sio.emit(CHECKPOINTS_INDEX_REQUEST, callback=True)
            sio.rankwatch_index = held
        held = getattr(sio, "rankwatch_index", None)
        if held is not None and predicate(held):
            return held
        socketio.sleep(0.02)
    raise AssertionError(f"no matching checkpoint index within {timeout} s; got {seen}")
