"""Device metrics. ``npu-smi`` and ``nvidia-smi`` cannot exist here, so they are mocked:
fake executables on PATH that print what the real tools print."""

from __future__ import annotations

import logging
import stat
import sys

import pytest

from tests.helpers.app import wait_for
from tests.helpers.heartbeats import heartbeat, write_heartbeat, write_job
from trainer_bridge.device import DeviceProbe, parse_npu_smi, parse_nvidia_smi
from trainer_bridge.rundir import schema

NPU_SMI_INFO = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc2                 Version: 23.0.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B1               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
| 1     910B1               | Warning       | 96.1        47                0    / 0             |
| 0                         | 0000:C2:00.0  | 87          0    / 0          61024 / 65536        |
+===========================+===============+====================================================+
"""

NVIDIA_CSV = "0, 35, 1024, 81920, 51\n1, 99, 80000, 81920, 77\n"


def test_parse_npu_smi_picks_this_rank_device():
    d = parse_npu_smi(NPU_SMI_INFO, 1)
    assert d == {
        "kind": "npu",
        "index": 1,
        "util_percent": 87.0,
        "mem_used_bytes": 61024 * 2**20,
        "mem_total_bytes": 65536 * 2**20,
        "temp_c": 47.0,
        "health": "Warning",
    }
    assert parse_npu_smi(NPU_SMI_INFO, 5) is None
    assert parse_npu_smi("garbage", 0) is None


def test_parse_nvidia_smi():
    d = parse_nvidia_smi(NVIDIA_CSV, 1)
    assert d["util_percent"] == 99.0 and d["mem_used_bytes"] == 80000 * 2**20 and d["temp_c"] == 77.0
    assert parse_nvidia_smi("", 0) is None


def _fake_tool(directory, name, output, code=0):
    path = directory / name
    path.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.write({output!r})\nsys.exit({code})\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_probe_reads_a_mocked_npu_smi(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "npu-smi", NPU_SMI_INFO)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DEVICE_ID", "0")
    probe = DeviceProbe()
    assert probe.enabled
    assert probe.sample()["health"] == "OK"


def test_probe_switches_off_without_tools(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="trainer_bridge"):
        probe = DeviceProbe()
    assert not probe.enabled and probe.sample() is None
    assert "device metrics are off" in caplog.text


def test_probe_switches_off_when_the_tool_fails(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "nvidia-smi", "NVIDIA-SMI has failed\n", code=9)
    monkeypatch.setenv("PATH", str(tmp_path))
    probe = DeviceProbe()
    assert probe.sample() is None and not probe.enabled


# ------------------------------------------------------------------ a bad figure keeps the heartbeat

NPU_SMI_BAD = """\
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B1               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 101         0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
| 1     910B1               | OK            | 93.6        -500              0    / 0             |
| 0                         | 0000:C2:00.0  | -5          0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
| 2     910B1               | OK            | 93.6        ##                0    / 0             |
| 0                         | 0000:C3:00.0  | x%@!        0    / 0          3395 / 65536         |
+===========================+===============+====================================================+
"""


@pytest.mark.parametrize(
    ("device_id", "dropped"),
    [
        ("0", ["util_percent 101.0"]),
        ("1", ["temp_c -500.0", "util_percent -5.0"]),
        ("2", ["temp_c '##'", "util_percent 'x%@!'"]),
    ],
)
def test_an_out_of_range_device_figure_is_left_out_and_the_heartbeat_kept(
    tmp_path, monkeypatch, device_id, dropped
):
    _fake_tool(tmp_path, "npu-smi", NPU_SMI_BAD)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DEVICE_ID", device_id)
    sample = DeviceProbe().sample()
    # The reporter's own call: schema.build(Heartbeat, ..., device=the sample).
    fields = heartbeat(0, 1, validate=False)
    fields["device"] = sample
    beat = schema.build(schema.Heartbeat, **fields)
    assert beat.device is not None and beat.device.kind == "npu" and beat.device.index == int(device_id)
    assert beat.device.mem_used_bytes == 3395 * 2**20 and beat.device.health == "OK"
    assert beat.device.util_percent is None
    notes = [w for w in beat.warnings if w.startswith("device ")]
    assert notes == [f"device {d} is out of range or not a number; left out" for d in dropped], notes


def test_the_dashboard_keeps_a_row_whose_device_figure_is_out_of_range(client, run_dir):
    write_job(run_dir, 2)
    write_heartbeat(run_dir, heartbeat(0, 2))
    bad = heartbeat(1, 2, validate=False)
    bad["device"] = {"kind": "npu", "index": 1, "util_percent": 101.0, "temp_c": 47.0, "health": "OK"}
    bad["warnings"] = [f"old warning {i}" for i in range(schema.MAX_WARNINGS)]
    write_heartbeat(run_dir, bad, history=False)
    row = client.get("/api/ranks").get_json()["ranks"][1]
    assert row["health"] not in ("pending", "dead") and row["global_step"] == bad["global_step"], row
    assert row["device"] == "npu:1" and row["device_temp_c"] == 47.0 and row["device_util_percent"] is None
    # The note is the newest warning; the oldest makes room for it.
    assert row["warnings"][-1] == "device util_percent 101.0 is out of range or not a number; left out"
    assert len(row["warnings"]) == schema.MAX_WARNINGS and "old warning 0" not in row["warnings"]

    bad["device"] = {"kind": "tpu", "index": 1}
    bad["seq"] += 1
    write_heartbeat(run_dir, bad, history=False)
    row = wait_for(
        lambda: (r := client.get("/api/ranks").get_json()["ranks"][1])["device_health"] is None and r,
        "the heartbeat without a device",
    )
    assert row["device"] is None and row["global_step"] == bad["global_step"]
    assert row["warnings"][-1].startswith("device left out: kind:")


def test_a_sample_that_must_not_block_runs_the_tool_on_a_thread_of_its_own(tmp_path, monkeypatch):
    # The reporter's work may run on the training thread, which must never wait for npu-smi:
    # this npu-smi waits for a file the test writes only after the probe has answered.
    go = tmp_path / "go"
    tool = tmp_path / "npu-smi"
    tool.write_text(
        f"#!{sys.executable}\nimport os, sys, time\n"
        f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.01)\n"
        f"sys.stdout.write({NPU_SMI_INFO!r})\n"
    )
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("DEVICE_ID", "0")
    probe = DeviceProbe()
    assert probe.sample(block=False) is None  # nothing yet, and no wait for the tool
    go.write_text("")
    probe._refreshing.join(60)
    assert not probe._refreshing.is_alive()
    assert probe.sample(block=False)["health"] == "OK"
