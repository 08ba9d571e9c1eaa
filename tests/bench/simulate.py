"""A fake job: N ranks writing heartbeats in the bridge's format, without MindSpore.

``python -m tests.bench.simulate --run-dir RUN --ranks N [--seconds S]``

Each rank writes its heartbeat (and history line) once per period, at its
own offset within the period, as real ranks do: rank r of N at r/N of the
second. Used by the scale benchmark and by the browser tests, which can
``silence`` a rank to watch it turn stalled, then dead.

Creating a file costs the kernel about half a millisecond here, so one
process cannot write 1024 heartbeats a second on a busy machine; large jobs
are split over ``--workers`` processes (real ranks are separate processes too).

``--redis URL`` publishes the heartbeats to Redis instead, as the bridge
does with ``RANKWATCH_REDIS_URL`` (``trainer_bridge/rundir/redisbus.py``): every
heartbeat due at one moment goes out in one pipeline, so one process can
simulate 16,384 ranks; heartbeat files are then written once every
``--file-every`` seconds, like the bridge's lower rate.

``--hang-after S`` makes every rank hang together S seconds in: they keep
writing heartbeats but finish no step, as ranks blocked in one collective
do (the incidents benchmark's job-wide stall).

``--churn-every S`` makes ranks die and revive, as crashed ranks restarted by
a supervisor do: every S seconds (job-wide) one rank goes silent for
``--down-s`` seconds (long enough by default for the dashboard to call it
dead), then comes back as a restarted process: ``seq`` from 1 again, a new
``started_at``, its global step where it left off.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import signal
import threading
import time
from pathlib import Path

from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.rundir import runfiles


class Simulator:
    def __init__(
        self,
        run_dir: str | Path,
        ranks: int,
        *,
        period_s: float = 1.0,
        step_ms: float = 50.0,
        slow: dict[int, float] | None = None,
        jitter: float = 0.05,
        seed: int = 0,
        only: range | None = None,
        churn_every: float = 0.0,
        down_s: float = 40.0,
        redis_url: str | None = None,
        file_every: float = 10.0,
        hang_after: float | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.redis = None
        if redis_url:
            from trainer_bridge.rundir import redisbus

            self.redis = redisbus.connect(redis_url)
            self.stream, self.latest, _ = redisbus.keys(redisbus.job_key(self.run_dir))
            self.maxlen = max(redisbus.STREAM_MIN, redisbus.STREAM_PER_RANK * ranks)
        self.file_every = file_every
        self._filed: dict[int, float] = {}
        self.ranks = ranks
        # The ranks this simulator writes (a worker's share of the job).
        self.mine = list(only if only is not None else range(ranks))
        self.period_s = period_s
        self.step_ms = step_ms
        self.slow = dict(slow or {})
        self.jitter = jitter
        self.random = random.Random(seed)
        self.seq = [0] * ranks
        self.gstep = [0] * ranks
        self.silenced: set[int] = set()
        # Churn: every churn_every seconds one of this simulator's ranks goes
        # down for down_s seconds (rank -> when it revives), then restarts.
        self.churn_every = churn_every
        self.down_s = down_s
        self.down: dict[int, float] = {}
        self.started: dict[int, float] = {}  # a revived rank's new started_at
        self.deaths = self.revivals = 0
        self._next_churn: float | None = None
        self.beats = 0
        # --hang-after: seconds into run() after which no rank finishes a step.
        self.hang_after = hang_after
        self.hung_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rank_step_ms(self, rank: int) -> float:
        return self.step_ms * self.slow.get(rank, 1.0)

    def steps_per_beat(self, rank: int) -> int:
        """Steps a rank makes in one period (the bridge reports at most 64 of their times)."""
        return min(64, max(1, round(self.period_s * 1000.0 / self.rank_step_ms(rank))))

    def step_times(self, rank: int) -> list[float]:
        """One period's step times, jittered."""
        base = self.rank_step_ms(rank)
        return [
            round(base * (1 + self.jitter * self.random.uniform(-1, 1)), 3)
            for _ in range(self.steps_per_beat(rank))
        ]

    def skip(self, seconds: int) -> None:
        """Continue from where ``prefill_history(seconds)`` left the global steps."""
        for rank in self.mine:
            self.gstep[rank] += seconds * self.steps_per_beat(rank)

    def write_job(self) -> None:
        write_job(self.run_dir, self.ranks)

    def prefill_history(self, seconds: int) -> None:
        """Write ``seconds`` of past history lines per rank, for the dashboard to seed from."""
        runfiles.state_dir(self.run_dir).mkdir(parents=True, exist_ok=True)
        now = time.time()
        for rank in range(self.ranks):
            lines = []
            for i in range(seconds, 0, -1):
                times = self.step_times(rank)
                self.gstep[rank] += len(times)
                mean = sum(times) / len(times)
                lines.append(
                    json.dumps(
                        {
                            "time": now - i * self.period_s,
                            "global_step": self.gstep[rank],
                            "loss": round(2.3 / (1 + self.gstep[rank] / 500), 6),
                            "step_time_ms": times[-1],
                            "step_time_mean_ms": round(mean, 3),
                            "cpu_percent": 98.5,
                            "rss_bytes": 512 * 1024 * 1024,
                        }
                    )
                )
            runfiles.history_path(self.run_dir, rank).write_text("\n".join(lines) + "\n")

    def beat(self, rank: int) -> None:
        self.flush([self.make_beat(rank)])

    def make_beat(self, rank: int) -> dict:
        if self.hung_at is not None:
            return self.make_hung_beat(rank)
        times = self.step_times(rank)
        self.seq[rank] += 1
        self.gstep[rank] += len(times)
        mean = sum(times) / len(times)
        extra = {"started_at": self.started[rank]} if rank in self.started else {}
        hb = heartbeat(
            rank,
            self.ranks,
            seq=self.seq[rank],
            now=time.time(),
            step_ms=mean,
            steps=len(times),
            global_step=self.gstep[rank],
            step_time_ms=times[-1],
            step_times_ms=times,
            step_time_mean_ms=round(mean, 3),
            validate=False,
            **extra,
        )
        return hb

    def make_hung_beat(self, rank: int) -> dict:
        """A heartbeat with no step since the last one: the reporter runs, the training thread waits."""
        self.seq[rank] += 1
        extra = {"started_at": self.started[rank]} if rank in self.started else {}
        return heartbeat(
            rank,
            self.ranks,
            seq=self.seq[rank],
            now=time.time(),
            step_ms=self.rank_step_ms(rank),
            global_step=self.gstep[rank],
            step_times_ms=[],
            last_step_at=self.hung_at,
            validate=False,
            **extra,
        )

    def flush(self, beats: list[dict]) -> None:
        """Write ``beats``: each to its file, or all to Redis in one pipeline."""
        if self.redis is None:
            for hb in beats:
                write_heartbeat(self.run_dir, hb)
        else:
            pipe = self.redis.pipeline(transaction=False)
            now = time.time()
            for hb in beats:
                data = json.dumps(hb, separators=(",", ":"))
                pipe.xadd(self.stream, {"r": hb["rank"], "hb": data}, maxlen=self.maxlen, approximate=True)
                pipe.hset(self.latest, str(hb["rank"]), data)
                if now - self._filed.get(hb["rank"], 0.0) >= self.file_every:
                    self._filed[hb["rank"]] = now
                    write_heartbeat(self.run_dir, hb)
            pipe.execute()
        self.beats += len(beats)

    def silence(self, rank: int) -> None:
        """Stop writing ``rank``'s heartbeats, as if it hung or died."""
        self.silenced.add(rank)

    def churn(self, now: float) -> None:
        """Take one rank down when due; bring back the ranks whose time is up."""
        for rank, until in list(self.down.items()):
            if now >= until:
                # A restarted process: new start time, heartbeat counter from 1.
                del self.down[rank]
                self.seq[rank] = 0
                self.started[rank] = now
                self.revivals += 1
        if self.churn_every <= 0:
            return
        if self._next_churn is None:
            self._next_churn = now + self.random.uniform(0, self.churn_every)
        if now >= self._next_churn:
            self._next_churn += self.churn_every
            alive = [r for r in self.mine if r not in self.down and r not in self.silenced]
            if alive:
                self.down[self.random.choice(alive)] = now + self.down_s
                self.deaths += 1

    def run(self, seconds: float | None = None, start: float | None = None) -> None:
        """Write heartbeats until ``stop()`` or ``seconds`` elapse.

        Rank r writes at ``start + (k + r / N) * period`` for k = 0, 1, ...;
        workers given the same ``start`` interleave as one job.
        """
        start = time.time() if start is None else start
        k = 0  # the k-th write of this simulator: its rank k % len(mine), period k // len(mine)
        while not self._stop.is_set():
            now = time.time()
            if seconds is not None and now - start >= seconds:
                break
            # Every heartbeat due by now, written as one batch (one Redis
            # pipeline); a simulator that fell behind catches up in bigger ones.
            batch = []
            while len(batch) < 512:
                period, i = divmod(k, len(self.mine))
                rank = self.mine[i]
                due = start + (period + rank / self.ranks) * self.period_s
                if due > now:
                    break
                if self.churn_every > 0 or self.down:
                    self.churn(now)
                if self.hang_after is not None and self.hung_at is None and now >= start + self.hang_after:
                    self.hung_at = start + self.hang_after
                if rank not in self.silenced and rank not in self.down:
                    batch.append(self.make_beat(rank))
                k += 1
            if batch:
                self.flush(batch)
                continue
            self._stop.wait(max(0.0, due - time.time()))

    def start(self) -> Simulator:
        self.write_job()
        self._thread = threading.Thread(target=self.run, name="simulator", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def parse_slow(text: str) -> tuple[int, float]:
    rank, _, factor = text.partition(":")
    return int(rank), float(factor or 2.0)


def work(args: argparse.Namespace, worker: int, workers: int, start: float) -> None:
    """One worker process: every ``workers``-th rank, from ``worker`` on."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sim = Simulator(
        args.run_dir,
        args.ranks,
        period_s=args.period_s,
        step_ms=args.step_ms,
        slow=dict(args.slow),
        seed=worker,
        only=range(worker, args.ranks, workers),
        churn_every=args.churn_every * workers,
        down_s=args.down_s,
        redis_url=args.redis,
        file_every=args.file_every,
        hang_after=args.hang_after,
    )
    sim.skip(args.history_seconds)
    sim.run(args.seconds, start=start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=None, help="stop after this long")
    parser.add_argument("--period-s", type=float, default=1.0, help="heartbeat period per rank")
    parser.add_argument("--step-ms", type=float, default=50.0, help="simulated step time")
    parser.add_argument(
        "--slow",
        type=parse_slow,
        action="append",
        default=[],
        metavar="RANK:FACTOR",
        help="make RANK step FACTOR times slower",
    )
    parser.add_argument(
        "--history-seconds",
        type=int,
        default=0,
        help="prefill this much chart history per rank before starting",
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="writer processes (default: one per 256 ranks)"
    )
    parser.add_argument(
        "--churn-every",
        type=float,
        default=0.0,
        metavar="S",
        help="every S seconds (job-wide) one rank dies, i.e. goes silent, "
        "and revives --down-s later as a restarted process (default: off)",
    )
    parser.add_argument(
        "--down-s",
        type=float,
        default=40.0,
        help="how long a churned rank stays down (default 40: past DEAD_AFTER_S)",
    )
    parser.add_argument("--redis", default=None, metavar="URL", help="publish to this Redis instead of files")
    parser.add_argument(
        "--file-every",
        type=float,
        default=10.0,
        help="with --redis: seconds between heartbeat files per rank",
    )
    parser.add_argument(
        "--hang-after",
        type=float,
        default=None,
        metavar="S",
        help="after S seconds every rank keeps writing heartbeats but finishes no step (default: never)",
    )
    args = parser.parse_args(argv)
    # Files: the kernel's file creation dominates, so one process per 256
    # ranks. Redis: pipelines make one process enough for thousands.
    workers = args.workers or max(1, -(-args.ranks // (256 if not args.redis else 8192)))
    sim = Simulator(
        args.run_dir, args.ranks, period_s=args.period_s, step_ms=args.step_ms, slow=dict(args.slow)
    )
    sim.write_job()
    if args.history_seconds:
        sim.prefill_history(args.history_seconds)
    print(f"simulating {args.ranks} ranks in {args.run_dir} with {workers} writer(s)", flush=True)
    start = time.time()
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=work, args=(args, w, workers, start), daemon=True) for w in range(workers)]
    done = threading.Event()
    # Ctrl-C or a terminate from the benchmark stops the workers.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    for proc in procs:
        proc.start()
    done.wait(args.seconds)
    for proc in procs:
        proc.terminate()
        proc.join()


if __name__ == "__main__":
    main()
