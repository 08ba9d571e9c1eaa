"""Device metrics. ``npu-smi`` and ``nvidia-smi`` cannot exist here, so they are mocked:
fake executables on PATH that print what the real tools print."""

from __future__ import annotations

import logging
import stat
import sys

from trainer_bridge.device import DeviceProbe, parse_npu_smi, parse_nvidia_smi

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
