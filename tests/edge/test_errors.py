"""Issue 16: the domain's refusals are one family, and request bodies are parsed by pydantic.

A refusal is a ``RankwatchError`` subclass with its status on the class; the
edge answers every one in the one shape, and the CLI catches the family, so
a trail that cannot be written is a 503 or a one-line CLI error, never a 500
or a traceback. A body's nesting is bounded by pydantic's parser, not by
Python's recursion limit (which MindSpore raises in a process that imports it).
"""

from __future__ import annotations

import os
import sys
import time

import pytest
from click.testing import CliRunner

from app import errors
from app.cli import main
from tests.helpers import ckptcraft
from tests.helpers.app import AUTH, make_app
from tests.helpers.heartbeats import write_job
from trainer_bridge.rundir import runfiles

OLD = time.time() - 3600  # older than any settle time


def periodic_set(run_dir, step: int) -> str:
    """A complete two-rank periodic set at ``step``; its id."""
    for r in (0, 1):
        body = ckptcraft.ckpt(
            ckptcraft.entry("w", ckptcraft.tensor([4], "Float32", b"\0" * 16)), global_step=step
        )
        path = ckptcraft.write(run_dir / f"ckpt/rank_{r}/net-1_{step}.ckpt", body)
        os.utime(path, (OLD, OLD))
    return f"ckpt/rank_{{rank}}/net-{{E}}_{{S}}.ckpt#g{step}"


def corrupt_trail(run_dir) -> None:
    (runfiles.state_dir(run_dir) / "audit.sqlite3").write_bytes(b"this is not an SQLite database" * 100)


@pytest.fixture
def api(run_dir):
    write_job(run_dir, 2)
    # Room for a 100,000-deep body (200 kB), so that the parser, not the size limit, refuses it.
    app = make_app(run_dir, MAX_BODY_BYTES=1 << 20)
    yield app.test_client()
    app.extensions["rankwatch"].watcher.stop()


@pytest.fixture
def deep_recursion_limit():
    """Python's recursion limit as MindSpore leaves it: high enough for json.loads to parse deep lists."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    yield
    sys.setrecursionlimit(old)


def test_a_trail_that_cannot_be_written_is_a_503_not_a_500(api, run_dir):
    """Pinning audits the change: with a corrupt trail the answer says so in the one shape."""
    set_id = periodic_set(run_dir, 10)
    corrupt_trail(run_dir)
    r = api.post("/api/checkpoints/pin", json={"set": set_id, "pinned": True}, headers=AUTH)
    assert r.status_code == 503, r.get_data()[:300]
    body = r.get_json()
    assert set(body) == {"error", "status"} and body["status"] == 503
    assert "audit trail" in body["error"]


def test_the_cli_reports_a_refusal_in_one_line(run_dir):
    """``checkpoints gc --apply`` catches the domain family: the trail's error, not a traceback."""
    write_job(run_dir, 2)
    for step in (10, 20):
        periodic_set(run_dir, step)
    corrupt_trail(run_dir)
    out = CliRunner().invoke(main, ["checkpoints", "gc", "--run-dir", str(run_dir), "--keep", "1", "--apply"])
    assert out.exit_code == 1 and isinstance(out.exception, SystemExit), out.output
    assert "audit trail" in out.output and "Traceback" not in out.output


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_bodies_are_refused_by_the_parser_whatever_the_recursion_limit(
    api, run_dir, deep_recursion_limit, depth
):
    """Before, a raised recursion limit let ``[`` x 5,000 parse; now no body nests past pydantic's bound."""
    for data in (b"[" * depth + b"]" * depth, b'{"reason": ' + b"[" * depth + b"]" * depth + b"}"):
        r = api.post("/api/exit", data=data, headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 400, r.get_data()[:200]
        assert r.get_json() == {"error": "the body is not valid JSON: nested too deeply", "status": 400}
    assert not runfiles.flag_path(run_dir).exists()


def refusals() -> list[type[errors.RankwatchError]]:
    found, todo = [], [errors.RankwatchError]
    while todo:
        cls = todo.pop()
        found += cls.__subclasses__()
        todo += cls.__subclasses__()
    return found


@pytest.mark.parametrize("cls", refusals(), ids=lambda cls: cls.__name__)
def test_every_refusal_is_answered_in_the_one_shape_with_its_status(api, cls):
    app = api.application
    if cls in (errors.Busy, errors.Throttled):
        exc = cls("wait", 2.5)
    elif cls is errors.RankNotFound:
        exc = cls(7)
    elif cls in (errors.SetNotFound, errors.NoRunDir):
        exc = cls("s#g1") if cls is errors.SetNotFound else cls()
    else:
        exc = cls("refused")
    assert 400 <= cls.status < 600
    with app.test_request_context("/api/anything"):
        response, status, headers = errors.handle_exception(exc)
    assert status == cls.status and response.get_json() == {"error": exc.message, "status": cls.status}
    assert ("Retry-After" in headers) == (exc.retry_after_s is not None)
    if exc.retry_after_s is not None:
        assert headers["Retry-After"] == "3"
