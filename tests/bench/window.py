"""Window benchmark: what one Chromium page of a 100,000-rank job receives, and how soon.

``.venv/bin/python -m tests.bench.window [--hosts 12500] [--seconds 30] [--warmup 20]``

The agents benchmark's simulator (``tests/bench/hostsim.py``, ``--workers``
niced processes) plays ``--hosts`` agents of 8 ranks, one signed digest a
second each, into a local ``redis-server`` (by default built before the
window and written as raw RESP during it, ``--sender prebuilt``); a real dashboard
(``python -m app`` with ``RANKWATCH_AGENTS``) reads them, so the page runs
windowed (``app/ranks/window.py``: ``PAGE_WINDOW_RANKS`` is 4,096). Some hosts
flip their first rank between ``healthy`` and ``straggler`` every
``--flip-every`` digests, half of them inside the page's window (ranks
0-99), half outside; the simulator records when it wrote each flip's digest.

A headless Chromium opens the ranks page. Over ``--seconds`` after the
warm-up it counts the bytes of every Socket.IO frame the page receives
(Playwright's ``framereceived``), and the page itself stamps each row of a
``ranks_delta`` that carries a verdict (``Date.now()``, the machine's clock,
as the simulator's). The latency of a flip inside the window is from its
digest being written to Redis to the page receiving that verdict for that
rank. The dashboard's CPU (cores) and RSS over the window are printed too.

Targets (issue 20): at most 50 KB/s to each browser; p95 from a rank's
verdict change to the browser at most 3 s.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.bench.agents import host_seq_sum, simulator_line, start_hub
from tests.bench.hostsim import RANKS_PER_HOST, SENDERS, Simulators
from tests.bench.ingest import start_redis
from tests.helpers.liveserver import launch_chromium

# Stamps each verdict a ranks_delta brings: [rank, verdict, seconds since the epoch].
STAMP = """() => {
  window.benchVerdicts = [];
  window.rankwatch.socket.on("ranks_delta", (msg) => {
    const at = Date.now() / 1000;
    for (const row of msg.rows || []) if (row.health) window.benchVerdicts.push([row.rank, row.health, at]);
  });
}"""


def p95(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=20)[-1]
        if len(values) >= 2
        else (values[0] if values else float("nan"))
    )


def drain(q) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def run(
    hosts: int,
    seconds: float,
    warmup: float,
    workers: int,
    flip_every: int,
    flip_hosts: int,
    workdir: Path,
    url: str,
    sender: str = "prebuilt",
) -> dict:
    from playwright.sync_api import sync_playwright

    server = start_hub(workdir, url)
    # Inside the first window (ranks 0-99: hosts 0-12) and as many far outside it.
    inside = list(range(min(flip_hosts // 2, 12, hosts)))
    outside = [hosts - 1 - i * 7 for i in range(flip_hosts - len(inside)) if hosts - 1 - i * 7 > 12]
    flips = multiprocessing.Queue()
    # Digests for the page's start, the warm-up, the window and its last flips' arrival.
    sims = Simulators.start(
        sender,
        hosts,
        workers,
        url,
        horizon=warmup + seconds + 40,
        flips=(frozenset(inside + outside), flip_every, flips),
    )
    frames: list[tuple[float, int]] = []
    made = []
    try:
        began = sims.sending()
        with sync_playwright() as pw:
            browser = launch_chromium(pw)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on(
                "websocket",
                lambda ws: ws.on(
                    "framereceived",
                    lambda payload: frames.append(
                        (time.time(), len(payload.encode() if isinstance(payload, str) else payload))
                    ),
                ),
            )
            page.goto(server.url + "/")
            page.wait_for_function("() => window.rankwatch && window.rankwatch.store.window", timeout=120_000)
            page.evaluate(STAMP)
            # Playwright's sync API hands over the frame events only while it is called: wait inside it.
            page.wait_for_timeout(warmup * 1000)
            seq0, _ = host_seq_sum(server.url)
            cpu0, t0 = server.cpu_seconds(), time.time()
            drain(flips)  # flips added before the window are not measured
            page.wait_for_timeout(seconds * 1000)
            cpu1, t1 = server.cpu_seconds(), time.time()
            seq1, heard = host_seq_sum(server.url)
            rss = server.rss_bytes()
            # Let the last flips of the window arrive before reading the page's stamps.
            page.wait_for_timeout(5000)
            made = drain(flips)  # before the senders end: a full queue would keep them from exiting
            stamps = page.evaluate("() => window.benchVerdicts")
            window = page.evaluate("() => window.rankwatch.store.window")
            info = page.locator("#page-info").text_content()
            browser.close()
    finally:
        ran = sims.end(server)
    made = [f for f in made if t0 <= f[2] <= t1]
    shown = {}
    for rank, verdict, at in stamps:
        shown.setdefault((rank, verdict), []).append(at)
    first, last = window["page"], window["per_page"]
    in_window = [f for f in made if (first - 1) * last <= f[0] < first * last]
    latencies, missed = [], 0
    for rank, verdict, at in in_window:
        later = [s for s in shown.get((rank, verdict), ()) if s >= at - 0.05]
        if later:
            latencies.append(max(0.0, min(later) - at))
        else:
            missed += 1
    # The rows that reached the page of the ranks flipped far outside its window (hosts at the job's end).
    far = {f[0] for f in made} - {f[0] for f in in_window}
    outside_rows = sum(1 for rank, _, _ in stamps if rank in far)
    got = sum(n for at, n in frames if t0 <= at <= t1)
    return {
        "hosts": hosts,
        "heard": heard,
        "ranks": hosts * RANKS_PER_HOST,
        "digests_per_s": (seq1 - seq0) / (t1 - t0),
        "cores": (cpu1 - cpu0) / (t1 - t0),
        "rss_mb": rss / 2**20,
        "sender": sender,
        "built_late_s": began["built_late_s"],
        **ran,
        "bytes_per_s": got / (t1 - t0),
        "frames": sum(1 for at, _ in frames if t0 <= at <= t1),
        "flips_in_window": len(in_window),
        "flips_outside": len(made) - len(in_window),
        "missed": missed,
        "outside_rows": outside_rows,
        "p50_s": statistics.median(latencies) if latencies else float("nan"),
        "p95_s": p95(latencies),
        "max_s": max(latencies, default=float("nan")),
        "info": info,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.window", description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=12_500)
    parser.add_argument("--workers", type=int, default=2, help="simulator processes")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument(
        "--flip-every", type=int, default=3, help="digests between two flips of a flipping host"
    )
    parser.add_argument("--flip-hosts", type=int, default=12, help="hosts that flip, half inside the window")
    parser.add_argument(
        "--sender",
        choices=sorted(SENDERS),
        default="prebuilt",
        help="digests built before the window and written as raw RESP, or built live",
    )
    args = parser.parse_args(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(prefix="rankwatch-window-") as tmp:
        workdir = Path(tmp)
        redis_proc, url = start_redis(workdir)
        try:
            r = run(
                args.hosts,
                args.seconds,
                args.warmup,
                args.workers,
                args.flip_every,
                args.flip_hosts,
                workdir,
                url,
                args.sender,
            )
        finally:
            redis_proc.terminate()
            redis_proc.wait()
    print(
        f"window: {r['ranks']} ranks on {r['hosts']} hosts ({r['heard']} heard), {r['digests_per_s']:.0f} digests/s; "
        f"page: {r['info']!r}"
    )
    print(f"hub: {r['cores']:.3f} cores, RSS {r['rss_mb']:.0f} MB")
    print(simulator_line(r))
    print(f"to the page: {r['bytes_per_s'] / 1000:.1f} KB/s in {r['frames']} frames")
    print(
        f"verdict flips: {r['flips_in_window']} in the window, {r['flips_outside']} outside "
        f"({r['outside_rows']} rows of ranks outside reached the page); {r['missed']} in-window flips not seen; "
        f"latency p50 {r['p50_s']:.2f} s, p95 {r['p95_s']:.2f} s, max {r['max_s']:.2f} s"
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
