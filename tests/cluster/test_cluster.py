"""Several dashboard processes behind one Redis (app/cluster.py): real redis-server, real
``python -m app`` processes, real Chromium.

The ranks are a heartbeat writer here (files and Redis, as the bridge with
``RANKWATCH_REDIS_URL`` does), not msrun: what is tested is the dashboards'
sharing, and two dashboards plus two pages already fill the machine.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.helpers.app import AUTH, TOKEN
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.queuepage import until
from trainer_bridge.rundir import redisbus, runfiles

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TTL_S = 2.0
UI_TIMEOUT_MS = 60_000
WORLD = 2


class Ranks:
    """Two ranks beating every 0.2 s: heartbeat files, and Redis while it answers."""

    def __init__(self, run_dir, redis_url: str):
        self.run_dir = run_dir
        write_job(run_dir, WORLD)
        self.pub = redisbus.Publisher(redis_url, redisbus.job_key(run_dir), world_size=WORLD)
        self.seq = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Ranks:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seq += 1
            for r in range(WORLD):
                hb = heartbeat(r, WORLD, seq=self.seq)
                write_heartbeat(self.run_dir, hb)
                self.pub.publish(r, json.dumps(hb).encode())
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def roles(servers) -> list[str]:
    return [get_json(s.url + "/api/health")["role"] for s in servers]


def one_leader(servers):
    """The (leader, follower) pair once exactly one leads and both name it."""
    healths = [get_json(s.url + "/api/health") for s in servers]
    leaders = [s for s, h in zip(servers, healths, strict=True) if h["role"] == "leader"]
    if len(leaders) != 1 or len({h["leader"] for h in healths}) != 1:
        return None
    (leader,) = leaders
    return leader, next(s for s in servers if s is not leader)


STEPS_PER_BEAT = 20  # heartbeat()'s default: one second of 50 ms steps


def step_shown(page) -> int:
    """The lowest global step the page's table shows (0 until every rank shows one)."""
    cells = page.locator("#rank-table tbody td[data-col='global_step']").all_text_contents()
    # "epoch / step in epoch (global step)"; the last number is the global step.
    numbers = [int(found[-1].replace(",", "")) for c in cells if (found := re.findall(r"[\d,]+", c))]
    return min(numbers) if len(numbers) == WORLD else 0


def sees_live_updates(page, ranks: Ranks) -> None:
    """The page's table keeps up with heartbeats written after now (it is not a stale snapshot)."""
    target = (ranks.seq + 5) * STEPS_PER_BEAT
    until(lambda: step_shown(page) >= target, f"the page shows global step {target}")


@pytest.fixture
def ranks(run_dir, redis_server):
    """Two ranks beating into the run directory and Redis (a thread of the test), stopped after it."""
    ranks = Ranks(run_dir, redis_server.url).start()
    yield ranks
    ranks.stop()


@pytest.fixture
def servers(run_dir, tmp_path, redis_server, ranks, start_server):
    """Two dashboards on the run and one Redis, stopped after the test."""
    env = {
        "RANKWATCH_REDIS_URL": redis_server.url,
        "RANKWATCH_TOKEN": TOKEN,
        "RANKWATCH_TICK_S": "0.2",
        "RANKWATCH_LEADER_TTL_S": str(TTL_S),
    }
    return [start_server(run_dir, tmp_path / f"dashboard-{name}.log", env=env) for name in ("a", "b")]


def open_page(new_context, url: str):
    page = new_context(viewport={"width": 1400, "height": 1000}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url)
    expect(page.locator("#rank-table tbody tr[data-health='healthy']")).to_have_count(
        WORLD, timeout=UI_TIMEOUT_MS
    )
    return page, errors


def test_two_dashboards_share_live_state_a_stop_and_one_leader(run_dir, new_context, ranks, servers):
    leader, follower = until(lambda: one_leader(servers), "exactly one leader")
    on_leader, errors_l = open_page(new_context, leader.url)
    on_follower, errors_f = open_page(new_context, follower.url)
    # The follower pushes nothing itself while Redis answers: its page moves
    # only because the leader's deltas are relayed through the queue.
    sees_live_updates(on_follower, ranks)
    sees_live_updates(on_leader, ranks)
    assert get_json(follower.url + "/api/health")["redis"]["relay"] is True

    # A stop pressed on the follower's page: written to the flag file by the
    # follower, pushed by the leader, shown on both pages.
    on_follower.click("#token-open")
    on_follower.fill("#token-input", TOKEN)
    on_follower.click("#token-save")
    expect(on_follower.locator("#operator-state")).to_have_text("operator")
    on_follower.click("#stop-open")
    on_follower.fill("#stop-reason", "cluster test: stop from the other dashboard")
    on_follower.click("#stop-confirm")
    until(
        lambda: json.loads(runfiles.flag_path(run_dir).read_text())["GracefulExit"] == 1,
        "the follower writes the flag",
    )
    for page in (on_leader, on_follower):
        expect(page.locator("#stop-panel")).to_have_attribute(
            "data-state", "requested", timeout=UI_TIMEOUT_MS
        )
        expect(page.locator("#stop-request-reason")).to_have_text(
            "cluster test: stop from the other dashboard"
        )

    # The leader dies without a word: the follower takes the lock over once it expires.
    killed_at = time.monotonic()
    leader.kill()
    until(lambda: roles([follower]) == ["leader"], "the follower takes over", timeout=TTL_S + 60)
    print(f"takeover after {time.monotonic() - killed_at:.2f} s (lock TTL {TTL_S} s)")
    sees_live_updates(on_follower, ranks)
    expect(on_follower.locator("#stop-panel")).to_have_attribute("data-state", "requested")
    assert errors_l == [] and errors_f == []


def test_redis_killed_mid_run_the_dashboards_serve_from_files_and_recover(
    redis_server, run_dir, new_context, ranks, servers
):
    leader, follower = until(lambda: one_leader(servers), "exactly one leader")
    on_follower, errors = open_page(new_context, follower.url)
    sees_live_updates(on_follower, ranks)

    redis_server.stop()
    # Both keep answering from the files, and say why.
    for s in servers:
        until(
            lambda s=s: "Redis is unreachable" in get_json(s.url + "/api/summary")["run"]["message"],
            f"{s.url} reports Redis unreachable",
        )
        health = get_json(s.url + "/api/health")
        assert health["redis"]["reachable"] is False and health["redis"]["error"]
        assert get_json(s.url + "/api/ranks")["run"]["transport"] == "files"
    # No election without Redis: each keeps its role.
    assert roles([leader, follower]) == ["leader", "follower"]
    expect(on_follower.locator("#run-message")).to_contain_text("Redis is unreachable", timeout=UI_TIMEOUT_MS)
    # The follower's page hears nothing from the leader now, so its own dashboard pushes.
    sees_live_updates(on_follower, ranks)
    # A stop needs no Redis: the follower writes the flag and shows it on its page.
    request = urllib.request.Request(
        follower.url + "/api/exit",
        data=json.dumps({"reason": "stop while Redis is down"}).encode(),
        headers={"Content-Type": "application/json", **AUTH},
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 202
    assert json.loads(runfiles.flag_path(run_dir).read_text())["GracefulExit"] == 1
    expect(on_follower.locator("#stop-panel")).to_have_attribute(
        "data-state", "requested", timeout=UI_TIMEOUT_MS
    )

    redis_server.start()  # the same port, empty: the old lock is gone
    for s in servers:
        until(
            lambda s=s: get_json(s.url + "/api/health")["redis"]["reachable"],
            f"{s.url} reaches Redis again",
        )
        until(
            lambda s=s: get_json(s.url + "/api/summary")["run"]["transport"] == "redis",
            f"{s.url} reads heartbeats from Redis again",
        )
    until(lambda: one_leader(servers), "exactly one leader again")
    expect(on_follower.locator("#run-message")).not_to_contain_text("Redis", timeout=UI_TIMEOUT_MS)
    sees_live_updates(on_follower, ranks)
    for s in servers:
        assert s.proc.poll() is None, s.log()
    assert errors == []
