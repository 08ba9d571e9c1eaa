"""A job on several hosts in the page: node rows in the rank table, the heat map by node.

Real ``python -m app`` and Chromium; heartbeat files in the bridge's format,
written by a thread for ranks of made-up hosts (none is the dashboard's own,
so no rank is probed with psutil and a silent host can be judged lost).
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from tests.helpers.browser import LAPTOP, NODE_ROWS, RANK_ROWS, WAIT_MS, horizontal_overflow, node_row
from tests.helpers.heartbeats import Hosts, heartbeat, write_heartbeat, write_job

pytestmark = pytest.mark.browser

# A loaded machine may write a round late: silence must last longer than that to count.
SETTINGS = {"STALL_MIN_S": 3.0, "DEAD_AFTER_S": 8.0}


def expect_rows(page, want: list[str]) -> None:
    """Waits until the body's rows, top to bottom, are ``want``: "node NAME" or a rank number."""
    page.wait_for_function(
        """want => JSON.stringify(Array.from(document.querySelectorAll('#rank-table tbody tr'), (tr) =>
             tr.classList.contains('node-row') ? 'node ' + tr.querySelector('.node-name').textContent
                                              : tr.dataset.rank)) === JSON.stringify(want)""",
        arg=want,
        timeout=WAIT_MS,
    )


@pytest.mark.parametrize("live_env", [SETTINGS], indirect=True)
def test_two_hosts_get_node_rows_that_fold_sort_filter_and_show_a_lost_node(
    live_server, page, run_dir, console_errors
):
    hosts = {0: "gpu-a", 1: "gpu-a", 2: "gpu-a", 3: "gpu-b", 4: "gpu-b", 5: "gpu-b"}
    with Hosts(run_dir, hosts, step_ms={1: 52.5}) as writer:
        page.goto(live_server.url + "/")
        # A small job: every node open, its summary row above its ranks.
        expect(page.locator(RANK_ROWS)).to_have_count(6, timeout=WAIT_MS)
        expect(page.locator(NODE_ROWS)).to_have_count(2)
        expect(page.locator('[data-summary="world_size"]')).to_have_text("6 on 2 hosts")
        expect_rows(page, ["node gpu-a", "0", "1", "2", "node gpu-b", "3", "4", "5"])
        a, b = node_row(page, "gpu-a"), node_row(page, "gpu-b")
        expect(a.locator(".node-ranks")).to_have_text("3 ranks")
        expect(a.locator('.node-verdicts [data-verdict="healthy"]')).to_have_text(
            "✓ healthy 3", timeout=WAIT_MS
        )
        expect(b.locator('.node-verdicts [data-verdict="healthy"]')).to_have_text(
            "✓ healthy 3", timeout=WAIT_MS
        )
        expect(a.locator(".node-slowest")).to_have_text("slowest: rank 1, 52.5 ms", timeout=WAIT_MS)
        expect(a.locator(".node-age")).to_contain_text("oldest heartbeat")
        expect(a).not_to_have_attribute("data-unhealthy", "")

        # Folding by keyboard: the button keeps focus and says its state.
        toggle = a.locator("button[data-node-toggle]")
        expect(toggle).to_have_attribute("aria-expanded", "true")
        toggle.focus()
        page.keyboard.press("Enter")
        expect(toggle).to_have_attribute("aria-expanded", "false")
        expect(page.locator(RANK_ROWS)).to_have_count(3)
        expect_rows(page, ["node gpu-a", "node gpu-b", "3", "4", "5"])
        assert toggle.evaluate("el => el === document.activeElement")
        page.keyboard.press("Space")
        expect(toggle).to_have_attribute("aria-expanded", "true")
        expect(page.locator(RANK_ROWS)).to_have_count(6)

        # Sorting orders the ranks within each node; the nodes keep their order.
        page.locator('th[data-col="rank"] button').click()
        expect(page.locator('th[data-col="rank"]')).to_have_attribute("aria-sort", "descending")
        expect_rows(page, ["node gpu-a", "2", "1", "0", "node gpu-b", "5", "4", "3"])

        # gpu-b goes silent as one: its row says node lost, gpu-a's stays healthy.
        writer.silent.add("gpu-b")
        expect(b.locator('.node-verdicts [data-verdict="node_lost"]')).to_have_text(
            "⨯ node lost 3", timeout=WAIT_MS
        )
        expect(b).to_have_attribute("data-unhealthy", "")
        expect(b).to_have_attribute("data-worst", "node_lost")
        expect(b.locator(".node-slowest")).to_have_text("slowest: –")
        expect(a.locator('.node-verdicts [data-verdict="healthy"]')).to_have_text("✓ healthy 3")
        expect(a.locator(".node-verdicts .badge")).to_have_count(1)
        expect(a).not_to_have_attribute("data-unhealthy", "")

        # The filter picks ranks within nodes; a node with none left goes.
        page.locator("#verdict-filter").select_option("node_lost")
        expect(page.locator(NODE_ROWS)).to_have_count(1)
        expect_rows(page, ["node gpu-b", "5", "4", "3"])
        page.locator("#verdict-filter").select_option("")
        expect(page.locator(NODE_ROWS)).to_have_count(2)
    assert console_errors == []


def test_one_host_has_no_node_rows(live_server, page, run_dir, console_errors):
    write_job(run_dir, 3)
    for r in range(3):
        write_heartbeat(run_dir, heartbeat(r, 3, host="only-node"))
    page.goto(live_server.url + "/")
    expect(page.locator(RANK_ROWS)).to_have_count(3, timeout=WAIT_MS)
    expect(page.locator(NODE_ROWS)).to_have_count(0)
    expect(page.locator('[data-summary="world_size"]')).to_have_text("3")
    assert console_errors == []


@pytest.mark.parametrize("live_env", [{**SETTINGS, "PAGE_SIZE": 20}], indirect=True)
def test_a_large_job_on_three_hosts_opens_folded_pages_by_node_and_maps_heat_by_node(
    live_server, new_context, run_dir, tmp_path
):
    # Ranks dealt round-robin, and node order is by lowest rank, not by name.
    names = ["node-c", "node-a", "node-b"]
    world = 72
    hosts = {r: names[r % 3] for r in range(world)}
    page = new_context(viewport=LAPTOP).new_page()
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    with Hosts(run_dir, hosts, step_ms={40: 58.0}) as writer:
        page.goto(live_server.url + "/")
        # More than 64 ranks: nodes start folded.
        expect(page.locator(NODE_ROWS)).to_have_count(3, timeout=WAIT_MS)
        expect(page.locator(RANK_ROWS)).to_have_count(0)
        expect_rows(page, [f"node {n}" for n in names])
        for name in names:
            expect(node_row(page, name).locator(".node-ranks")).to_have_text("24 ranks")
            expect(node_row(page, name).locator("button[data-node-toggle]")).to_have_attribute(
                "aria-expanded", "false"
            )
            expect(node_row(page, name).locator('[data-verdict="healthy"]')).to_have_text(
                "✓ healthy 24", timeout=WAIT_MS
            )
        expect(node_row(page, "node-a").locator(".node-slowest")).to_have_text(
            "slowest: rank 40, 58 ms", timeout=WAIT_MS
        )

        # Opened, node-a's 24 ranks run onto a second page, under its row again.
        node_row(page, "node-a").locator("button[data-node-toggle]").click()
        node_a = [str(r) for r in range(1, world, 3)]
        expect_rows(page, ["node node-c", "node node-a", *node_a[:18]])
        expect(page.locator("#page-info")).to_have_text("rows 1–20 of 27 (3 nodes)")
        page.click("#page-next")
        expect_rows(page, ["node node-a", *node_a[18:], "node node-b"])
        expect(node_row(page, "node-a").locator(".node-ranks")).to_have_text("24 ranks (continued)")

        # The heat map: rows by node (in the table's order), then rank.
        expected = [f"{name} · {r}" for i, name in enumerate(names) for r in range(i, world, 3)]
        page.wait_for_function(
            "want => { const el = document.querySelector('#chart-heatmap');"
            " return el && el.data && el.data[0].y.length === want.length"
            " && el.data[0].y.every((y, i) => y === want[i]); }",
            arg=expected,
            timeout=WAIT_MS,
        )

        writer.silent.add("node-b")
        lost = node_row(page, "node-b")
        expect(lost.locator('[data-verdict="node_lost"]')).to_have_text("⨯ node lost 24", timeout=WAIT_MS)
        expect(lost).to_have_attribute("data-unhealthy", "")
        assert horizontal_overflow(page) == {"table": 0, "page": 0}
        # Folded again, node-a leaves one page with the three nodes.
        node_row(page, "node-a").locator("button[data-node-toggle]").click()
        expect_rows(page, [f"node {n}" for n in names])
        expect(page.locator("#pager")).to_be_hidden()
        for name in ("node-c", "node-a"):
            expect(node_row(page, name).locator('[data-verdict="healthy"]')).to_have_text("✓ healthy 24")
            expect(node_row(page, name)).not_to_have_attribute("data-unhealthy", "")
        page.locator("#rank-table").scroll_into_view_if_needed()
        page.screenshot(path=str(tmp_path / "three-hosts.png"), full_page=True)
    assert errors == []
