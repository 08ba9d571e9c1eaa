"""EndProof: which ranks a probe on this host proves ended (app/run/endproof.py)."""

from __future__ import annotations

from app.run.endproof import EndProof

HOST = "node-a"


def proof(gone: dict[int, str | None]) -> tuple[EndProof, list[tuple]]:
    """An EndProof whose probe answers from ``gone`` (pid -> why gone, None while running)."""
    asked = []

    def probe(pid, started):
        asked.append((pid, started))
        return gone.get(pid)

    return EndProof(HOST, probe, every_s=5.0), asked


def test_a_log_beat_read_before_the_scheduler_named_its_host_does_not_block_the_proof():
    # Log mode: the first beat of a worker log can come before msrun's scheduler log says which
    # host the rank is on (host None) and before the writer scan found its start time.
    p, asked = proof({4242: "process 4242 is gone"})
    p.observe(0, {"host": None, "pid": 4242, "started_at": None})
    p.observe(0, {"host": HOST, "pid": 4242, "started_at": None})
    p.observe(0, {"host": HOST, "pid": 4242, "started_at": 1000.0})
    p.check({0}, now=1.0)
    assert p.proven == {0} and p.running == frozenset()
    assert (4242, None) in asked  # the hostless beat is probed without a start time


def test_a_hostless_beat_whose_pid_still_runs_holds_the_proof_back():
    # A start time (forged or not) that makes the process look replaced does not clear a pid
    # that still runs: the hostless identity is probed by its pid alone.
    gone = {4242: "pid 4242 now belongs to a newer process; the rank's process is gone"}

    def probe(pid, started):
        return gone[pid] if started is not None else None

    p = EndProof(HOST, probe, every_s=5.0)
    p.observe(0, {"host": None, "pid": 4242, "started_at": None})
    p.observe(0, {"host": HOST, "pid": 4242, "started_at": 1.0})
    p.check({0}, now=1.0)
    assert p.proven == frozenset() and p.running == {0}


def test_a_hostless_beat_of_a_pid_never_seen_here_cannot_be_proven():
    p, _ = proof({4242: "gone", 7: "gone"})
    p.observe(0, {"host": None, "pid": 7, "started_at": None})
    p.observe(0, {"host": HOST, "pid": 4242, "started_at": 1.0})
    p.check({0}, now=1.0)
    assert p.proven == frozenset() and p.running == frozenset()


def test_a_process_on_another_host_cannot_be_proven_here():
    p, asked = proof({})
    p.observe(0, {"host": "node-b", "pid": 4242, "started_at": 1.0})
    p.check({0}, now=1.0)
    assert p.proven == frozenset() and p.running == frozenset() and asked == []
