"""A reference rank and thresholds for the verdict rules' tests."""

from __future__ import annotations

import random

from app.run.health import Thresholds
from app.run.stepcost import StepWindow
from tests.helpers.heartbeats import heartbeat

TH = Thresholds(straggler_min_steps=4, straggler_window=8, stall_min_s=5.0, dead_after_s=12.0)


class Rank:
    def __init__(self, rank: int, world: int, rnd: random.Random, now: float):
        self.rank, self.world, self.rnd = rank, world, rnd
        self.window = StepWindow(TH.straggler_window)
        self.hb = None
        self.seq = 0
        self.gstep = 0
        self.pace = rnd.choice([20.0, 20.0, 20.0, 21.0, 45.0, 100.0])
        self.split = rnd.random() < 0.8
        self.started = now

    def beat(self, now: float) -> None:
        rnd = self.rnd
        self.seq += 1
        steps = rnd.choice([0, 1, 3, 8])
        self.gstep += steps
        state = rnd.choices(
            ["training", "starting", "stopping", "saving", "exited", "finished", "failed"],
            weights=[30, 2, 2, 1, 1, 1, 1],
        )[0]
        times = [round(self.pace * rnd.uniform(0.9, 1.1), 3) for _ in range(steps)]
        self.hb = heartbeat(
            self.rank,
            self.world,
            seq=self.seq,
            now=now,
            steps=max(1, steps),
            step_ms=self.pace,
            global_step=self.gstep,
            state=state,
            step_times_ms=times,
            step_in_ms=round(self.pace * 0.7, 2) if self.split and steps else None,
            step_out_ms=round(self.pace * 0.3 * rnd.uniform(0.5, 2), 2) if self.split and steps else None,
            last_step_at=now - rnd.uniform(0, 2) if self.gstep else None,
            started_at=self.started,
            error="boom" if state == "failed" else None,
        )
        self.window.add(self.hb)
