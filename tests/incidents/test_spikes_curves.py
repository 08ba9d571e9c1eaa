"""The spike detector's defaults against real loss curves (issue 34): quiet over whole runs, not deaf.

The curves are real: every step's loss of every rank of the demo's whole
default run (2 ranks under msrun, 18,042 steps) and of MindSpore's quick
start tutorial, recorded by ``python -m tests.bench.curves`` into
``tests/data/curves/`` (how, and with which MindSpore, is in each file). Here
they are replayed through ``Detector`` as the dashboard sees them: one sample
every ``stride`` steps, since a heartbeat carries one step's loss and covers
one step or hundreds, from several offsets.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from app.run.spikes import Params
from app.run.spikewindow import MIN_SAMPLES
from tests.helpers.spikes import replay_curve

CURVES = Path(__file__).resolve().parents[1] / "data" / "curves"
STRIDES = (1, 2, 3, 5, 8, 13, 21, 34, 55)
OFFSETS = 4  # per stride, at most
DEAD_NET = math.log(10)  # a dead net's loss on ten classes (the ReLU after a NaN input)


def load(name: str) -> list[list[float]]:
    with gzip.open(CURVES / f"{name}.json.gz") as f:
        curve = json.load(f)
    ranks = [curve["ranks"][r] for r in sorted(curve["ranks"], key=int)]
    n = min(map(len, ranks))
    return [r[:n] for r in ranks]


@pytest.mark.parametrize("name, steps", [("demo", 18042), ("quickstart", 2820)])
def test_the_defaults_raise_nothing_over_a_whole_real_run(name, steps):
    ranks = load(name)
    assert len(ranks[0]) == steps  # the whole run, not a part of it
    alarms = [
        (stride, offset, d.text)
        for stride in STRIDES
        for offset in range(min(stride, OFFSETS))
        for d in replay_curve(ranks, stride, offset)
    ]
    assert alarms == []


@pytest.mark.parametrize("name", ["demo", "quickstart"])
@pytest.mark.parametrize("stride", [1, 5, 21])
def test_a_dead_net_in_the_same_real_noise_is_a_spike_then_a_divergence(name, stride):
    """The loss jumps to ln 10 for good from a step well into the run, where its noise is largest."""
    ranks = load(name)
    k = len(ranks[0]) * 3 // 4
    dead = [losses[:k] + [DEAD_NET] * (len(losses) - k) for losses in ranks]
    found = replay_curve(dead, stride, 0)
    rules = [d.rule for d in found]
    assert rules == ["spike", "divergence"], [d.text for d in found]
    spike, divergence = found
    assert k - stride < spike.first_step <= k + 1 <= spike.step <= k + Params().steps + MIN_SAMPLES * stride
    assert divergence.step >= spike.first_step + Params().recover_steps
