"""A line for the person who launched the job, on msrun's own terminal.

msrun sends each worker's output to its log file, so what a worker prints
never reaches the terminal msrun was started from: a refused launch showed
only "the job exited with 1". The worker's parent is msrun, and msrun's
stderr is that terminal when a person started it by hand.
"""

from __future__ import annotations

import os


def tell_launcher(text: str) -> bool:
    """Write ``text`` to the parent's stderr when it is a terminal; True if written. Never blocks.

    O_NONBLOCK on the open and the write: a FIFO without a reader, a
    suspended terminal (Ctrl-S) or a full pipe must not hold a refusing
    rank. Anything but a terminal is left alone (a file or pipe is the
    parent's own output, which its owner reads in the log already).
    """
    try:
        fd = os.open(f"/proc/{os.getppid()}/fd/2", os.O_WRONLY | os.O_NOCTTY | os.O_NONBLOCK | os.O_APPEND)
    except OSError:
        return False
    try:
        if not os.isatty(fd):
            return False
        os.write(fd, (text.rstrip("\n") + "\n").encode(errors="replace"))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
