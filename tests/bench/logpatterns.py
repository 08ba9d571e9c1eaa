"""Log patterns against hostile lines: the worst time per line, RE2 (as shipped) against Python's ``re``.

``.venv/bin/python -m tests.bench.logpatterns [--repeat 3]``

A worker log is written by the job, so a line can be built to make a
backtracking engine slow. The corpus (``adversarial``) holds such lines for
every pattern: many ``{ Epoch:[`` openings with no ``per_step_time``,
nested braces and brackets, long digit runs, MindSpore log prefixes that
never close, 4 KiB and 64 KiB lines. Each line is tried against every
pattern of every list (worker, scheduler, launcher, and the exception line):

* **shipped**: ``Pattern.match`` as the reader calls it: the line cut at
  ``MAX_LINE``, the needle prefilter, then RE2;
* **re**: the same pattern text compiled by Python's ``re``, on the line cut
  at the tailer's ``MAX_LINE`` as before (what the reader did until RE2).

For each engine it prints the worst line (the sum over all patterns, the
best of ``--repeat`` runs, so a scheduling hiccup is not taken for the
engine), and the five slowest (line, pattern) pairs. Then the price of the
guarantee on ordinary lines: ``WorkerLog.feed`` per line over 20,000
``LossMonitor`` lines, with the shipped patterns and with the same patterns
on ``re`` (RE2's Python wrapper costs more per call than ``re`` on a short
line). No assertion: numbers for the manual (Security, Benchmarks).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time

from app.run.logmode import parser
from app.run.logmode.patterns import BY_ROLE, EXCEPTION, MAX_LINE


def adversarial() -> dict[str, str]:
    """Named hostile lines."""
    epoch = "{ Epoch:[  1/  2], step:[    5/  100], loss:[10.253/10.301], "
    prefix = "[ERROR] DISTRIBUTED(10208,7f2904429b80,python):2026-11-23-08:57:58.163.543 "
    lines = {
        "epoch_openings_4k": (epoch * (4096 // len(epoch)))[:4096],
        "epoch_openings_64k": epoch * (65536 // len(epoch)),
        "epoch_no_commas_4k": "{ Epoch:[1/1], step:[1/1], loss: 1" + " x" * 2030,
        "epoch_brackets_4k": "{ Epoch:[" * 455,
        "nested_braces_4k": "{" * 2048 + "}" * 2048,
        "nested_brackets_64k": "[" * 32768 + "]" * 32768,
        "digits_4k": "epoch: " + "9" * 4089,
        "digits_64k": "9" * 65536,
        "loss_is_repeated_4k": ("epoch: 1 step: 1, loss is " * 160)[:4096],
        "ms_prefix_open_4k": prefix + "[" * 4000,
        "ms_prefix_spaces_4k": prefix + "a [" * 1330,
        "ms_prefix_pids_4k": "[ERROR] ME(" + "1" * 4000,
        "kill_sigterm_4k": prefix + "[x] " * 1000 + "Kill this process with SIGTERM",
        "start_worker_4k": "Start worker process with rank id:1, log file:" + "a" * 4050,
        "exit_exception_4k": "Worker process 1 exit with exception" * 113,
        "registered_4k": ("The new node: 0(role: MS_WORKER), rank id: 0, device id: 0, hostname: " * 60)[
            :4096
        ],
        "json_file_4k": "Parse json file failed: " + "please check json file: " * 160,
        "exception_name_4k": "A" * 200 + "." * 3800 + ": x",
        "per_step_time_4k": "Train epoch time: " + "1." * 2000 + " ms, per step time: 1 ms",
        "unicode_4k": "{ Epoch:[ 1/ 2], step:[ 1/ 2], loss: 1, " + "训练" * 2000,
    }
    return lines


def patterns() -> list[tuple[str, object, str]]:
    """(name, shipped match function, pattern text) for every pattern, and the exception line."""
    out = []
    for role, plist in BY_ROLE.items():
        for i, p in enumerate(plist):
            out.append((f"{role}[{i}]:{p.kind}", p.match, p.regex.pattern, p.needle))
    out.append(("exception", lambda line: EXCEPTION.match(line[:MAX_LINE]), EXCEPTION.pattern, None))
    return out


def _time(fn, line: str) -> float:
    started = time.perf_counter()
    fn(line)
    return time.perf_counter() - started


def measure(repeat: int) -> dict:
    lines = adversarial()
    pats = patterns()
    compiled = {name: re.compile(text) for name, _, text, _ in pats}
    shipped_pairs, re_pairs = {}, {}
    for lname, line in lines.items():
        old_line = line[:MAX_LINE]
        for name, fn, _, needle in pats:
            rx = compiled[name]

            def old(s, rx=rx, needle=needle):
                if needle is not None and needle not in s:
                    return None
                return rx.search(s)

            shipped_pairs[(lname, name)] = min(_time(fn, line) for _ in range(repeat))
            re_pairs[(lname, name)] = min(_time(old, old_line) for _ in range(repeat))

    def per_line(pairs):
        totals: dict[str, float] = {}
        for (lname, _), t in pairs.items():
            totals[lname] = totals.get(lname, 0.0) + t
        return totals

    return {
        "lines": {k: len(v) for k, v in lines.items()},
        "shipped": (per_line(shipped_pairs), shipped_pairs),
        "re": (per_line(re_pairs), re_pairs),
    }


def ordinary(repeat: int, n: int = 20000) -> dict[str, float]:
    """Microseconds of ``WorkerLog.feed`` per ordinary step line: shipped (RE2) and on ``re``."""
    lines = [f"epoch: {1 + i // 1000} step: {i % 1000 + 1}, loss is 2.305208206176758" for i in range(n)]

    def run() -> float:
        log = parser.WorkerLog()
        started = time.thread_time()
        for line in lines:
            log.feed(line)
        return (time.thread_time() - started) / n * 1e6

    out = {"shipped": min(run() for _ in range(repeat))}
    saved = parser._LINES, parser._PID
    try:
        parser._LINES, parser._PID = (
            tuple(dataclasses.replace(p, regex=re.compile(p.regex.pattern)) for p in ps) for ps in saved
        )
        out["re"] = min(run() for _ in range(repeat))
    finally:
        parser._LINES, parser._PID = saved
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    result = measure(args.repeat)
    print(f"{len(result['lines'])} adversarial lines x {len(patterns())} patterns, best of {args.repeat}")
    for engine in ("shipped", "re"):
        totals, pairs = result[engine]
        worst = max(totals, key=totals.get)
        label = "RE2, line cut at MAX_LINE" if engine == "shipped" else "Python re, same patterns"
        print(f"\n{label}: worst line {worst} ({result['lines'][worst]} chars): {totals[worst] * 1e3:.3f} ms")
        print(f"  all {len(totals)} lines together: {sum(totals.values()) * 1e3:.3f} ms")
        for (lname, pname), t in sorted(pairs.items(), key=lambda kv: -kv[1])[:5]:
            print(f"  {t * 1e3:9.3f} ms  {pname:36} {lname}")
    cost = ordinary(args.repeat)
    print(
        f"\nordinary LossMonitor lines, WorkerLog.feed: {cost['shipped']:.1f} us/line with RE2, "
        f"{cost['re']:.1f} us/line with re"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
