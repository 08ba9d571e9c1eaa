"""The run's status line: whether the job is there at all, and what to tell the operator if not.

``RunStatus._make_run_status`` reads the state ``RunState`` keeps (the
heartbeat reader, the log reader, the verdict board, the world size) and
writes nothing; ``RunState`` inherits it and calls it once per scan.
"""

from __future__ import annotations

from trainer_bridge.rundir import runfiles

# How many missing ranks a status message names before it summarises.
NAMED_RANKS = 8


class RunStatus:
    """The status line of a run (mixed into ``RunState``): starting, running, ended, or what is wrong."""

    def _make_run_status(self) -> dict:
        """Whether the job is there at all, and what to tell the operator if not."""

        reader = self._reader
        log_problems = self._logs.problems() if self._logs is not None else []

        def status(kind: str, message: str) -> dict:
            transport = "files" if reader.redis is None else "redis" if not reader.redis_error else "files"
            if reader.redis_error:
                message += (
                    f" Redis is unreachable ({reader.redis_error}): heartbeats are read from the run "
                    "directory's files until it is back."
                )
            refused = getattr(reader.redis, "refused", 0)
            if refused:
                message += (
                    f" Redis: {refused} heartbeat(s) refused as unsigned or badly signed (REDIS_KEY), "
                    f"the last {reader.redis.refused_last}: is something else writing to Redis?"
                )
            if log_problems:
                message += f" Worker logs: {'; '.join(log_problems)}."
            return {
                "status": kind,
                "message": message,
                "run_dir": str(self.run_dir or ""),
                "transport": transport,
            }

        if self.run_dir is None:
            return status(
                "missing",
                "No run directory was given: start the dashboard with --run-dir RUN (or RANKWATCH_RUN_DIR).",
            )
        if not self.run_dir.is_dir():
            return status(
                "missing",
                f"The run directory {self.run_dir} does not exist (yet). "
                "The dashboard keeps watching and fills in when the job "
                "starts; check the path if this persists.",
            )
        sdir = runfiles.state_dir(self.run_dir)
        latest = self._board.latest
        reported = self._summary.get("reported", 0)

        if self._reader.read_error:
            shown = (
                f" The table shows what was read last ({reported} rank"
                f"{'' if reported == 1 else 's'}); their heartbeats age until it is readable."
                if reported
                else ""
            )
            return status(
                "unreadable",
                f"Cannot read {sdir}: {self._reader.read_error}. The ranks write "
                "their heartbeats there, so they cannot report either; check "
                "that it is a directory this user can read (and that the disk "
                f"is healthy).{shown}",
            )
        if not reported and not self._reader.job and self._reader.job_error:
            return status(
                "waiting",
                f"{runfiles.job_path(self.run_dir)} is unreadable "
                f"({self._reader.job_error}) and no rank has written a heartbeat "
                "yet: the job has not started, or another tool wrote that "
                "file. The dashboard picks the job up when rank 0 rewrites "
                "it at start.",
            )
        if not reported and not self._reader.job:
            return status(
                "waiting",
                f"The job has not started: {sdir} holds no job.json and no "
                "heartbeats yet. Rank 0 writes job.json when the bridge "
                "starts; each rank then writes rank_N.json about once a "
                "second. A script without the bridge is shown from msrun's worker logs, and "
                f"{self._logs.path if self._logs else 'the log directory'} has none yet.",
            )
        note = (
            ""
            if self._reader.job
            else f" (job.json is unreadable: {self._reader.job_error}; the world size comes from the heartbeats)"
            if self._reader.job_error
            else " (job.json is missing, so the world size comes from the heartbeats)"
        )
        from_log = len(self._from_log & {r for r, hb in latest.items() if hb is not None})
        if from_log:
            note = (
                f" (from msrun's worker logs in {self._logs.path} until the bridge's first heartbeats)"
                if self._beats_expected
                else f" (from msrun's worker logs in {self._logs.path}: no rank writes Rankwatch heartbeats "
                "(yet), so CPU, memory, device and stop stages are not shown)"
                if from_log == reported
                else f"{note} ({from_log} of them from their worker logs only: no heartbeats from them yet)"
            )
        conflict = self._launches.conflict(latest, self._ended, self.scanned_at)
        if conflict:
            return status("conflict", conflict)
        missing = self._board.missing()
        if not reported:
            return status(
                "starting",
                f"The job has started (world size {self._world}) but no rank "
                "has written a heartbeat yet. Ranks report once the bridge "
                "is running, usually after graph compilation.",
            )
        if missing:
            named = ", ".join(map(str, missing[:NAMED_RANKS]))
            more = f" and {len(missing) - NAMED_RANKS} more" if len(missing) > NAMED_RANKS else ""
            return status(
                "starting",
                f"{reported} of {self._world} ranks have reported; "
                f"waiting for rank{'s' if len(missing) > 1 else ''} "
                f"{named}{more}.{note}",
            )
        if self._board.all_terminal():
            counts = {}
            for hb in latest.values():
                counts[hb["state"]] = counts.get(hb["state"], 0) + 1
            told = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
            return self._ended_status(status, f"The job has ended: {told}.")
        over = self._job_over()
        if over:
            # Ranks killed or crashed without saying so: their processes and msrun are gone.
            return self._ended_status(status, f"The job has ended: {over}.")
        return status("running", f"{self._world} ranks reporting.{note}")

    def _ended_status(self, status, message: str) -> dict:
        """``ended``, with ``proven``: whether a probe here backs it (app.ranks.endproof).

        Stop stays usable while only the files say so: anything that writes the run
        directory can write "finished" (issue 32, P1).
        """
        world = set(range(self._world)) | set(self._board.latest)
        proof = self._proof
        proven = bool(world) and world <= proof.proven
        if proof.running:
            ranks = sorted(proof.running)
            message += (
                f" But the process of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks[:8]))}"
                f"{' and more' if len(ranks) > 8 else ''} still runs on this host: Stop stays usable."
            )
        elif not proven:
            message += " Only the run directory says so (no probe here can confirm it): Stop stays usable."
        return {**status("ended", message), "proven": proven}
