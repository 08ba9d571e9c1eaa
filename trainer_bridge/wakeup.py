"""A one-shot timer that calls back on a fresh native thread: the reporter's watchdog.

Why it exists: a live Python thread in a rank costs MindSpore's functional
steps about 2% at small steps, even one parked on a lock that never wakes
(``docs/benchmarks.md``). So while steps flow, the training thread does
the reporter's work at its agreement steps and no reporter thread exists.
This timer, re-armed at each of those agreements, brings the thread back
when they stop coming: a hang in a collective, a long evaluation, a data
stall. A Python signal handler would not do: it runs only when the main
thread next executes bytecode, which a rank blocked in a C call never does.

It is POSIX ``timer_create(CLOCK_MONOTONIC)`` with ``SIGEV_THREAD`` through
ctypes: at expiry the C library runs the callback on a new native thread,
and ctypes lends that thread the GIL and a Python thread state for the
call only. Between expiries the process holds no thread of ours but the C
library's helper, which has no Python thread state. Where the call is
missing (not Linux with glibc, a 32-bit build) ``Wakeup.create`` returns
None and the reporter keeps its thread all the time, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import logging
import sys
import threading
from collections.abc import Callable

log = logging.getLogger("trainer_bridge")

_CLOCK_MONOTONIC = 1
_SIGEV_THREAD = 2


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


# void (*)(union sigval): the union is one pointer-sized word, passed as one.
_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _SigevThread(ctypes.Structure):
    _fields_ = [("function", _CALLBACK), ("attribute", ctypes.c_void_p)]


class _SigevUnion(ctypes.Union):
    _fields_ = [("pad", ctypes.c_int * 12), ("thread", _SigevThread)]


class _Sigevent(ctypes.Structure):
    """glibc's ``struct sigevent`` on 64-bit Linux (64 bytes)."""

    _fields_ = [
        ("value", ctypes.c_void_p),
        ("signo", ctypes.c_int),
        ("notify", ctypes.c_int),
        ("un", _SigevUnion),
    ]


# Expiries look their target up by key: a late expiry after ``close()``
# finds nothing and returns. The one C callback lives as long as the module,
# so the C library can never call freed code.
_targets: dict[int, Callable[[], None]] = {}
_keys = itertools.count(1)


def _fire(key) -> None:
    target = _targets.get(key or 0)
    if target is None or sys.is_finalizing():
        return
    try:
        target()
    except Exception:  # noqa: BLE001 - an exception must not escape into the C library's thread
        log.warning("rankwatch: watchdog callback failed", exc_info=True)


_FIRE = _CALLBACK(_fire)


def _libc():
    if sys.platform != "linux" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    for name in (None, ctypes.util.find_library("rt")):  # glibc >= 2.34 has it in libc
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            lib.timer_create, lib.timer_settime, lib.timer_delete  # noqa: B018 - present?
        except (OSError, AttributeError):
            continue
        lib.timer_create.argtypes = [ctypes.c_int, ctypes.POINTER(_Sigevent), ctypes.POINTER(ctypes.c_void_p)]
        lib.timer_settime.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.POINTER(_Itimerspec),
            ctypes.c_void_p,
        ]
        lib.timer_delete.argtypes = [ctypes.c_void_p]
        return lib
    return None


class Wakeup:
    """Call ``callback`` once, on a native thread, ``seconds`` after the last ``arm``."""

    def __init__(self, lib, timer: ctypes.c_void_p, key: int):
        self._lib, self._timer, self._key = lib, timer, key
        self._lock = threading.Lock()  # arm and close: held for one syscall, never by a rank's neighbour
        self._closed = False

    @classmethod
    def create(cls, callback: Callable[[], None]) -> Wakeup | None:
        """A disarmed timer, or None where this system has no ``SIGEV_THREAD`` timers."""
        lib = _libc()
        if lib is None:
            return None
        key = next(_keys)
        event = _Sigevent()
        event.notify = _SIGEV_THREAD
        event.value = key
        event.un.thread.function = _FIRE
        timer = ctypes.c_void_p()
        if lib.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            log.info("rankwatch: no watchdog timer (errno %d): the reporter thread stays", ctypes.get_errno())
            return None
        _targets[key] = callback
        return cls(lib, timer, key)

    def arm(self, seconds: float) -> None:
        """(Re)start the countdown; the previous one is dropped."""
        self._set(max(seconds, 1e-6))

    def disarm(self) -> None:
        self._set(0.0)

    def _set(self, seconds: float) -> None:
        spec = _Itimerspec()
        spec.it_value.tv_sec = int(seconds)
        spec.it_value.tv_nsec = int((seconds - int(seconds)) * 1e9)
        with self._lock:
            if not self._closed:
                self._lib.timer_settime(self._timer, 0, ctypes.byref(spec), None)

    def close(self) -> None:
        """Delete the timer; safe to call twice. An expiry already running finishes."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _targets.pop(self._key, None)
            self._lib.timer_delete(self._timer)
