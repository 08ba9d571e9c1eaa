"""Shared fixtures: a temporary run directory, the app and its clients, a live server, a browser.

Fixtures only: the helpers they and the tests share live in ``tests/helpers/``,
and a fixture that several files of one folder share in that folder's
``conftest.py``. A test module imports no other test module (an import-linter
contract in pyproject.toml), the operator token is ``TOKEN`` (with ``AUTH``) of
``tests/helpers/app.py`` alone, and a module's own ``app`` fixture, where its
settings differ, calls ``make_app(run_dir, **overrides)``; ``make lint`` checks
all three (``python -m tests.lint``, tests/lint.py).
What a test starts (a demo job, a dashboard, an agent, any process) it starts
through a ``start_*`` fixture, which ends it after the test whatever happened:
a failing assertion cannot leak a process, and the test needs no ``finally``.
Security and fault tests live with the area they attack; their file names
give them the ``security`` and ``faults`` markers (``-m security``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import ExitStack
from operator import methodcaller
from pathlib import Path

import pytest

from app.extensions import socketio
from tests.helpers.agents import AgentProcess
from tests.helpers.app import FAST_SETTINGS, make_app
from tests.helpers.faults import Dashboard
from tests.helpers.jobs import NODE_TIMEOUT_S, DemoJob
from tests.helpers.liveserver import launch_chromium, start_dashboard
from tests.helpers.receiver import Receiver

# Every job a test starts inherits it (why: tests/helpers/jobs.py, NODE_TIMEOUT_S).
os.environ.setdefault("MS_NODE_TIMEOUT", NODE_TIMEOUT_S)


@pytest.fixture
def run_dir():
    """An empty run directory, removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="rankwatch-run-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def app(run_dir):
    """The dashboard on ``run_dir``: ``FAST_SETTINGS`` and the operator token ``TOKEN``."""
    app = make_app(run_dir)
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
def new_context(browser):
    """``new_context(**options)``: one more browser context (another user, a viewport), closed after the test."""
    with ExitStack() as ends:

        def new(**options):
            context = browser.new_context(**options)
            ends.callback(context.close)
            return context

        yield new


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
def slurm(tmp_path):
    """A real Slurm (munged, slurmctld, one slurmd) on the loopback (tests/helpers/slurm.py), stopped after.

    Skips where Slurm cannot run (not installed, not root), except under CI=true: CI always runs these.
    """
    import os

    from tests.helpers.slurm import Slurm, unavailable

    why = unavailable()
    if why:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {why}")
        pytest.skip(why)
    server = Slurm(tmp_path).start()
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


def _started(make, end, begin=lambda obj: obj):
    """A fixture's body: a function that makes (and ``begin``s) objects, each ``end``ed after the test.

    ``end`` and ``begin`` are ``methodcaller``s, so a subclass's own ``start``/``kill`` run
    (``UnsupervisedJob`` launches without msrun's join).
    """
    with ExitStack() as ends:

        def start(*args, **kw):
            obj = make(*args, **kw)
            ends.callback(end, obj)
            return begin(obj)

        yield start


@pytest.fixture
def start_job():
    """``start_job(run_dir, epochs=3, ...)``: a started ``DemoJob`` (a real msrun job), killed after the test.

    ``start_job(job)`` starts a ``DemoJob`` made beforehand (one whose command a test changed).
    """

    def make(run_dir_or_job, **kw) -> DemoJob:
        return run_dir_or_job if isinstance(run_dir_or_job, DemoJob) else DemoJob(run_dir_or_job, **kw)

    yield from _started(make, methodcaller("kill"), methodcaller("start"))


@pytest.fixture
def start_server():
    """``start_server(run_dir, log_path, ...)``: ``start_dashboard``'s ready ``LiveServer``, stopped after the test."""
    yield from _started(start_dashboard, methodcaller("stop"))


@pytest.fixture
def start_dash():
    """``start_dash(run_dir, log_path, **settings)``: a fault tests' ``Dashboard`` (tests/helpers/faults.py), stopped after."""
    yield from _started(Dashboard, methodcaller("stop"))


@pytest.fixture
def start_agent():
    """``start_agent(run_dir, redis_url, log, ...)``: a started ``rankwatch agent`` process, stopped after the test."""
    yield from _started(AgentProcess, methodcaller("stop"), methodcaller("start"))


@pytest.fixture
def start_process():
    """``start_process(cmd, **popen_kw)``: a ``subprocess.Popen``, killed after the test if it still runs."""
    yield from _started(subprocess.Popen, _kill)


@pytest.fixture
def make_receiver():
    """``make_receiver(port=None, ...)``: a webhook ``Receiver``, not yet started (``.start()``), stopped after."""
    yield from _started(Receiver, methodcaller("stop"))


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def pytest_collection_modifyitems(items):
    for item in items:
        name = item.path.name
        if name.startswith("test_security_") or name.endswith("_hostile.py") or "hostile" in name:
            item.add_marker(pytest.mark.security)
        if name.startswith("test_faults_"):
            item.add_marker(pytest.mark.faults)
