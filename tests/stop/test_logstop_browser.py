"""What the page says about a log-only job (issue 21, H): epoch and step without a global step,
an unknown throughput, and the stop dialog naming OnRequestExit's files instead of the bridge's.

A real ``python -m app`` and headless Chromium; the worker logs are real files in msrun's format.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.helpers.liveserver import sign_in
from tests.ranks.test_browser import WAIT_MS, cell

pytestmark = pytest.mark.browser

TOKEN = "logstop-browser-token"


@pytest.mark.parametrize("live_env", [{"TOKEN": TOKEN}], indirect=True)
def test_a_log_job_shows_epoch_and_step_unknown_throughput_and_onrequestexits_files(
    live_server, page, run_dir, console_errors
):
    logs = run_dir / "msrun_logs"
    logs.mkdir()
    for r in (0, 1):
        # The data-parallel tutorial prints every 10th step from epoch 2 on: no steps per epoch,
        # so no global step, but the epoch and the step are known.
        (logs / f"worker_{r}.log").write_text(
            "".join(f"epoch: 1, step: {s}, loss is {2.3 - s / 100:.4f}\n" for s in (10, 20))
        )
    sign_in(page, live_server.url + "/", TOKEN)
    expect(page.locator("#rank-table tbody tr")).to_have_count(2, timeout=WAIT_MS)
    for r in (0, 1):
        (logs / f"worker_{r}.log").write_text("epoch: 2, step: 10, loss is 2.0\n")
    expect(cell(page, 1, "global_step")).to_have_text("3 / 11", timeout=WAIT_MS)
    # No log rank reports samples per second: unknown, not "0 samples/s".
    expect(page.locator("[data-summary='throughput']")).to_have_text("unknown")
    page.click("#stop-open")
    expect(page.locator("#estimate-dir")).to_contain_text("rank_{r}/<file_name>_train.ckpt")
    expect(page.locator("#estimate-dir")).not_to_contain_text("checkpoints/rank_{r}/")
    assert console_errors == []
