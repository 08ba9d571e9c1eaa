"""What a newcomer meets at the command line (issue 21, items 2 to 6; issue 19, items 10 and 16).

A mistyped run directory, a port in use, rank-written text with escape
sequences and markup, Ctrl-C while ``status --watch`` loads, the grouped
``serve --help``, ``rankwatch --version`` without the engines, and
``rankwatch login``. Commands run in-process (click's runner) where only
their output matters, and as real processes where signals, ports and the
dashboard are the point.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from click.testing import CliRunner

from app.cli import main
from app.config import GROUPS, SETTINGS
from tests.helpers.checkpoints import save_bridge_set
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from tests.helpers.liveserver import start_dashboard
from tests.helpers.signals import ctrl_c_default

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def cli(*args: str, **kw) -> subprocess.Popen:
    """``python -m app.cli ARGS`` as a real process, its output (both streams) on a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "app.cli", *args],
        cwd=REPO,
        env={**ENV, **kw.pop("env", {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ctrl_c_default,
        **kw,
    )


class Lines:
    """A process's output, read on a thread, waited on line by line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.done = proc, [], threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
        self.done.set()

    def wait_for(self, pattern: str) -> re.Match:
        deadline = time.monotonic() + WAIT_S
        while True:
            ended = self.done.is_set()
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert not ended, f"ended without {pattern!r}:\n{self.text()}"
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n{self.text()}"
            time.sleep(0.05)

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def procs():
    """Processes a test starts; ended (SIGTERM, then SIGKILL) after it."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def taken_port():
    """A port something listens on, as another dashboard would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# -- 21.5: one error for a mistyped --run-dir -------------------------------------


@pytest.mark.parametrize(
    "command", [["status"], ["checkpoints"], ["stop", "--reason", "x"], ["status", "--watch"]]
)
def test_a_mistyped_run_dir_is_one_clear_error_and_a_non_zero_exit(tmp_path, command):
    typo = tmp_path / "runs" / "dmeo"
    result = CliRunner().invoke(main, [*command, "--run-dir", str(typo)])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--run-dir': {typo} does not exist" in result.output
    assert "0 checkpoint set" not in result.output and not typo.exists()


def test_serve_says_in_the_terminal_that_it_waits_for_a_run_dir(tmp_path, procs):
    typo = tmp_path / "dmeo"
    procs.append(cli("serve", "--run-dir", str(typo), "--port", "0"))
    out = Lines(procs[-1])
    out.wait_for(r"^Rankwatch: open http://")
    said = [ln for ln in out.lines if "does not exist" in ln]
    assert said and "waits for the job to create it" in said[0] and "--run-dir" in said[0], out.text()


# -- 21.4: a port in use ------------------------------------------------------------


@pytest.mark.parametrize("command", [["-m", "app.cli", "serve"], ["-m", "app"]])
def test_a_port_in_use_is_said_at_once_with_what_to_do(run_dir, taken_port, command):
    proc = subprocess.run(
        [sys.executable, *command, "--run-dir", str(run_dir), "--port", str(taken_port)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 1, proc
    said = f"port {taken_port} is in use (another Rankwatch?): use --port N or --port 0"
    assert said in proc.stderr and "Can't connect" not in proc.stderr + proc.stdout, proc


def test_a_port_held_by_our_own_dashboard_names_its_run_and_a_safe_way_beside_it(tmp_path, run_dir):
    """'Use another port' alone led a newcomer to start a second job into the same run (issue 33)."""
    first = start_dashboard(run_dir, tmp_path / "first.log")
    try:
        port = int(first.url.rsplit(":", 1)[1])
        proc = subprocess.run(
            [sys.executable, "-m", "app", "--run-dir", str(tmp_path / "other"), "--port", str(port)],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=WAIT_S,
        )
    finally:
        first.stop()
    assert proc.returncode == 1, proc
    said = proc.stderr
    assert f"port {port} is in use by your Rankwatch dashboard of {run_dir}" in said, said
    assert f"pid {first.proc.pid}" in said and f"rankwatch login --url {first.url}" in said, said
    assert "its own run directory" in said and "--port 0" in said, said


def tiny_demo(run, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """``rankwatch demo`` of one small epoch into ``run``, to its end; (the process, its output)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "app.cli",
            "demo",
            "--run-dir",
            str(run),
            *args,
            "--epochs",
            "1",
            "--samples",
            "64",
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, proc.stdout + proc.stderr


def test_the_demo_stops_before_training_when_its_port_is_in_use(tmp_path, taken_port):
    """No dashboard, no job: nothing trains, and nothing says the dashboard stays up."""
    run = tmp_path / "run"
    proc, out = tiny_demo(run, "--port", str(taken_port))
    assert proc.returncode != 0, out
    assert f"port {taken_port} is in use (another Rankwatch?)" in out and "nothing was trained" in out, out
    assert "stays up" not in out and "training LeNet5" not in out, out
    assert not (run / "msrun_logs" / "launcher.log").exists() and not (run / "rankwatch").exists()


def test_the_demo_refuses_a_run_directory_a_job_trains_in_before_anything_starts(tmp_path):
    """Issue 33, section 2: a second make demo (PORT=5001) into a busy run directory started msrun, which
    truncated the running job's logs. Now nothing starts, and the terminal says why and what to do."""
    run = tmp_path / "run"
    write_job(run, 2)
    for rank in range(2):  # a job training here now: its ranks' pid is this test's, which runs
        write_heartbeat(run, heartbeat(rank, 2))
    (run / "msrun_logs").mkdir()
    (run / "msrun_logs" / "worker_0.log").write_text("the running job's log\n")
    # Without the dashboard: were the check gone, the demo would end on rankwatch launch's refusal
    # (in launcher.log, not the terminal) instead of serving until killed. The check comes first either way.
    proc, out = tiny_demo(run, "--no-dashboard")
    assert proc.returncode != 0, out
    assert f"another launch of a job is training in {run}: rank 0 (pid {os.getpid()} on " in out, out
    assert "rankwatch stop" in out and "make demo RUN=" in out and "Nothing was started." in out, out
    assert "training LeNet5" not in out and "open http" not in out, out
    assert (run / "msrun_logs" / "worker_0.log").read_text() == "the running job's log\n"
    assert sorted(p.name for p in (run / "msrun_logs").iterdir()) == ["worker_0.log"]
    assert not (run / "mnist").exists()


@pytest.mark.msrun
@pytest.mark.parametrize("ending", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "kill"])
def test_the_demo_on_port_0_prints_the_real_url_and_keeps_the_link_out_of_its_log(tmp_path, procs, ending):
    run = tmp_path / "run"
    demo = subprocess.Popen(
        [sys.executable, "-m", "trainer_bridge.demo", "--dashboard", "--port", "0", "--run-dir", str(run)]
        + ["--epochs", "1", "--samples", "64"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ctrl_c_default,
    )
    procs.append(demo)
    out = Lines(demo)
    url = out.wait_for(r"^rankwatch demo: open (http://127\.0\.0\.1:(\d+)/#login=(\S+))$")
    assert url[2] != "0"
    with urllib.request.urlopen(url[1].split("#")[0] + "api/summary", timeout=30) as r:
        assert r.status == 200
    out.wait_for(r"^rankwatch demo: the job exited with 0")
    log = (run / "dashboard.log").read_text()
    assert f"Rankwatch: open {url[1].split('#')[0]} " in log, log
    assert "#login=" not in log and url[3] not in log, log
    out.wait_for(r"the dashboard stays up; Ctrl-C to quit")
    children = psutil.Process(demo.pid).children(recursive=True)
    assert children  # the dashboard
    sig, status = ending
    demo.send_signal(sig)
    assert demo.wait(WAIT_S) == status
    # Ended with the demo, whichever way it was ended: no dashboard left holding the port.
    _, alive = psutil.wait_procs(children, timeout=WAIT_S)
    assert not alive, alive


# -- 19.10: rank-written text is printed as text ---------------------------------------

EVIL = "\x1b]0;pwned\x07\x1b[2J[link=http://evil.example]x[/link][red]y"


def test_status_prints_escape_sequences_and_markup_from_a_rank_as_text(run_dir):
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2, global_step=40, host=f"h{EVIL}"))
    write_heartbeat(run_dir, heartbeat(1, 2, global_step=12, state="failed", error=f"RuntimeError: {EVIL}"))
    result = CliRunner().invoke(main, ["status", "--run-dir", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output, repr(result.output)
    flat = re.sub(r"\s+", "", result.output)
    # The markup is shown as written, the controls as "?".
    assert "RuntimeError:?]0;pwned??[2J[link=http://evil.example]x[/link][red]y" in flat, result.output
    assert "h?]0;pwned??[2J[link=http://evil.ex" in flat, result.output


def test_checkpoints_prints_a_crafted_job_command_and_set_as_text(run_dir):
    write_job(run_dir, 2, argv=["train.py", "--tag", EVIL])
    save_bridge_set(run_dir, 16)
    result = CliRunner().invoke(main, ["checkpoints", "--run-dir", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\x07" not in result.output, repr(result.output)
    assert "[link=http://evil.example]x[/link][red]y" in result.output, result.output


# -- 21.6: Ctrl-C, --help, --version -------------------------------------------------


def loaded(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_ctrl_c_while_status_watch_loads_ends_it_without_a_traceback(run_dir, procs):
    """SIGINT once the engines are loading (numpy is mapped): before the first frame."""
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, global_step=40))
    proc = cli("status", "--run-dir", str(run_dir), "--watch", "--interval", "0.2")
    procs.append(proc)
    deadline = time.monotonic() + WAIT_S
    while not loaded(proc.pid, "_multiarray_umath"):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=WAIT_S)
    assert proc.returncode in (0, 130) and "Traceback" not in out, out


def test_serve_help_lists_every_setting_under_its_group():
    result = CliRunner().invoke(main, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0 and result.output.startswith("Usage: rankwatch serve [OPTIONS]")
    text = result.output
    titles = list(GROUPS)
    at = [text.index(f"\n{title}:\n") for title in titles]
    assert at == sorted(at), "groups out of order"
    for setting in SETTINGS:
        if not setting.argv:  # a secret: no flag, so that ps never shows it (REDIS_KEY)
            assert setting.flag not in text, setting.name
            continue
        where = text.index(f"  {setting.flag} ")
        assert setting.group in GROUPS, (
            f"{setting.name}'s group {setting.group!r} is not in app.config.GROUPS"
        )
        i = titles.index(setting.group)
        assert at[i] < where < (at[i + 1] if i + 1 < len(at) else len(text)), setting.name
        assert setting.env in text[where : where + 400]


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["-m", "app", "--help"], "Usage: python -m app [OPTIONS]"),
        (["-m", "app.cli", "demo", "--help"], "Usage: rankwatch demo [OPTIONS]"),
        (["-m", "trainer_bridge.demo", "--help"], "Usage: python -m trainer_bridge.demo [OPTIONS]"),
    ],
)
def test_every_entry_point_is_one_click_style(argv, usage):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith(usage), proc
    assert ("Health verdicts:" if argv[1] == "app" else "--ckpt-every N") in proc.stdout


def test_version_and_help_load_neither_the_engines_nor_flask_nor_rich():
    code = (
        "import sys\n"
        "from app.cli import main\n"
        "for argv in (['--version'], ['--help'], ['serve', '--help'], ['status', '--help'], ['login', '--help']):\n"
        "    try:\n"
        "        main(argv, standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = ('flask', 'rich', 'numpy', 'pydantic', 'gunicorn', 'app.run.state', 'app.compose')\n"
        "print('LOADED', sorted(m for m in heavy if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV, capture_output=True, text=True)
    assert proc.returncode == 0, proc
    assert "LOADED []" in proc.stdout, proc.stdout[-500:]


def test_status_shows_the_global_step_and_epoch_step_apart(run_dir):
    write_job(run_dir, 1)
    write_heartbeat(run_dir, heartbeat(0, 1, global_step=1724, steps_per_epoch=100))
    result = CliRunner().invoke(main, ["status", "--run-dir", str(run_dir)], terminal_width=200)
    header = next(ln for ln in result.output.splitlines() if "global step" in ln)
    assert "epoch/step" in header
    row = next(ln for ln in result.output.splitlines() if re.match(r"\s*0\s", ln))
    assert re.search(r"\s1,724\s+18/24\s", row) and "(" not in row.split("1,724")[0], row


# -- 21.2 and 19.16: rankwatch login ------------------------------------------------


def post(url: str, body: dict, token: str | None = None) -> dict:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def test_rankwatch_login_prints_a_short_lived_link_that_works_once(run_dir, tmp_path, procs, monkeypatch):
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    for name in ("RANKWATCH_TOKEN", "RANKWATCH_LOGIN_LINK", "RANKWATCH_LOGIN_TTL_S"):
        monkeypatch.delenv(name, raising=False)
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:  # a log file, as a service's output would be
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "app.cli", "serve", "--run-dir", str(run_dir), "--port", "0"],
                cwd=REPO,
                env={**ENV, **env},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    deadline = time.monotonic() + WAIT_S
    while not (m := re.search(r"^Rankwatch: open (http://127\.0\.0\.1:\d+)/$", log_path.read_text(), re.M)):
        assert procs[0].poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    url = m[1]
    assert "#login=" not in log_path.read_text() and "rankwatch login" in log_path.read_text()

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    result = CliRunner().invoke(main, ["login", "--run-dir", str(run_dir)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    link = result.output.strip()
    assert link.startswith(url + "/#login="), link
    code = link.split("#login=")[1]
    token = post(url + "/api/login", {"code": code})["token"]
    with pytest.raises(urllib.error.HTTPError) as again:
        post(url + "/api/login", {"code": code})
    assert again.value.code == 401
    minted = post(url + "/api/login-code", {}, token)
    assert minted["expires_at"] - time.time() <= 120 + 1  # LOGIN_TTL_S, 2 minutes

    other = CliRunner().invoke(main, ["login", "--run-dir", str(tmp_path)])
    assert other.exit_code == 1 and "0 running dashboard(s)" in other.output


def test_status_gives_the_pages_reason_for_the_same_rank_at_the_same_moment(
    run_dir, tmp_path, monkeypatch, start_server
):
    """The dashboard has judged 20 heartbeats of one step each; a process started now has seen one.

    Its own judgement would say "too few steps yet to compare"; the page says
    the rank is within the straggler ratio. ``status`` prints the page's.
    """
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    write_job(run_dir, 2)
    # No stall while the test reads: the reasons stay what they were when both read them.
    server = start_server(
        run_dir, tmp_path / "dash.log", env={"XDG_RUNTIME_DIR": str(runtime), "RANKWATCH_STALL_MIN_S": "600"}
    )
    for seq in range(1, 21):
        for r in range(2):
            write_heartbeat(run_dir, heartbeat(r, 2, seq=seq, steps=1, global_step=seq, step_ms=200.0))
        deadline = time.monotonic() + WAIT_S
        while True:
            with urllib.request.urlopen(server.url + "/api/ranks", timeout=30) as response:
                page = json.loads(response.read())
            if [row["global_step"] for row in page["ranks"]] == [seq, seq]:
                break
            assert time.monotonic() < deadline, page
            time.sleep(0.05)
    result = CliRunner().invoke(main, ["status", "--run-dir", str(run_dir)], terminal_width=250)
    assert result.exit_code == 0, result.output
    reasons = {row["rank"]: row["reason"] for row in page["ranks"]}
    assert "too few steps" not in reasons[0], reasons
    for rank, reason in reasons.items():
        line = next(ln for ln in result.output.splitlines() if re.match(rf"\s*{rank}\s", ln))
        assert line.rstrip().endswith(reason), (line, reason)
    assert f"as the dashboard at {server.url}/ shows it" in result.output
