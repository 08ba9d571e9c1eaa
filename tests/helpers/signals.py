"""A process a test interrupts with Ctrl-C, started as a shell would start it.

Children inherit an ignored or blocked SIGINT across ``exec`` (only handlers
are reset), and Python leaves an ignored SIGINT ignored, so a test process
whose own SIGINT state was changed (by a runner, a library loaded in it, or
a background shell) would start a CLI that Ctrl-C cannot end. A user's
shell gives every command SIGINT at its default; ``ctrl_c_default`` does
the same, passed as ``Popen``'s ``preexec_fn``.
"""

from __future__ import annotations

import signal


def ctrl_c_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
