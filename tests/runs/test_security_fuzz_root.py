"""Issue 32, "what must be shown": a fuzzer for the runs root.

A real dashboard app on a real ROOT (``RUNS_ROOT``, retention on), its
registry scanning in a thread of its own while this test, as neighbour B,
renames and swaps run directories, puts symlinks to OUT (a run-shaped
directory outside ROOT, with checkpoint sets) or to a sibling run at a
run's name or at its ``rankwatch/`` folder, floods ROOT and run
directories with entries, and removes runs. Between those moves the
operator stops a random name through the API with the token.

It checks, for every stop, that a 202 wrote exactly one flag with that
stop's request id, in the directory that held the run's name when the stop
was made (each run directory carries an identity file), and that a refused
stop wrote no flag at all; and, at the end, that OUT's tree (names, types,
sizes, mtimes, the directories' included) is exactly as it was: nothing
outside ROOT was written, created or deleted.

A seeded loop, ``RANKWATCH_FUZZ_ITERS`` moves (120 by default: a few
seconds); ``RANKWATCH_FUZZ_SEED`` replays one seed. The count is printed.

The race mode (the second test) lets every live run's watcher run its own
loop while the neighbour moves, so that swaps land inside a tick, between its
pin check and its writes: ``RANKWATCH_FUZZ_RACE_ITERS`` moves (24 by default)
for each of ``RANKWATCH_FUZZ_RACE_SEEDS`` (``7``). Before the engines held
their run directory by its descriptor (app/runs/pinned.py), seed 7 wrote
``OUT/rankwatch/audit.sqlite3`` within 30 moves.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import stat
import threading
import uuid

import pytest

from app.errors import RunNotFound
from tests.helpers.app import make_app, operator
from tests.helpers.checkpoints import periodic
from tests.helpers.faults import tree_snapshot
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles

pytestmark = pytest.mark.security

ITERS = int(os.environ.get("RANKWATCH_FUZZ_ITERS", "120"))
SEED = int(os.environ.get("RANKWATCH_FUZZ_SEED", "32"))
RACE_ITERS = int(os.environ.get("RANKWATCH_FUZZ_RACE_ITERS", "24"))
RACE_SEEDS = [int(x) for x in os.environ.get("RANKWATCH_FUZZ_RACE_SEEDS", "7").split(",")]
NAMES = [f"run{i}" for i in range(6)]
IDENT = "fuzz-ident"


def make_run(path, ckpts: bool = False) -> str:
    write_job(path, 2)
    for r in (0, 1):
        write_heartbeat(path, heartbeat(r, 2, seq=3))
    if ckpts:
        for step in (10, 20, 30):
            periodic(path, step)
    ident = uuid.uuid4().hex
    (path / IDENT).write_text(ident)
    return ident


def ident_at(path) -> str | None:
    """The identity of the run directory at ``path``; None for a symlink, a missing name, a non-run."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return None
        fd = os.open(path / IDENT, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        return f.read()


def flags(root) -> list[tuple[str, dict]]:
    """Every flag below ``root`` as (its directory's identity or path, its content), no symlink followed."""
    found = []
    for dirpath, _, filenames in os.walk(root, followlinks=False):
        if runfiles.FLAG_NAME not in filenames:
            continue
        try:
            fd = os.open(os.path.join(dirpath, runfiles.FLAG_NAME), os.O_RDONLY | os.O_NOFOLLOW)
            with os.fdopen(fd) as f:
                flag = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(flag, dict):
            found.append((ident_at(type(root)(dirpath)) or dirpath, flag))
    return found


class Neighbour:
    """Attacker B: moves ROOT's entries around, at random, one move at a time."""

    def __init__(self, root, out, rng: random.Random):
        self.root, self.out, self.rng = root, out, rng
        self.aside = 0

    def free(self) -> str:
        return self.rng.choice([n for n in NAMES if not os.path.lexists(self.root / n)] or NAMES)

    def taken(self) -> str | None:
        names = [n for n in NAMES if os.path.lexists(self.root / n)]
        return self.rng.choice(names) if names else None

    def put_aside(self, name: str) -> None:
        self.aside += 1
        os.rename(self.root / name, self.root / f"aside{self.aside}")

    def move(self) -> str:
        rng, root = self.rng, self.root
        kind = rng.choice(
            ["create", "rename", "swap", "link_out", "link_sibling", "link_inner", "flood", "remove"]
        )
        name = self.taken()
        if kind == "create" or name is None:
            target = self.free()
            if os.path.lexists(root / target):
                self.put_aside(target)
            make_run(root / target, ckpts=rng.random() < 0.3)
            return "create"
        if kind == "rename":
            target = self.free()
            if target != name and not os.path.lexists(root / target):
                os.rename(root / name, root / target)
        elif kind == "swap":
            other = self.taken()
            if other != name:
                os.rename(root / name, root / ".swap")
                os.rename(root / other, root / name)
                os.rename(root / ".swap", root / other)
        elif kind == "link_out":
            self.put_aside(name)
            dest = rng.choice([self.out, self.out / runfiles.STATE_DIR, self.out / "ckpt"])
            os.symlink(dest, root / name, target_is_directory=True)
        elif kind == "link_sibling":
            other = self.taken()
            if other != name:
                self.put_aside(name)
                os.symlink(other, root / name, target_is_directory=True)
        elif kind == "link_inner":
            state = root / name / runfiles.STATE_DIR
            if os.path.isdir(root / name) and not os.path.islink(root / name) and os.path.lexists(state):
                os.rename(state, root / name / f"rankwatch.aside{rng.randrange(10**6)}")
                os.symlink(self.out / runfiles.STATE_DIR, state, target_is_directory=True)
        elif kind == "flood":
            where = rng.choice([root, root / name])
            if os.path.isdir(where) and not os.path.islink(where):
                base = uuid.uuid4().hex[:8]
                for i in range(rng.choice([50, 300, 1500])):
                    if i % 2:
                        (where / f"flood-{base}-{i}").mkdir()
                    else:
                        os.close(os.open(where / f"flood-{base}-{i}", os.O_CREAT | os.O_WRONLY, 0o600))
        elif kind == "remove":
            if os.path.islink(root / name):
                os.unlink(root / name)
            else:
                # Renamed away first: in the race mode a watcher may still be writing into it (its
                # audit trail), and an rmtree racing that write can fail; the name is free anyway.
                self.put_aside(name)
                shutil.rmtree(root / f"aside{self.aside}", ignore_errors=True)
        return kind


def test_runs_root_fuzz_every_stop_lands_in_its_own_run_and_out_is_untouched(tmp_path):
    fuzz(tmp_path, SEED, ITERS, race=False)


@pytest.mark.parametrize("seed", RACE_SEEDS)
def test_runs_root_fuzz_with_watchers_racing_the_moves_writes_nothing_outside_root(tmp_path, seed):
    """The race mode: watchers tick on their own loops, so swaps land between a tick's check and its writes."""
    fuzz(tmp_path, seed, RACE_ITERS, race=True)


def fuzz(tmp_path, seed: int, iters: int, *, race: bool) -> None:
    """Off ``race``: watchers tick between moves, so no move lands inside a tick. On: they run their
    own loops while the neighbour moves (each live run's watcher started by the registry's tick)."""
    root, out = tmp_path / "ROOT", tmp_path / "OUT"
    root.mkdir()
    make_run(out, ckpts=True)
    for step in (40, 50):
        periodic(out, step)
    for name in NAMES[:4]:
        make_run(root / name, ckpts=name == "run0")
    before = tree_snapshot(out)

    app = make_app(None, RUNS_ROOT=str(root), RETENTION_MODE="on", RETENTION_KEEP=1)
    registry = app.extensions["rankwatch_runs"]
    client = app.test_client()
    done = threading.Event()
    scans, scan_errors, ticks, tick_errors = [0], [], [0], {}

    def scan() -> None:
        if race:
            registry.tick()  # and so every live run's watcher runs its own loop
            return
        registry.refresh(max_age=0)
        for run_id in list(registry.discovery.runs):
            try:
                registry.get(run_id, touch=False)  # the pin check and the container's build
            except RunNotFound:
                pass

    def scanner():
        # The registry's scan, without its 5 s sleep: scans race every move.
        while not done.is_set():
            try:
                scan()
                scans[0] += 1
            except Exception as e:  # noqa: BLE001 - a crash of a scan is a finding
                scan_errors.append(repr(e))
            done.wait(0.005)

    def tick_watchers() -> None:
        """Each open run's watcher ticks once (stop completion, re-arm, retention, audit), between moves."""
        for run_id in registry.open_ids():
            rw = registry.peek(run_id)
            if rw is None:
                continue
            try:
                rw.watcher.tick()
                ticks[0] += 1
            except Exception as e:  # noqa: BLE001 - its own loop logs and goes on alike
                tick_errors[type(e).__name__] = tick_errors.get(type(e).__name__, 0) + 1

    thread = threading.Thread(target=scanner, daemon=True)
    thread.start()
    rng = random.Random(seed)
    neighbour = Neighbour(root, out, rng)
    moves, answers = {}, {}
    try:
        for i in range(iters):
            kind = neighbour.move()
            moves[kind] = moves.get(kind, 0) + 1
            name = rng.choice(NAMES)
            own = ident_at(root / name)
            reason = f"fuzz {seed}/{i}"
            r = client.post(f"/api/runs/{name}/exit", json={"reason": reason}, headers=operator())
            answers[r.status_code] = answers.get(r.status_code, 0) + 1
            body = r.get_json()
            assert r.status_code != 500, (i, kind, name, body)
            if r.status_code == 202:
                assert own is not None, (
                    f"move {i} ({kind}): a stop of {name!r}, not a run directory, was accepted"
                )
                landed = [
                    where for where, flag in flags(root) if flag.get("request_id") == body["request_id"]
                ]
                assert landed == [own], (i, kind, name, body)
            else:
                assert not [w for w, flag in flags(root) if flag.get("reason") == reason], (
                    i,
                    kind,
                    name,
                    body,
                )
            assert not os.path.lexists(runfiles.flag_path(out)), f"move {i} ({kind}): a flag in OUT"
            if not race:
                tick_watchers()
    finally:
        done.set()
        thread.join(timeout=60)
        registry.stop()
    print(
        f"runs-root fuzz: seed {seed}, {iters} moves {moves}, stops answered {answers}, "
        f"{scans[0]} scans, {ticks[0]} watcher ticks (refused: {tick_errors}), race mode {race}"
    )
    assert not scan_errors, scan_errors[:3]
    assert answers.get(202, 0) > 0, "no stop landed: the fuzzer tested nothing"
    after = tree_snapshot(out)
    changed = {
        "removed": sorted(set(before) - set(after)),
        "added": sorted(set(after) - set(before)),
        "changed": sorted(k for k in set(before) & set(after) if before[k] != after[k]),
    }
    assert after == before, f"seed {seed}: OUT was written outside ROOT: {changed}"
