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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
