"""Read only what was appended to a log since the last look, in bounded pieces.

A ``Tailer`` keeps, per file, the identity of the file it read (device and
inode), the offset it reached and the start of a line not yet finished. Each
call is given the file's fresh ``stat`` (the caller has it from its
``scandir``), so a file that did not grow costs nothing more; one that grew
is opened, read from the offset, and closed again (no descriptor is held
between ticks, so a 4096-rank job does not exhaust them).

What a log can make it allocate is bounded:

* a file seen for the first time is read from at most ``first_bytes``
  before its end (a 1 GB log costs one read of its tail, never a read of
  the whole);
* a file that grew by more than ``budget`` bytes since the last look is
  read from ``budget`` bytes before its end (the skipped middle is counted
  in ``skipped``); the newest lines are what the dashboard shows;
* a line is cut at ``max_line`` characters (the rest, up to its newline, is
  discarded however long it is), and a read yields at most ``max_lines``
  lines (the newest).

A file whose inode changed was rotated (a new file under the same name)
and is read from its start; one that shrank below the offset was truncated
(``copytruncate``, or msrun relaunched with the same ``--log_dir``) and is
read from its start too. ``reset`` then says so, so the caller forgets what
the old content said.
"""

from __future__ import annotations

import os

from trainer_bridge.rundir import safeio

# A MindSpore log line is a few hundred bytes; a C++ stack line can be long.
MAX_LINE = 4096
FIRST_BYTES = 256 * 1024
BUDGET = 256 * 1024
MAX_LINES = 4096


class Tailer:
    __slots__ = (
        "path",
        "first_bytes",
        "budget",
        "max_line",
        "max_lines",
        "_key",
        "offset",
        "_partial",
        "_skip_to_newline",
        "_drop_to_newline",
        "bytes_read",
        "skipped",
        "reset",
    )

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        first_bytes: int = FIRST_BYTES,
        budget: int = BUDGET,
        max_line: int = MAX_LINE,
        max_lines: int = MAX_LINES,
    ):
        self.path = os.fspath(path)
        self.first_bytes = first_bytes
        self.budget = budget
        self.max_line = max_line
        self.max_lines = max_lines
        self._key: tuple[int, int] | None = None
        self.offset = 0
        self._partial = b""
        # Started (or resumed) in the middle of a line: its head is gone, drop the tail.
        self._skip_to_newline = False
        # The current line passed max_line: keep its head, drop the rest until its newline.
        self._drop_to_newline = False
        self.bytes_read = 0  # all bytes read so far (tests, benchmark)
        self.skipped = 0  # bytes never read because of the bounds
        self.reset: str | None = None  # "rotated" or "truncated" after a read that started over

    def read(self, st: os.stat_result) -> list[str]:
        """The complete lines appended since the last call, given the file's current ``stat``.

        Raises OSError if the file cannot be opened or read (the caller
        decides what that means); the position is then unchanged.
        """
        self.reset = None
        key = (st.st_dev, st.st_ino)
        size = st.st_size
        if self._key is None:
            self._start(size, self.first_bytes)
        elif key != self._key:
            self.reset = "rotated"
            self._start(size, self.first_bytes)
        elif size < self.offset:
            self.reset = "truncated"
            self._start(size, self.first_bytes)
        self._key = key
        if size == self.offset:
            return []
        if size - self.offset > self.budget:
            self._jump(size - self.budget)
        # Never blocks: a FIFO or device swapped in since the listing is refused.
        data = safeio.read_at(self.path, self.offset, size - self.offset)
        self.offset += len(data)
        self.bytes_read += len(data)
        return self._lines(data)

    def _start(self, size: int, window: int) -> None:
        self.offset = 0
        self._partial = b""
        self._skip_to_newline = self._drop_to_newline = False
        if size > window:
            self._jump(size - window)

    def _jump(self, offset: int) -> None:
        """Continue at ``offset``, past bytes that will never be read."""
        self.skipped += offset - self.offset
        self.offset = offset
        self._partial = b""
        self._drop_to_newline = False
        self._skip_to_newline = True

    def _lines(self, data: bytes) -> list[str]:
        if self._skip_to_newline or self._drop_to_newline:
            newline = data.find(b"\n")
            if newline < 0:
                return []
            if self._skip_to_newline:
                data = data[newline + 1 :]
            else:
                data = data[newline:]  # ends the kept head of the long line
            self._skip_to_newline = self._drop_to_newline = False
        buf = self._partial + data if self._partial else data
        cut = buf.rfind(b"\n")
        if cut < 0:
            rest, done = buf, b""
        else:
            rest, done = buf[cut + 1 :], buf[:cut]
        if len(rest) > self.max_line:
            rest = rest[: self.max_line]
            self._drop_to_newline = True
        self._partial = rest
        if cut < 0:
            return []
        lines = done.decode("utf-8", "replace").split("\n")
        if len(lines) > self.max_lines:
            lines = lines[-self.max_lines :]
        limit = self.max_line
        return [ln[:limit].rstrip("\r") if len(ln) > limit or ln.endswith("\r") else ln for ln in lines]
