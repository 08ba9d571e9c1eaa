"""This process's CPU and memory, as each heartbeat reports them: cheaply, and never an error.

``os.times()`` and one ``pread`` of a held ``/proc/self/statm``; psutil only
where there is no /proc.
"""

from __future__ import annotations

import os
import time

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class ProcessStats:
    """CPU percent since the last sample, CPU seconds so far, RSS bytes; ``close()`` at the end."""

    def __init__(self) -> None:
        self._cpu_last: tuple[float, float] | None = None
        self._statm: int | None = None  # /proc/self/statm, held open (_rss)

    def sample(self) -> tuple[float | None, float, int | None]:
        """(CPU percent since the last call, CPU seconds so far, RSS bytes); None where unreadable.

        ``os.times()`` and one ``pread`` of a held ``/proc/self/statm``: psutil
        read two /proc files in about a dozen syscalls a heartbeat (the
        reporter's load: ``python -m tests.bench.reporter``). psutil remains
        for a system without /proc.
        """
        t = os.times()
        # Cumulative, so a scraper can take a rate over any window (the percent
        # covers only the last heartbeat's); the kernel counts in clock ticks.
        cpu_s = t.user + t.system
        now = time.monotonic()
        last, self._cpu_last = self._cpu_last, (cpu_s, now)
        percent = None
        if last is not None and now > last[1]:
            percent = round(max(0.0, cpu_s - last[0]) / (now - last[1]) * 100.0, 1)
        return percent, round(cpu_s, 3), self._rss()

    def _rss(self) -> int | None:
        if self._statm is None:
            try:
                self._statm = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._statm = -1
        try:
            if self._statm < 0:
                import psutil

                return psutil.Process().memory_info().rss
            return int(os.pread(self._statm, 128, 0).split()[1]) * _PAGE
        except Exception:  # noqa: BLE001 - a missing figure, never a reporter error
            return None

    def close(self) -> None:
        """Close the held /proc/self/statm (-1 after: a later sample asks psutil)."""
        statm, self._statm = self._statm, -1
        if statm is not None and statm >= 0:
            os.close(statm)
