"""The loss-spike detector (app/run/spikes.py) on synthetic curves and bad input (issue 34)."""

from __future__ import annotations

import json
import math

import pytest

from app.run import spikewindow
from app.run.mfnorms import read_mindformers
from app.run.spikes import Detector, Params


def beat(step, loss=None, *, nonfinite=None, norm=None, launch="L1"):
    return {
        "global_step": step,
        "loss": loss,
        "loss_nonfinite": nonfinite,
        "grad_norm": norm,
        "launch": launch,
    }


def feed(det, ranks, steps, loss_at, t0=1000.0, every=5):
    for step in steps:
        for r in ranks:
            loss = loss_at(r, step)
            if isinstance(loss, float) and not math.isfinite(loss):
                hb = beat(step, None, nonfinite="nan" if math.isnan(loss) else "inf")
            else:
                hb = beat(step, loss)
            det.observe(r, hb, t0 + step)
    return det.take()


def noisy(r, step):
    return 2.3 / (1 + step / 300) * (1 + 0.1 * math.sin(step * 1.7 + r))


def test_a_falling_noisy_curve_raises_nothing():
    det = Detector(world=2)
    assert feed(det, [0, 1], range(5, 3000, 5), noisy) == []
    assert det.open_rules() == []


def test_nan_on_every_rank_is_one_detection_that_acts():
    det = Detector(world=2)
    got = feed(det, [0, 1], range(5, 400, 5), lambda r, s: math.nan if s >= 200 else noisy(r, s))
    # Sampled every 5 steps: the last finite sample was at 195, so K (the earliest abnormal step) is 196.
    assert [(d.rule, d.step, d.first_step, d.value, d.ranks, d.acts) for d in got] == [
        ("nonfinite", 200, 196, "nan", 2, True)
    ]
    assert "rank 0" in got[0].text
    assert det.open_rules() == ["nonfinite"]


def test_one_ranks_nan_while_the_other_is_finite_is_that_rank_only():
    det = Detector(world=2)
    # A forged file: rank 1's loss NaN from step 200 on, rank 0's finite. Reported once.
    got = feed(det, [0, 1], range(5, 400, 5), lambda r, s: math.nan if (r == 1 and s >= 200) else noisy(r, s))
    assert [(d.rule, d.rank, d.step, d.lone, d.acts) for d in got] == [("nonfinite", 1, 200, True, False)]
    assert "evidence of that rank only" in got[0].text


def test_a_one_rank_job_nan_acts_at_once():
    det = Detector(world=1)
    det.observe(0, beat(10, None, nonfinite="inf"), 1.0)
    (d,) = det.take()
    assert (d.rule, d.value, d.acts) == ("nonfinite", "inf", True)


def test_a_spike_that_comes_back_warns_and_one_that_stays_diverges():
    det = Detector(Params(factor=3.0, steps=3, recover_steps=50), world=1)
    back = feed(det, [0], range(5, 600, 5), lambda r, s: 9.0 if 300 <= s < 320 else 1.0)
    # Three abnormal samples (300, 305, 310) over at least three steps.
    assert [(d.rule, d.step, d.first_step, d.level, d.acts) for d in back] == [
        ("spike", 310, 296, 1.0, False)
    ]
    assert det.open_rules() == []
    det = Detector(Params(factor=3.0, steps=3, recover_steps=50), world=1)
    # The dead-ReLU case of the issue: the loss jumps to ln 5 and stays there.
    stays = feed(det, [0], range(5, 600, 5), lambda r, s: math.log(5) if s >= 300 else 0.3)
    assert [(d.rule, d.first_step) for d in stays] == [("spike", 296), ("divergence", 296)]
    div = stays[1]
    assert div.acts and div.step >= 350 and div.level == pytest.approx(0.3)
    assert "not back under" in div.text


def test_one_odd_sample_is_never_a_spike_and_bad_values_are_refused():
    det = Detector(world=1)
    odd = {300: 1e308, 310: -0.0, 320: 0}
    assert feed(det, [0], range(5, 600, 5), lambda r, s: odd.get(s, 1.0)) == []
    for bad in ("1.5", [1.0] * 10**5, True, {"a": 1}, 10**400):
        det.observe(0, beat(700, bad), 2.0)
        det.observe(0, {"global_step": "x", "loss": 1.0}, 2.0)
    assert det.take() == [] and det.refused >= 5 and "not" in det.last_refusal
    det.observe(0, None, 3.0)
    det.observe(10**9, beat(800, 1.0), 3.0)


def test_a_norm_spike_and_a_lone_overflow():
    det = Detector(Params(steps=3), world=1)
    got = feed(det, [0], range(5, 300, 5), lambda r, s: 1.0)
    for step in range(5, 300, 5):
        det.observe(0, beat(step + 1000, 1.0, norm=2.0), 1.0)
    det.observe(0, beat(1400, 1.0, norm=math.inf), 1.0)  # a loss-scale overflow: one sample
    det.observe(0, beat(1405, 1.0, norm=2.0), 1.0)
    assert det.take() == got == []
    for step in (1500, 1505, 1510):
        det.observe(0, beat(step, 1.0, norm=50.0), 1.0)
    (d,) = det.take()
    assert (d.rule, d.step, d.first_step, d.value, d.level, d.acts) == (
        "grad_norm",
        1510,
        1406,
        50.0,
        2.0,
        False,
    )


def test_batches_far_above_a_low_level_but_inside_the_windows_spread_are_noise(monkeypatch):
    """The demo's curve in small (its steps 800 to 1,200): a median near 0.3 whose 90th percentile is near
    twice it, and batches at 3.5x the median now and then, even three in a row. The factor alone calls
    those a spike; the window's upper spread says they are its noise."""
    spread = [0.15, 0.2, 0.25, 0.28, 0.3, 0.35, 0.4, 0.45, 0.55, 0.6]
    tail = {400: 1.1, 405: 1.05, 600: 1.05, 605: 1.1, 610: 1.0}

    def noise(r, s):
        return tail.get(s, spread[(s * 7 // 5) % 10])

    assert feed(Detector(world=1), [0], range(5, 1000, 5), noise) == []
    with monkeypatch.context() as m:
        m.setattr(
            spikewindow, "NOISE_K", 0.0
        )  # the factor alone: the three heavy batches in a row are a spike
        assert [(d.rule, d.step) for d in feed(Detector(world=1), [0], range(5, 1000, 5), noise)] == [
            ("spike", 610)
        ]
    # In the same noise a dead net (ln 10, seven times the level) is a spike, then a divergence.
    dead = feed(
        Detector(world=1), [0], range(5, 1000, 5), lambda r, s: math.log(10) if s >= 500 else noise(r, s)
    )
    assert [(d.rule, d.first_step) for d in dead] == [("spike", 496), ("divergence", 496)]
    assert dead[0].step == 510


def test_a_window_of_forged_extremes_leaves_the_factor_to_judge():
    series = spikewindow.Series()
    for value in [-1e308] * 28 + [1e308] * 4:  # the 90th percentile falls between them: it overflows
        series.add(value)
    assert series.spread(1.0) == 0.0
    for value in [1.0] * 32:
        series.add(value)
    assert series.spread(1.0) == 0.0 and series.abnormal(3.5, 1.0, 3.0) and not series.abnormal(2.5, 1.0, 3.0)


def test_a_new_launch_starts_over():
    det = Detector(world=1)
    feed(det, [0], range(5, 200, 5), lambda r, s: math.nan if s >= 100 else 1.0)
    assert det.open_rules() == ["nonfinite"]
    det.observe(0, beat(50, 1.0, launch="L2"), 1.0)
    assert det.open_rules() == []


def test_mindformers_norm_file_is_read_bounded_and_validated(tmp_path):
    (tmp_path / "output").mkdir()
    path = tmp_path / "output" / "abnormal_global_norm.json"
    path.write_text(json.dumps({"120": [45.7, 44.1], "130": [46.0]}))
    norms, why = read_mindformers(tmp_path)
    assert norms == {120: 45.7, 130: 46.0} and why is None
    det = Detector()
    det.mindformers(norms, 1.0)
    det.mindformers(norms, 2.0)  # each step once
    assert [(d.rule, d.step, d.source) for d in det.take()] == [
        ("grad_norm", 120, "mindformers"),
        ("grad_norm", 130, "mindformers"),
    ]
    for bad in ("[1]", '{"x": [1]}', '{"5": ["a"]}', "{", "9" * 70_000):
        path.write_text(bad)
        norms, why = read_mindformers(tmp_path)
        assert norms == {} and why
    path.unlink()
    path.symlink_to("/etc/passwd")
    assert read_mindformers(tmp_path)[0] == {}
