"""A NaN or infinite loss (or grad norm) is written as valid JSON and read back, old files too (issue 34)."""

from __future__ import annotations

import json
import math

import pytest

from app.run.health import Verdict
from app.run.rows import make_row
from tests.helpers.heartbeats import heartbeat
from trainer_bridge.reporter import _scalar
from trainer_bridge.rundir import schema


@pytest.mark.parametrize(("value", "name"), [(math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf")])
def test_a_nonfinite_loss_is_null_plus_its_name_in_strict_json(value, name):
    beat = schema.build(schema.Heartbeat, **(heartbeat(0, 1) | {"loss": value, "grad_norm": value}))
    raw = beat.to_json()
    # Strict JSON: a reader without the NaN extension (a browser, jq) accepts it.
    obj = json.loads(raw, parse_constant=lambda c: pytest.fail(f"JSON constant {c} written"))
    assert obj["loss"] is None and obj["loss_nonfinite"] == name
    assert obj["grad_norm"] is None and obj["grad_norm_nonfinite"] == name
    line = schema.HistoryLine.of(beat).to_json()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(c))["loss_nonfinite"] == name
    again = schema.parse(schema.Heartbeat, raw)
    assert again.loss is None and again.loss_nonfinite == name


@pytest.mark.parametrize(("constant", "name"), [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf")])
def test_files_written_before_read_the_same(constant, name):
    old = json.dumps(heartbeat(0, 1) | {"loss": "@@"}).replace('"@@"', constant)
    beat = schema.parse(schema.Heartbeat, old)
    assert beat.loss is None and beat.loss_nonfinite == name
    line = schema.parse(schema.HistoryLine, f'{{"time": 1, "global_step": 3, "loss": {constant}}}')
    assert line.loss is None and line.loss_nonfinite == name


def test_a_finite_loss_wins_over_a_stale_flag_and_odd_values_are_judged():
    beat = schema.parse(
        schema.Heartbeat, json.dumps(heartbeat(0, 1) | {"loss": 2.5, "loss_nonfinite": "nan"})
    )
    assert (beat.loss, beat.loss_nonfinite) == (2.5, None)
    for ok in (1e308, -0.0, 0):
        assert schema.parse(schema.Heartbeat, json.dumps(heartbeat(0, 1) | {"loss": ok})).loss == ok
    for bad, field in (
        ('"1.5"', "loss"),
        ("[1, 2]", "loss"),
        ('"huge"', "loss_nonfinite"),
        ("-1", "grad_norm"),
    ):
        text = json.dumps(heartbeat(0, 1) | {"loss": None, field: "@@"}).replace('"@@"', bad)
        with pytest.raises(schema.SchemaError, match=field):
            schema.parse(schema.Heartbeat, text)


def test_the_row_names_the_nonfinite_loss():
    beat = schema.build(schema.Heartbeat, **(heartbeat(0, 1) | {"loss": math.nan})).to_dict()
    row = make_row(0, beat, Verdict("healthy", "", None))
    assert row["loss"] is None and row["loss_nonfinite"] == "nan"
    json.dumps(row, allow_nan=False)


def test_the_reporter_keeps_nan_and_refuses_what_is_no_number():
    assert math.isnan(_scalar(math.nan)) and _scalar(3) == 3.0
    assert _scalar("x") is None and _scalar(True) is None and _scalar(None) is None
