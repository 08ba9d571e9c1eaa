"""A process a test interrupts with Ctrl-C, started as a shell would start it, on a terminal.

Children inherit an ignored or blocked SIGINT across ``exec`` (only handlers
are reset), and Python leaves an ignored SIGINT ignored, so a test process
whose own SIGINT state was changed (by a runner, a library loaded in it, or
a background shell) would start a CLI that Ctrl-C cannot end. A user's
shell gives every command SIGINT at its default; ``ctrl_c_default`` does
the same, passed as ``Popen``'s ``preexec_fn``.
"""

from __future__ import annotations

import fcntl
import os
import pty
import signal
import termios
import threading


def ctrl_c_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class Terminal:
    """A pty for a child's output, as a person's terminal is: ``slave`` to pass, ``text()`` what it showed.

    A thread drains the master all along: a child writing to a full pty would block.
    """

    def __enter__(self) -> Terminal:
        self.master, self.slave = pty.openpty()
        self._chunks: list[bytes] = []
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        return self

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every writer closed the slave
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    def __exit__(self, *exc) -> None:
        os.close(self.slave)
        self._reader.join(timeout=30)
        os.close(self.master)

    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")


def on_terminal() -> None:
    """``preexec_fn``: a new session whose controlling terminal is stdin (a pty slave), as a shell's job has.

    The terminal's Ctrl-C (a ``\\x03`` written to the master) then reaches the
    session's foreground process group, as a person's Ctrl-C does.
    """
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    ctrl_c_default()
