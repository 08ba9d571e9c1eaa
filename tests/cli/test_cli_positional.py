"""Issue 33, section 6: the run directory positionally, wherever ``--run-dir`` is taken.

``rankwatch status runs/demo`` was refused while ``rankwatch runs ROOT`` was
accepted. Every command that takes ``--run-dir RUN`` now takes ``RUN`` too,
checked the same way.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job

# Each command's arguments besides the run directory, and whether it reads the run (checks it exists).
READERS = [
    ["status"],
    ["checkpoints", "--json"],
    ["checkpoints", "gc", "--json"],
    ["stop", "--reason", "x", "--no-wait"],
]


def scrub(value):
    if isinstance(value, dict):
        return {
            k: scrub(v)
            for k, v in value.items()
            if k not in ("scanned_at", "now", "generated_at", "free_bytes")
        }
    return [scrub(v) for v in value] if isinstance(value, list) else value


def invoke(args: list[str]):
    return CliRunner().invoke(main, args, terminal_width=200, env={"RANKWATCH_RUN_DIR": None})


@pytest.mark.parametrize("command", READERS)
def test_run_is_taken_positionally_as_with_run_dir(run_dir, command):
    write_job(run_dir, 2)
    for r in range(2):
        write_heartbeat(run_dir, heartbeat(r, 2, global_step=7))
    positional = invoke([*command, str(run_dir)])
    assert positional.exit_code == 0, positional.output
    if command[0] == "stop":
        return  # the flag is written once; the option form is the other tests' (tests/cli/test_cli.py)
    with_option = invoke([*command, "--run-dir", str(run_dir)])
    assert with_option.exit_code == 0, with_option.output
    if "--json" in command:
        # The same run read twice: all but when it was scanned and the free space on a shared disk.
        assert scrub(json.loads(positional.output)) == scrub(json.loads(with_option.output))
    else:
        for out in (positional.output, with_option.output):
            assert "world size 2" in out and "healthy 2" in out, out


@pytest.mark.parametrize("command", READERS)
def test_a_mistyped_run_is_one_clear_error(tmp_path, command):
    typo = tmp_path / "runs" / "dmeo"
    result = invoke([*command, str(typo)])
    assert result.exit_code == 2, result.output
    assert f"{typo} does not exist" in result.output


@pytest.mark.parametrize("command", [["status"], ["stop", "--reason", "x"]])
def test_two_different_run_directories_are_refused(tmp_path, command):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    result = invoke([*command, str(a), "--run-dir", str(b)])
    assert result.exit_code == 2 and "two run directories" in result.output, result.output


@pytest.mark.parametrize("command", ["status", "stop", "checkpoints", "login", "agent", "serve"])
def test_every_usage_line_names_run(command):
    result = invoke([command, "--help"])
    assert result.exit_code == 0, result.output
    assert "[RUN]" in result.output.splitlines()[0], result.output


def test_no_run_directory_at_all_says_both_ways(tmp_path):
    result = invoke(["stop", "--reason", "x"])
    assert result.exit_code == 2 and "give RUN, or --run-dir RUN" in result.output, result.output


def test_login_finds_a_runs_dashboard_by_its_root_or_a_run_under_it(tmp_path, start_server, monkeypatch):
    """`rankwatch login --run-dir ROOT` for a --runs dashboard said "0 running dashboard(s) ... match"."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    root = tmp_path / "root"
    write_job(root / "a", 1)
    write_heartbeat(root / "a", heartbeat(0, 1))
    server = start_server(
        root, tmp_path / "dashboard.log", env={"XDG_RUNTIME_DIR": str(runtime)}, runs_root=True
    )
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    for where in (root, root / "a"):
        for args in (["login", str(where)], ["login", "--run-dir", str(where)]):
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
            assert result.output.strip().startswith(server.url + "/#login="), result.output
    elsewhere = CliRunner().invoke(main, ["login", str(tmp_path)])
    assert elsewhere.exit_code == 1 and "0 running dashboard(s)" in elsewhere.output
