"""Issue 32, P11, in Chromium: the page's socket carries the tab's token, so the pushes name the run
directory to the operator's page as before and never to a viewer's; a token the server refuses at the
connect is dropped and the page watches on, read-only."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.checkpoints import save_bridge_set
from tests.helpers.heartbeats import write_job
from tests.helpers.liveserver import sign_in

pytestmark = pytest.mark.browser

WAIT_MS = 60_000
LIVE = {"CHECKPOINT_SCAN_S": 0.3, "TOKEN": TOKEN}

# A socket of the page's own (vendored) Socket.IO client: how its connect ends.
CONNECT = """(auth) => new Promise((resolve) => {
  const s = io({ transports: ["websocket"], auth });
  s.on("connect", () => { resolve("connected"); s.close(); });
  s.on("connect_error", (e) => { resolve({ message: e.message, data: e.data }); s.close(); });
})"""


@pytest.mark.parametrize("live_env", [LIVE], indirect=True)
def test_the_pages_socket_carries_the_token(live_server, page, run_dir, console_errors):
    write_job(run_dir, 2)
    save_bridge_set(run_dir, 10)
    meta = page.locator("#ckpt-meta")
    page.goto(live_server.url + "/checkpoints")
    expect(meta).to_contain_text(f" in {run_dir.name}; ", timeout=WAIT_MS)
    expect(meta).not_to_contain_text(str(run_dir))

    refused = page.evaluate(CONNECT, {"page": "checkpoints", "token": "not-" + TOKEN})
    assert refused["data"] == {"status": 401} and "wrong operator token" in refused["message"], refused
    assert page.evaluate(CONNECT, {"page": "checkpoints"}) == "connected"

    # Signed in (this tab's sessionStorage), the checkpoint page's pushes name the directory again.
    sign_in(page, live_server.url + "/", TOKEN)
    expect(page.locator("#operator-state")).to_have_text("operator", timeout=WAIT_MS)
    page.goto(live_server.url + "/checkpoints")
    expect(meta).to_contain_text(f" in {run_dir}; ", timeout=WAIT_MS)
    expect(page.locator("#ckpt-connection")).to_have_text("live", timeout=WAIT_MS)

    # A token the dashboard no longer takes (it was relaunched): the connect is refused, the tab
    # drops it, says so, and watches on as a viewer.
    page.evaluate("sessionStorage.setItem('rankwatch.token', 'stale-' + Date.now())")
    page.reload()
    expect(page.locator("#ckpt-flash")).to_contain_text("open a new login link", timeout=WAIT_MS)
    expect(page.locator("#ckpt-connection")).to_have_text("live", timeout=WAIT_MS)
    expect(meta).to_contain_text(f" in {run_dir.name}; ", timeout=WAIT_MS)
    assert page.evaluate("sessionStorage.getItem('rankwatch.token')") is None
    assert console_errors == [], (console_errors, live_server.log()[-4000:])
