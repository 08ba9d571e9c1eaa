"""msrun's worker logs as the log-mode tests write them, and the attempts a dashboard reads from them."""

from __future__ import annotations

import time
from pathlib import Path

from tests.helpers.app import make_app, operator

LOSS = "epoch: {e} step: {s}, loss is {loss}\n"


def logs_dir(run_dir) -> Path:
    path = Path(run_dir) / "msrun_logs"
    path.mkdir(exist_ok=True)
    return path


def steps(logs: Path, ranks, first: int, last: int, mode: str = "a") -> None:
    for r in ranks:
        with open(logs / f"worker_{r}.log", mode) as f:
            for s in range(first, last + 1):
                f.write(LOSS.format(e=1, s=s, loss=round(2.3 - s / 100, 4)))


def attempts(app, client) -> list[dict]:
    app.extensions["rankwatch"].state.scan(time.time())
    r = client.get("/api/attempts", headers=operator())
    assert r.status_code == 200, r.get_data(as_text=True)
    return r.get_json()["attempts"]


def relaunched(run_dir) -> Path:
    """Attempt 1 (steps 1-7) read by a dashboard, then msrun's relaunch empties the logs: attempt 2."""
    logs = logs_dir(run_dir)
    steps(logs, (0, 1), 1, 7)
    first = make_app(run_dir)
    try:
        client = first.test_client()
        assert [a["attempt"] for a in attempts(first, client)] == [1]
        steps(logs, (0,), 1, 2, mode="w")
        steps(logs, (1,), 1, 1, mode="w")
        assert [a["attempt"] for a in attempts(first, client)] == [1, 2]
    finally:
        first.extensions["rankwatch_runs"].stop()
    return logs
