"""Shared fixtures: a temporary run directory, the app and its clients, a live server, a browser.

Other test modules may define their own fixtures for their own areas (the
checkpoint tests do); these are the dashboard's.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

from app import create_app
from app.extensions import socketio
from tests.helpers.liveserver import launch_chromium, start_dashboard

# Small thresholds so that a test sees a rank turn stalled, then dead, in seconds.
FAST_SETTINGS = {
    "TICK_S": 0.1,
    "STALL_MIN_S": 1.5,
    "STALL_FACTOR": 5.0,
    "DEAD_AFTER_S": 4.0,
    "PROCESS_CHECK_AFTER_S": 1.0,
    "CHART_REFRESH_S": 0.5,
    # Log-mode warnings wait this long for a bridge's first heartbeat (the default is minutes).
    "BRIDGE_GRACE_S": 2.0,
}


@pytest.fixture
def run_dir():
    """An empty run directory, removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="rankwatch-run-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def app(run_dir):
    app = create_app({"RUN_DIR": str(run_dir), "TESTING": True, **FAST_SETTINGS})
    yield app
    # The watcher (if a Socket.IO client started it) must not outlive its app.
    app.extensions["rankwatch"].watcher.stop()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def sio(app, client):
    """A connected Socket.IO test client sharing the Flask client's cookies."""
    sio = socketio.test_client(app, flask_test_client=client)
    yield sio
    if sio.is_connected():
        sio.disconnect()


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


@pytest.fixture
def live_env(request):
    """Settings for the live server, as environment variables.

    A test changes some with ``@pytest.mark.parametrize("live_env", [{...}], indirect=True)``.
    """
    settings = {**FAST_SETTINGS, **getattr(request, "param", {})}
    return {f"RANKWATCH_{k}": str(v) for k, v in settings.items()}


@pytest.fixture
def live_server(run_dir, live_env, tmp_path):
    """``python -m app --run-dir RUN --port FREE`` as a real process, ready to serve."""
    server = start_dashboard(run_dir, tmp_path / "dashboard.log", env=live_env)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch_chromium(pw)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    yield page
    context.close()


@pytest.fixture
def console_errors(page):
    """Errors the page logs or throws; a test asserts the list stays empty."""
    errors: list[str] = []
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return errors


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a loopback port (tests/helpers/redisserver.py); skips if Debian's is not installed."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from tests.helpers.redisserver import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def simulator(run_dir):
    """Starts the scale simulator's heartbeat writers (tests/bench/simulate.py) in the run directory."""
    from tests.bench.simulate import Simulator

    sims = []

    def start(ranks: int, **kw) -> Simulator:
        sim = Simulator(run_dir, ranks, **kw)
        sims.append(sim)
        return sim.start()

    yield start
    for sim in sims:
        sim.stop()
