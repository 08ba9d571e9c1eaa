"""The tailer reads only new bytes, survives rotation and truncation, and is bounded by design.

Real files in a temporary directory; the 1 GB log is sparse (a real 1 GB
file on disk, without writing a gigabyte), and the tests count the bytes
read to show it is never read whole.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.run.logmode.reader import LogDir
from app.run.logmode.tailer import BUDGET, FIRST_BYTES, MAX_LINE, Tailer

GB = 1 << 30


def read(tailer: Tailer) -> list[str]:
    return tailer.read(os.stat(tailer.path))


def append(path: Path, data: bytes | str) -> None:
    with open(path, "ab") as f:
        f.write(data.encode() if isinstance(data, str) else data)


@pytest.fixture
def log(tmp_path) -> Path:
    path = tmp_path / "worker_0.log"
    path.write_bytes(b"")
    return path


def test_only_new_lines_are_read_and_a_line_written_in_two_pieces_waits_for_its_end(log):
    t = Tailer(log)
    assert read(t) == []
    append(log, "epoch: 1 step: 1, loss is 2.3\nepoch: 1 st")
    assert read(t) == ["epoch: 1 step: 1, loss is 2.3"]
    before = t.bytes_read
    assert read(t) == []  # nothing new: nothing read
    assert t.bytes_read == before
    append(log, "ep: 2, loss is 2.2\n")
    assert read(t) == ["epoch: 1 step: 2, loss is 2.2"]
    assert t.offset == log.stat().st_size
    # Each byte was read exactly once.
    assert t.bytes_read == log.stat().st_size


def test_truncation_starts_over(log):
    t = Tailer(log)
    append(log, "old line 1\nold line 2\n")
    assert read(t) == ["old line 1", "old line 2"]
    with open(log, "r+b") as f:
        f.truncate(0)
    append(log, "new\n")
    assert read(t) == ["new"]
    assert t.reset == "truncated"
    append(log, "next\n")
    assert read(t) == ["next"] and t.reset is None


def test_rotation_starts_over_on_the_new_file(log):
    t = Tailer(log)
    append(log, "a\n" * 100)
    assert len(read(t)) == 100
    log.rename(log.with_name("worker_0.log.1"))
    log.write_text("fresh\n")
    assert read(t) == ["fresh"]
    assert t.reset == "rotated"


def test_a_1_gb_log_is_never_read_whole(log):
    # A real 1 GB file (sparse: no gigabyte is written), with MindSpore lines at its end.
    with open(log, "r+b") as f:
        f.truncate(GB)
    append(log, "\n" + "".join(f"epoch: 3 step: {s}, loss is 1.5\n" for s in range(1, 11)))
    assert log.stat().st_size > GB
    t = Tailer(log)
    lines = read(t)
    assert lines[-1] == "epoch: 3 step: 10, loss is 1.5"
    assert t.bytes_read <= FIRST_BYTES
    assert t.skipped >= GB - FIRST_BYTES
    # The cut line at the start of the window (NUL bytes of the sparse hole) is dropped whole.
    assert all(len(line) <= MAX_LINE for line in lines)
    append(log, "epoch: 3 step: 11, loss is 1.4\n")
    assert read(t) == ["epoch: 3 step: 11, loss is 1.4"]
    assert t.bytes_read <= FIRST_BYTES + 100


def test_the_reader_shows_a_rank_from_a_1_gb_log(tmp_path):
    logs = tmp_path / "msrun_logs"
    logs.mkdir()
    path = logs / "worker_0.log"
    with open(path, "wb") as f:
        f.truncate(GB)
    append(path, "\nepoch: 2 step: 7, loss is 0.25\n")
    d = LogDir(logs, "host")
    assert d.poll(0.0) == {0}
    hb = d.ranks[0].heartbeat
    assert (hb["epoch"], hb["step"], hb["loss"], hb["state"]) == (2, 7, 0.25, "training")
    assert d.ranks[0].tailer.bytes_read <= FIRST_BYTES


def test_a_burst_larger_than_the_budget_reads_only_its_newest_part(log):
    t = Tailer(log)
    read(t)
    burst = "".join(f"line {i:08d}\n" for i in range(2 * BUDGET // 14))
    append(log, burst + "last\n")
    lines = read(t)
    assert lines[-1] == "last"
    assert t.bytes_read <= BUDGET
    assert t.skipped > 0
    # The first line kept is whole: the cut one is dropped.
    assert lines[0].startswith("line ") and len(lines[0]) == len("line 00000000")


def test_a_line_longer_than_the_bound_is_cut_once_and_the_next_line_is_whole(log):
    t = Tailer(log)
    for _ in range(64):  # 4 MiB without a newline, in pieces
        append(log, b"x" * 65536)
        assert read(t) == []
    append(log, b"tail of the long line\nepoch: 1 step: 1, loss is 2.3\n")
    lines = read(t)
    assert lines == ["x" * MAX_LINE, "epoch: 1 step: 1, loss is 2.3"]
    assert len(t._partial) == 0


def test_many_lines_in_one_read_are_bounded(log):
    t = Tailer(log, max_lines=100)
    append(log, "\n" * 10000 + "newest\n")
    lines = read(t)
    assert len(lines) == 100 and lines[-1] == "newest"


def test_bytes_that_are_not_utf8_do_not_break_the_read(log):
    t = Tailer(log)
    append(log, b"\xff\xfe epoch: 1 step: 1, loss is 2.3\r\n\x80\n")
    assert read(t) == ["\ufffd\ufffd epoch: 1 step: 1, loss is 2.3", "\ufffd"]


def test_a_file_that_cannot_be_read_raises_and_keeps_the_position(log):
    t = Tailer(log)
    append(log, "one\n")
    st = os.stat(log)
    log.unlink()
    with pytest.raises(OSError):
        t.read(st)
    assert t.offset == 0
