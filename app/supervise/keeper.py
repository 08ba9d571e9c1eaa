"""``python -m app.supervise.keeper MARK GRACE_S``: ends an attempt's processes when the supervisor dies.

The supervisor starts it with the read end of a pipe as its standard
input and keeps the write end. However the supervisor ends (``kill -9``
included), the kernel closes that end, the read here returns, and the
keeper sends SIGTERM, then SIGKILL after ``GRACE_S``, to every process of
this user marked with ``MARK`` (``procs.MARK_ENV``). A pipe rather than
``PR_SET_PDEATHSIG``: the death signal goes to the direct child only, is
cleared by ``fork``, and is lost if the parent dies before the child set
it; end of file on a pipe has none of those gaps. It runs in a session of
its own, so a signal to the supervisor's process group (Ctrl-C) does not
reach it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    mark, grace_s = argv[0], float(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:
        try:
            if not os.read(0, 4096):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    from app.supervise.procs import end_all, marked

    end_all(lambda: marked(mark), grace_s)
    return 0


def start_keeper(mark: str, grace_s: float) -> tuple[subprocess.Popen, int]:
    """The supervisor's keeper, and the write end of its pipe (kept open while the supervisor lives)."""
    from app.supervise.procs import MARK_ENV

    read, write = os.pipe()
    try:
        keeper = subprocess.Popen(
            [sys.executable, "-m", "app.supervise.keeper", mark, str(grace_s)],
            stdin=read,
            start_new_session=True,
            env={k: v for k, v in os.environ.items() if k != MARK_ENV},
        )
    finally:
        os.close(read)
    return keeper, write


def stop_keeper(keeper: subprocess.Popen | None, pipe: int | None) -> None:
    if pipe is not None:
        os.close(pipe)  # its end of file: it sweeps (nothing is left) and exits
    if keeper is not None:
        try:
            os.waitpid(keeper.pid, 0)
        except ChildProcessError:
            pass
        keeper.returncode = 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
