"""Issue 13, item 7: check-then-use races with symlinks, reproduced with ``renameat2``.

A thread swaps a checkpoint's rank directory with a symlink to a directory
outside the run directory (``RENAME_EXCHANGE``: both names always exist, so
every check sees a plausible path) as fast as it can, while the dashboard
downloads, deletes and verifies. Before the fix a download served the
outside file (263 of 15,861 tries), a delete removed an outside ``*.ckpt``,
and verify loaded an outside file.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ckptcraft
from tests.helpers.app import AUTH, make_app
from tests.helpers.checkpoints import periodic
from tests.helpers.heartbeats import write_job

TRIES = 3000
SECRET = b"outside the run directory: never served"

_libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_EXCHANGE = 2


def exchange(a: Path, b: Path) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


SWAP_LOOP = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
a, b = os.fsencode(sys.argv[1]), os.fsencode(sys.argv[2])
rename = libc.renameat2
print("ready", flush=True)
while True:
    rename(-100, a, -100, b, 2)
"""


class Swapper:
    """Swaps ``real`` (a directory) and a symlink to ``outside`` as fast as it can, until stopped.

    In a process of its own: a thread would share the test's GIL, and never
    run between a check and the use that follows it.
    """

    def __init__(self, real: Path, outside: Path):
        self.real, self.link = real, real.with_name(real.name + ".swap")
        self.link.symlink_to(outside, target_is_directory=True)
        self.proc = None

    def __enter__(self):
        exchange(self.real, self.link)  # fails here, not in the loop, if unsupported
        exchange(self.real, self.link)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SWAP_LOOP, str(self.real), str(self.link)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        if self.real.is_symlink():  # leave the real directory in place
            exchange(self.real, self.link)


@pytest.fixture
def layout(run_dir, tmp_path):
    """RUN/checkpoints/rank_0/rankwatch-1_8.ckpt (listed) and the same name outside RUN."""
    write_job(run_dir, 1)
    inside = ckptcraft.write(run_dir / "checkpoints/rank_0/rankwatch-1_8.ckpt", ckptcraft.ckpt(global_step=8))
    outside_dir = tmp_path / "outside" / "rank_0"
    outside = ckptcraft.write(outside_dir / "rankwatch-1_8.ckpt", SECRET)
    return inside, outside


@pytest.fixture
def app(run_dir):
    app = make_app(run_dir, OPERATOR_WRITES_PER_MIN=10**6)
    yield app
    app.extensions["rankwatch"].watcher.stop()


def test_a_download_never_serves_a_file_outside_the_run_directory(app, layout):
    inside, outside = layout
    client = app.test_client()
    rel = "checkpoints/rank_0/rankwatch-1_8.ckpt"
    assert client.get("/api/checkpoints/file", query_string={"path": rel}).status_code == 200
    served = leaked = 0
    with Swapper(inside.parent, outside.parent):
        for _ in range(TRIES):
            r = client.get("/api/checkpoints/file", query_string={"path": rel})
            assert r.status_code < 500, r.get_data()[:300]
            if r.status_code == 200:
                served += 1
                leaked += r.get_data() == SECRET
    assert leaked == 0, f"served the outside file {leaked} of {served} times"
    assert served > 0


def recreate_inside(run_dir: Path) -> None:
    """Put the inside file back, never through the symlink (the test must not write outside)."""
    try:
        fd = os.open(run_dir / "checkpoints/rank_0", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # swapped right now: try next round
    try:
        f = os.open("rankwatch-1_8.ckpt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=fd)
        os.write(f, ckptcraft.ckpt(global_step=8))
        os.close(f)
    finally:
        os.close(fd)


def test_a_delete_never_removes_a_file_outside_the_run_directory(app, layout, run_dir):
    inside, outside = layout
    client = app.test_client()
    set_id = "checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt#g8"
    # Through the API once (the index is taken before the race starts)...
    service = app.extensions["rankwatch"].checkpoints
    _, cset = service.find(set_id, 1)
    deleted = 0
    with Swapper(inside.parent, outside.parent):
        # ...then the removal itself, as often as the swap can be lost.
        for _ in range(3 * TRIES):
            recreate_inside(run_dir)
            done, failed, _ = service.remove_set(cset)
            deleted += len(done)
            assert outside.exists(), f"a delete removed the file outside the run directory (after {deleted})"
    assert deleted > 0
    r = client.post(
        "/api/checkpoints/delete", json={"set": set_id, "reason": "r", "force": True}, headers=AUTH
    )
    assert r.status_code in (200, 404), r.get_data()[:300]


def test_verify_never_loads_a_file_outside_the_run_directory(app, layout, run_dir):
    """The outside file is a valid checkpoint with more entries, so a load of it would show."""
    from app.checkpoints.verify import Verifier

    inside, outside = layout
    ckptcraft.write(
        inside,
        ckptcraft.ckpt(ckptcraft.entry("w", ckptcraft.tensor([1], "Float32", b"\0" * 4)), global_step=8),
    )
    outside.write_bytes(
        ckptcraft.ckpt(
            *[ckptcraft.entry(f"o{i}", ckptcraft.tensor([1], "Float32", b"\0" * 4)) for i in range(5)]
        )
    )
    service = app.extensions["rankwatch"].checkpoints
    _, cset = service.find("checkpoints/rank_{rank}/rankwatch-{E}_{S}.ckpt#g8", 1, force=True)
    events = []
    verifier = Verifier(lambda fn, *args: fn(*args), lambda name, payload: events.append(payload))
    loaded, refused = [], 0
    with Swapper(inside.parent, outside.parent):
        # Rounds until some load went through between two swaps (on a loaded
        # machine the swapper can win a whole round); bounded, never timed.
        for n in range(50):
            verifier.start(f"race{n}", list(cset.files) * 300, str(run_dir))
            files = verifier.status(f"race{n}")["files"]
            loaded += [f["params"] for f in files if f["ok"]]
            refused += sum(1 for f in files if not f["ok"])
            if loaded and refused:
                break
    assert loaded and set(loaded) == {2}, sorted(set(loaded))  # w and global_step; never o0..o4


def test_retention_never_removes_anything_outside_the_run_directory(run_dir, tmp_path):
    """Issue 18, invariant 5: the retention deleter's walk of a leftover temp dir, raced."""
    from app.audit import AuditLog
    from app.checkpoints.retention import Retention
    from app.checkpoints.service import CheckpointService
    from app.checkpoints.verify import Verifier

    write_job(run_dir, 1)
    periodic(run_dir, 10, ranks=(0,))  # a checkpoint series in ckpt/: where its leftovers are looked for
    tmpdir = run_dir / "ckpt/tft_saved_checkpoints-step_5_tmp"
    real = tmpdir / "rank_0"
    outside_dir = tmp_path / "outside" / "rank_0"
    outside = ckptcraft.write(outside_dir / "ttp_rank_0-1_5.ckpt", SECRET)
    service = CheckpointService(
        str(run_dir), AuditLog(tmp_path / "audit.sqlite3"), scan_s=0.0, verifier=Verifier(None, None)
    )
    # The swapper's renames touch the leftover's mtime all the time: plan as if long after.
    retention = Retention(service, {"RETENTION_TMP_AGE_S": 60.0}, clock=lambda: time.time() + 3600)

    def recreate(link: bool = True) -> None:
        """The leftover again, with its rank dir and the swapper's link; never through a symlink."""
        for make in (
            lambda: real.mkdir(parents=True),
            lambda: link and real.with_name("rank_0.swap").symlink_to(outside_dir, target_is_directory=True),
        ):
            try:
                make()
            except OSError:
                pass
        try:
            fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return
        try:
            f = os.open("ttp_rank_0-1_5.ckpt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600, dir_fd=fd)
            os.close(f)
        finally:
            os.close(fd)
        os.utime(tmpdir, (1, 1))

    recreate(link=False)
    removed = 0
    with Swapper(real, outside_dir):
        for _ in range(TRIES // 15):
            recreate()
            result = retention.apply(None, 1, {}, who="test")
            removed += len(result["deleted"])
            assert outside.exists(), f"retention removed the file outside the run directory (after {removed})"
            assert outside_dir.is_dir() and not outside_dir.is_symlink()
    assert removed > 0
