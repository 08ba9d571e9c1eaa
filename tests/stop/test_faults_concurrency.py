"""Two operators press Stop at the same moment, in two browsers, against one live dashboard.

Only the dashboard is under test here (the trainers only ever read the one
flag file), so the job is the heartbeat simulator in the bridge's format.
One request must result: one flag write with one request id, the second
press joining it; and two audit rows, one ``accepted`` and one
``duplicate: joined request <id>``.
"""

from __future__ import annotations

import json
import time

import pytest
from playwright.sync_api import expect

from tests.helpers.app import TOKEN
from tests.helpers.faults import UI_TIMEOUT_MS, measure
from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.browser


def operator_page(new_context, url: str, who: str, responses: list):
    page = new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.on(
        "response",
        lambda r: (
            responses.append((who, r.status, r.json()))
            if r.request.method == "POST" and r.url.endswith("/api/exit")
            else None
        ),
    )
    page.goto(url)
    page.click("#token-open")
    page.fill("#token-input", TOKEN)
    page.click("#token-save")
    expect(page.locator("#operator-state")).to_have_text("operator")
    page.click("#stop-open")
    page.fill("#stop-reason", f"{who}: device unhealthy")
    page.fill("#stop-who", who)
    expect(page.locator("#stop-confirm")).to_be_enabled()
    return page


def test_two_browsers_press_stop_at_the_same_moment(new_context, run_dir, tmp_path, simulator, start_dash):
    simulator(4)
    dash = start_dash(run_dir, tmp_path / "dashboard.log", token=TOKEN)
    pages = []
    responses: list = []
    for who in ("alice", "bob"):
        pages.append(operator_page(new_context, dash.url, who, responses))
    # Both pages click Confirm at one wall-clock instant (same machine clock).
    at_ms = time.time() * 1000 + 600
    for page in pages:
        page.evaluate(
            "t => setTimeout(() => document.querySelector('#stop-confirm').click(),"
            " Math.max(0, t - Date.now()))",
            at_ms,
        )
    for page in pages:
        expect(page.locator("#stop-dialog")).not_to_have_attribute("open", "", timeout=UI_TIMEOUT_MS)
        expect(page.locator("#stop-panel")).to_have_attribute(
            "data-state", "requested", timeout=UI_TIMEOUT_MS
        )
    rows = dash.wait(
        lambda body: body["rows"] if len(body["rows"]) >= 2 else None, "two audit rows", path="/api/audit"
    )
    for page in pages:
        expect(page.locator("#audit-table tbody tr[data-action='request']")).to_have_count(
            2, timeout=UI_TIMEOUT_MS
        )

    assert len(responses) == 2, responses
    assert sorted(status for _, status, _ in responses) == [202, 202]
    created = [body["created"] for _, _, body in responses]
    assert sorted(created) == [False, True], responses
    ids = {body["request_id"] for _, _, body in responses}
    assert len(ids) == 1, responses
    request_id = ids.pop()

    assert [r["action"] for r in rows] == ["request", "request"], rows
    outcomes = sorted(r["outcome"] for r in rows)
    assert outcomes == ["accepted", f"duplicate: joined request {request_id}"], rows
    assert {r["request_id"] for r in rows} == {request_id}
    assert {r["who"] for r in rows} == {"alice", "bob"}
    first = next(r for r in rows if r["outcome"] == "accepted")
    flag = json.loads(runfiles.flag_path(run_dir).read_text())
    assert flag["GracefulExit"] == 1 and flag["request_id"] == request_id
    assert flag["requested_by"] == first["who"]
    measure(
        "two_operators.presses_apart",
        abs(rows[0]["at"] - rows[1]["at"]) * 1000,
        unit="ms",
        first=first["who"],
    )
