"""An unmodified script (LossMonitor + TimeMonitor, no bridge) under real msrun, shown from its logs.

The demo runs with ``--no-bridge --monitors``: nothing of Rankwatch runs in
the trainers, no ``RUN/rankwatch/`` is written. msrun's own output goes into
the log directory (``msrun ... > RUN/msrun_logs/msrun.log``), as an operator
who keeps it does. ``GLOG_v=2`` is MindSpore's default log level (the demo
otherwise quiets it to 3).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from app import create_app
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.jobs import DemoJob, JobFailed, dump

pytestmark = pytest.mark.msrun

TIMEOUT_S = 240


def ranks(client) -> list[dict]:
    return client.get("/api/ranks").get_json()["ranks"]


def wait_rows(client, job: DemoJob, predicate, what: str, timeout: float = TIMEOUT_S) -> list[dict]:
    """Poll ``GET /api/ranks`` until ``predicate(rows)``; fail early if the job died before it."""
    deadline = time.monotonic() + timeout
    rows = []
    while time.monotonic() < deadline:
        rows = ranks(client)
        if predicate(rows):
            return rows
        if job.proc.poll() is not None and not predicate(rows := ranks(client)):
            raise JobFailed(f"job exited ({job.proc.returncode}) before {what}\n{dump(rows)}\n{job.logs()}")
        time.sleep(0.2)
    raise JobFailed(f"timed out waiting for {what}\n{dump(rows)}\n{job.logs()}")


def training(rows, at_least: int = 1) -> bool:
    return len(rows) == 2 and all(
        r["source"] == "log"
        and r["state"] == "training"
        and r["health"] == "healthy"
        and (r["global_step"] or 0) >= at_least
        and r["loss"] is not None
        for r in rows
    )


def test_unmodified_script_is_shown_live_from_its_logs_and_a_killed_rank_dead_with_msruns_words(tmp_path):
    run = tmp_path / "run"
    (run / "msrun_logs").mkdir(parents=True)
    job = DemoJob(
        run,
        ranks=2,
        epochs=40,
        samples=500,
        step_delay=0.05,
        extra=["--no-bridge", "--monitors"],
        env={"GLOG_v": "2"},
    )
    job.output_path = run / "msrun_logs" / "msrun.log"
    app = create_app({"RUN_DIR": str(run), "TESTING": True, **FAST_SETTINGS})
    client = app.test_client()
    with job:
        first = wait_rows(client, job, lambda rows: training(rows, 3), "both ranks training from their logs")
        later = wait_rows(
            client,
            job,
            lambda rows: (
                training(rows)
                and all(r["global_step"] > f["global_step"] + 5 for r, f in zip(rows, first, strict=True))
            ),
            "the steps to advance",
        )
        assert not (run / "rankwatch").exists(), "the script ran without the bridge"
        for row in later:
            assert row["epoch"] >= 1 and row["step"] >= 1
            assert row["step_time_ms"] is not None and row["step_time_ms"] > 0
            assert row["heartbeat_age_s"] is not None and row["heartbeat_age_s"] < 30
            assert row["cpu_percent"] is None and row["rss_bytes"] is None and row["device"] is None
            # The pid is the worker's own: its stdout is this rank's log.
            log = os.stat(run / "msrun_logs" / f"worker_{row['rank']}.log")
            out = os.stat(f"/proc/{row['pid']}/fd/1")
            assert (out.st_dev, out.st_ino) == (log.st_dev, log.st_ino)
        summary = client.get("/api/summary").get_json()
        assert summary["world_size"] == 2
        assert "from msrun's worker logs" in summary["run"]["message"]
        stop = client.get("/api/exit").get_json()
        assert stop["logs"]["ranks"] == 2 and stop["logs"]["on_request_exit"] is None

        victim = later[1]["pid"]
        os.kill(victim, signal.SIGKILL)
        said = f"msrun: Worker process {victim} exit with exception. Error code: -9 (killed by SIGKILL, signal 9)"
        rows = wait_rows(
            client,
            job,
            lambda rows: rows[1]["health"] in ("dead", "failed") and said in rows[1]["reason"],
            "the killed rank to be dead with msrun's words",
        )
        # The probe's word first ("is gone", or "has exited" while msrun has not reaped it), then msrun's.
        assert rows[1]["reason"].startswith(f"process {victim} "), rows[1]
        # msrun SIGKILLs the other worker at once; its row says why.
        rows = wait_rows(
            client,
            job,
            lambda rows: (
                rows[0]["health"] == "dead" and "msrun killed the remaining workers" in rows[0]["reason"]
            ),
            "the survivor killed by msrun to be dead",
        )
        assert f"after: Worker process {victim} exit with exception" in rows[0]["reason"]
