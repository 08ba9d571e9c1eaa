"""The test Slurm itself (tests/helpers/slurm.py): it starts, runs a batch job, and leaves nothing behind."""

from __future__ import annotations

import os

from tests.helpers.slurm import Slurm


def test_a_batch_job_runs_and_the_teardown_leaves_nothing(slurm: Slurm, tmp_path):
    assert slurm.node_state() == "idle"
    script = tmp_path / "job.sh"
    script.write_text(
        '#!/bin/bash\necho "job=$SLURM_JOB_ID nodes=$SLURM_JOB_NODELIST restarts=${SLURM_RESTART_COUNT:-0}"\n'
    )
    out = tmp_path / "out.txt"
    job = slurm.sbatch(script, "-o", str(out))
    fields = slurm.wait_job(job, lambda f: f.get("JobState") == "COMPLETED", "the job completed")
    assert fields["ExitCode"] == "0:0" and fields["NodeList"] == slurm.node
    assert out.read_text().strip() == f"job={job} nodes={slurm.node} restarts=0"

    pids = [p.pid for p in slurm.procs.values()]
    slurm.stop()
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
