"""Ranks from agents in the page: two nodes' rows from their digests, then one agent lost.

Real ``python -m app`` (with ``RANKWATCH_AGENTS``), real ``rankwatch agent``
processes, a real redis-server and Chromium; the heartbeats are written in
the bridge's format into each simulated node's own run directory by a
thread, and the dashboard's directory holds none.
"""

from __future__ import annotations

import threading

import pytest
from playwright.sync_api import expect

from tests.helpers.agents import RUN, SimNode, write_set
from tests.helpers.app import FAST_SETTINGS
from tests.helpers.browser import RANK_ROWS, WAIT_MS, node_row
from tests.helpers.checkpoints import bridge_id

pytestmark = pytest.mark.browser


def test_the_page_shows_every_node_from_digests_and_an_agent_lost(
    tmp_path, redis_server, page, console_errors, start_agent, start_server
):
    nodes = [SimNode(tmp_path, "gpu-a", range(0, 3), 6), SimNode(tmp_path, "gpu-b", range(3, 6), 6)]
    done = threading.Event()

    def beat():
        while not done.is_set():
            for node in nodes:
                node.beat()
            done.wait(0.3)

    writer = threading.Thread(target=beat, daemon=True)
    writer.start()
    settings = {f"RANKWATCH_{k}": str(v) for k, v in FAST_SETTINGS.items()}
    agents = [
        start_agent(n.dir, redis_server.url, tmp_path / f"agent-{n.host}.log", host=n.host, env=settings)
        for n in nodes
    ]
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    server = start_server(
        hub_dir,
        tmp_path / "dashboard.log",
        env={
            **settings,
            "RANKWATCH_REDIS_URL": redis_server.url,
            "RANKWATCH_AGENTS": "1",
            "RANKWATCH_AGENT_LOST_S": "3",
        },
    )
    try:
        page.goto(server.url + "/")
        expect(page.locator(RANK_ROWS)).to_have_count(6, timeout=WAIT_MS)
        expect(page.locator('[data-summary="world_size"]')).to_have_text("6 on 2 hosts", timeout=WAIT_MS)
        a, b = node_row(page, "gpu-a"), node_row(page, "gpu-b")
        for row in (a, b):
            expect(row.locator('.node-verdicts [data-verdict="healthy"]')).to_have_text(
                "✓ healthy 3", timeout=WAIT_MS
            )

        # Opening a node asks its agent for its ranks' full rows (closed first: 6 ranks open by default).
        toggle = a.locator("button[data-node-toggle]")
        toggle.click()
        expect(toggle).to_have_attribute("aria-expanded", "false")
        with page.expect_response(lambda r: "/api/hosts/gpu-a/ranks" in r.url, timeout=WAIT_MS) as opened:
            toggle.click()
        body = opened.value.json()
        assert body["agent"]["answered"] is True and [r["rank"] for r in body["ranks"]] == [0, 1, 2], body
        expect(page.locator(RANK_ROWS)).to_have_count(6, timeout=WAIT_MS)

        agents[1].kill()
        expect(b.locator('.node-verdicts [data-verdict="agent_lost"]')).to_have_text(
            "⊘ agent lost 3", timeout=WAIT_MS
        )
        expect(b).to_have_attribute("data-unhealthy", "")
        expect(a.locator('.node-verdicts [data-verdict="healthy"]')).to_have_text("✓ healthy 3")
        expect(page.locator('#rank-table tbody tr[data-rank="4"]')).to_contain_text("agent on host gpu-b")
    finally:
        done.set()
        writer.join(timeout=30)
    assert console_errors == []


def test_the_checkpoint_page_lists_a_set_across_nodes_with_the_host_of_each_file(
    tmp_path, redis_server, page, console_errors, start_agent, start_server
):
    nodes = [SimNode(tmp_path, "gpu-a", range(0, 2), 4), SimNode(tmp_path, "gpu-b", range(2, 4), 4)]
    for node in nodes:
        node.beat()
    write_set(nodes[0], 8, (0, 1))
    write_set(nodes[1], 8, (2, 3))
    settings = {f"RANKWATCH_{k}": str(v) for k, v in FAST_SETTINGS.items()}
    for n in nodes:
        start_agent(n.dir, redis_server.url, tmp_path / f"agent-{n.host}.log", host=n.host, env=settings)
    hub_dir = tmp_path / "hub" / RUN
    hub_dir.mkdir(parents=True)
    server = start_server(
        hub_dir,
        tmp_path / "dashboard.log",
        env={**settings, "RANKWATCH_REDIS_URL": redis_server.url, "RANKWATCH_AGENTS": "1"},
    )
    page.goto(server.url + "/checkpoints")
    row = page.locator(f'#ckpt-table tr.set-row[data-set-id="{bridge_id(8)}"]')
    expect(row).to_have_attribute("data-complete", "true", timeout=WAIT_MS)
    row.locator("button", has_text="Files").click()
    files = page.locator(f'tr[data-detail-for="{bridge_id(8)}"] tr[data-path]')
    expect(files).to_have_count(4)
    expect(files.filter(has_text="rank_1/")).to_contain_text("on host gpu-a")
    expect(files.filter(has_text="rank_3/")).to_contain_text("on host gpu-b")
    expect(files.locator("a[download]")).to_have_count(0)  # on other nodes: named, not downloadable
    assert console_errors == []
