"""Soak benchmark: a big simulated job for minutes, ranks dying and reviving, memory and losses.

``.venv/bin/python -m tests.bench.soak [--ranks 1024] [--minutes 10]``

It starts the heartbeat simulator with churn (``tests.bench.simulate
--churn-every``: one rank dies every ``--churn-every`` seconds, job-wide, and
revives ``--down-s`` later as a restarted process), a real dashboard with its
default settings and one headless Chromium on the page, then:

* samples the dashboard process's RSS every ``--sample-s`` seconds and
  prints the memory curve as a table per minute (min / max / last RSS), with
  the verdict counts the dashboard reported, so the churn shows;
* at the end stops the simulator, waits (polling) for the dashboard to
  settle, and checks that no message was lost: for every rank, the newest
  heartbeat on disk (its ``seq`` and ``state``) is what ``GET /api/ranks``
  shows and what the page holds.

Exit status 0 when nothing was lost and the page logged no error. Memory is
reported, not judged: chart history is bounded (``HISTORY_POINTS`` per rank),
so the curve should flatten once it is full (five minutes by default).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import sync_playwright

from tests.bench.scale import wait_for_file
from tests.helpers.liveserver import REPO, launch_chromium, rank_rows, start_dashboard
from trainer_bridge.rundir import runfiles

MIB = 1024 * 1024


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


def on_disk(run_dir: Path, ranks: int) -> dict[int, tuple]:
    """Each rank's newest heartbeat on disk, as (seq, state)."""
    out = {}
    for r in range(ranks):
        hb = runfiles.read_json_or_none(runfiles.heartbeat_path(run_dir, r)) or {}
        out[r] = (hb.get("seq"), hb.get("state"))
    return out


def shown_by_api(url: str) -> dict[int, tuple]:
    return {row["rank"]: (row["seq"], row["state"]) for row in rank_rows(url)}


def shown_by_page(page) -> dict[int, tuple]:
    rows = page.evaluate("[...window.rankwatch.store.rows.values()].map(r => [r.rank, r.seq, r.state])")
    return {rank: (seq, state) for rank, seq, state in rows}


def mismatches(disk: dict, shown: dict) -> list[tuple]:
    return [(r, disk[r], shown.get(r)) for r in sorted(disk) if shown.get(r) != disk[r]]


def settle(check, timeout: float = 60.0, poll: float = 0.5):
    """Poll ``check()`` (a list of mismatches) until empty or ``timeout``; return the last."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(poll)


def print_curve(samples: list[dict]) -> None:
    print(
        f"\n{'minute':>6} {'samples':>7} {'RSS min MiB':>11} {'RSS max MiB':>11} {'RSS last MiB':>12} "
        f"{'CPU %':>6}  verdicts at the minute's end"
    )
    by_minute: dict[int, list[dict]] = {}
    for s in samples:
        by_minute.setdefault(int(s["t"] // 60), []).append(s)
    for minute, group in sorted(by_minute.items()):
        rss = [s["rss"] / MIB for s in group]
        counts = {k: v for k, v in group[-1]["counts"].items() if v}
        cpu = sum(s["cpu"] for s in group) / len(group)
        print(
            f"{minute + 1:>6} {len(group):>7} {min(rss):>11.1f} {max(rss):>11.1f} {rss[-1]:>12.1f} "
            f"{cpu:>6.1f}  {counts}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    parser.add_argument(
        "--churn-every", type=float, default=20.0, help="one rank dies every this many seconds, job-wide"
    )
    parser.add_argument(
        "--down-s", type=float, default=40.0, help="how long a dead rank stays down before it revives"
    )
    parser.add_argument(
        "--history-points",
        type=int,
        default=None,
        help="the dashboard's HISTORY_POINTS (default: its default, 300): chart "
        "history, and so RSS, grows until this many seconds have passed",
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="rankwatch-soak-") as tmp, sync_playwright() as pw:
        workdir = Path(tmp)
        run_dir = workdir / "run"
        sim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.bench.simulate",
                "--run-dir",
                str(run_dir),
                "--ranks",
                str(args.ranks),
                "--churn-every",
                str(args.churn_every),
                "--down-s",
                str(args.down_s),
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        server = browser = None
        errors: list[str] = []
        samples: list[dict] = []
        try:
            wait_for_file(runfiles.job_path(run_dir), sim)
            env = {"RANKWATCH_HISTORY_POINTS": str(args.history_points)} if args.history_points else None
            server = start_dashboard(run_dir, workdir / "dashboard.log", env=env)
            browser = launch_chromium(pw)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server.url + "/")
            page.wait_for_function(
                "n => window.rankwatch && window.rankwatch.store.rows.size >= n",
                arg=args.ranks,
                timeout=120_000,
            )
            print(
                f"soak: {args.ranks} ranks for {args.minutes:g} min, one rank dies every "
                f"{args.churn_every:g} s for {args.down_s:g} s; RSS every {args.sample_s:g} s",
                flush=True,
            )
            start = time.monotonic()
            # The server's processes (gunicorn's arbiter and worker) together.
            cpu_mark = (start, server.cpu_seconds())
            end = start + args.minutes * 60
            while time.monotonic() < end:
                if server.proc.poll() is not None:
                    raise RuntimeError(f"the dashboard exited:\n{server.log()[-3000:]}")
                if sim.poll() is not None:
                    raise RuntimeError(f"the simulator exited with {sim.returncode}")
                summary = get(server.url + "/api/summary")["summary"]
                now, cpu = time.monotonic(), server.cpu_seconds()
                cpu_percent = 100.0 * (cpu - cpu_mark[1]) / max(1e-6, now - cpu_mark[0])
                cpu_mark = (now, cpu)
                samples.append(
                    {
                        "t": now - start,
                        "rss": server.rss_bytes(),
                        "cpu": cpu_percent,
                        "counts": summary["counts"],
                    }
                )
                time.sleep(max(0.0, min(args.sample_s, end - time.monotonic())))

            # Stop writing, then check that the last word of every rank arrived.
            sim.send_signal(signal.SIGTERM)
            sim.wait(60)
            disk = on_disk(run_dir, args.ranks)
            api_lost = settle(lambda: mismatches(disk, shown_by_api(server.url)))
            page_lost = settle(lambda: mismatches(disk, shown_by_page(page)))
            final_rss = server.rss_bytes()
        finally:
            if browser is not None:
                browser.close()
            if server is not None:
                server.stop()
            if sim.poll() is None:
                sim.kill()
                sim.wait()

    print_curve(samples)
    rss = [s["rss"] for s in samples]
    print(
        f"\nRSS: first {rss[0] / MIB:.1f} MiB, peak {max(rss) / MIB:.1f} MiB, final {final_rss / MIB:.1f} MiB"
    )
    # Chart history (HISTORY_POINTS one-second buckets per rank) fills for that
    # many seconds; after it, RSS should stay flat.
    full_s = (args.history_points or 300) * 1.0 + 30
    steady = [s["rss"] for s in samples if s["t"] >= full_s]
    if len(steady) >= 2:
        print(
            f"after the chart history filled ({full_s:.0f} s): {min(steady) / MIB:.1f}.."
            f"{max(steady) / MIB:.1f} MiB, change {(steady[-1] - steady[0]) / MIB:+.1f} MiB over "
            f"{(len(steady) - 1) * args.sample_s:.0f} s"
        )
    else:
        print(f"the run ended before the chart history filled ({full_s:.0f} s): RSS grows until then")
    dead_seen = max(s["counts"].get("dead", 0) for s in samples)
    stalled_seen = max(s["counts"].get("stalled", 0) for s in samples)
    print(f"churn seen by the dashboard: up to {dead_seen} dead and {stalled_seen} stalled at once")
    print(
        f"last heartbeat of every rank (seq, state): API {args.ranks - len(api_lost)}/{args.ranks} "
        f"match, page {args.ranks - len(page_lost)}/{args.ranks} match"
    )
    for r, want, got in (api_lost + page_lost)[:10]:
        print(f"  rank {r}: on disk {want}, shown {got}")
    for error in errors[:10]:
        print(f"console error: {error}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    ok = not api_lost and not page_lost and not errors
    print("no message lost" if ok else "LOST MESSAGES OR PAGE ERRORS")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
