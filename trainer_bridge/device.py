"""Device metrics from ``npu-smi`` (Ascend) or ``nvidia-smi`` (GPU), where one exists.

With neither on PATH the feature switches itself off with one log line. Both
tools take tens of milliseconds, so the probe samples at most every
``interval_s``, and the reporter asks without blocking: the heartbeat
carries the last sample while a short-lived thread takes the next. The
reporter's work may run on the training thread (``reporter.py``), which
must never wait for a device tool.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import threading
import time

log = logging.getLogger("trainer_bridge")

NVIDIA_QUERY = "index,utilization.gpu,memory.used,memory.total,temperature.gpu"


def local_device_index() -> int:
    """This process's device: msrun's local rank, else DEVICE_ID, else 0."""
    for name in ("DEVICE_ID", "LOCAL_RANK", "MS_LOCAL_RANK_ID"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def parse_nvidia_smi(text: str, index: int) -> dict | None:
    """Parse ``nvidia-smi --query-gpu=NVIDIA_QUERY --format=csv,noheader,nounits``."""
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 5 or not fields[0].isdigit() or int(fields[0]) != index:
            continue
        util, used, total, temp = (_number(f) for f in fields[1:])
        return {
            "kind": "gpu",
            "index": index,
            "util_percent": util,
            "mem_used_bytes": int(used * 2**20) if used is not None else None,
            "mem_total_bytes": int(total * 2**20) if total is not None else None,
            "temp_c": temp,
            "health": None,
        }
    return None


def parse_npu_smi(text: str, index: int) -> dict | None:
    """Parse the table printed by ``npu-smi info``.

    Each NPU takes two table rows::

        | 0     910B1               | OK            | 93.6        40                0    / 0             |
        | 0                         | 0000:C1:00.0  | 0           0    / 0          3395 / 65536         |

    The first gives NPU id, name, health, power (W), temperature (C); the
    second gives chip, bus id, AI core utilisation (%) and HBM used / total (MB).
    """
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and line.count("|") >= 4
    ]
    for first, second in zip(rows, rows[1:], strict=False):
        head = first[0].split()
        if len(head) < 2 or not head[0].isdigit() or int(head[0]) != index:
            continue
        if first[1] not in ("OK", "Warning", "Alarm", "Critical", "Error"):
            continue
        power_temp = first[2].split()
        usage = second[2].split() if len(second) > 2 else []
        hbm = re.findall(r"(\d+)\s*/\s*(\d+)", second[2]) if len(second) > 2 else []
        used, total = (int(hbm[-1][0]), int(hbm[-1][1])) if hbm else (None, None)
        return {
            "kind": "npu",
            "index": index,
            "util_percent": _figure(usage[0]) if usage else None,
            "mem_used_bytes": used * 2**20 if used is not None else None,
            "mem_total_bytes": total * 2**20 if total is not None else None,
            "temp_c": _figure(power_temp[1]) if len(power_temp) > 1 else None,
            "health": first[1],
        }
    return None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _figure(text: str) -> float | str:
    """A number as printed, or the text itself (cut): ``schema.clean_device`` leaves out what is
    not a figure in range, and the heartbeat's warnings say what the tool printed."""
    value = _number(text)
    return value if value is not None else text[:40]


class DeviceProbe:
    """Samples this rank's device, or returns None for ever if there is no tool."""

    def __init__(self, interval_s: float = 5.0, timeout_s: float = 3.0):
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.index = local_device_index()
        self._tool = shutil.which("npu-smi") and "npu-smi" or shutil.which("nvidia-smi") and "nvidia-smi"
        if not self._tool:
            log.info("rankwatch: no npu-smi or nvidia-smi on PATH; device metrics are off")
        self._last: dict | None = None
        self._due = 0.0
        self._refreshing: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return bool(self._tool)

    def sample(self, block: bool = True) -> dict | None:
        """The device's figures, at most ``interval_s`` old.

        ``block=False`` returns the last sample at once and, when one is due,
        takes the next on a thread of its own (alive for the tool's run only).
        """
        if not self._tool or time.monotonic() < self._due:
            return self._last
        self._due = time.monotonic() + self.interval_s
        if block:
            self._refresh()
        elif not (self._refreshing and self._refreshing.is_alive()):
            self._refreshing = threading.Thread(target=self._refresh, name="rankwatch-device", daemon=True)
            self._refreshing.start()
        return self._last

    def _refresh(self) -> None:
        tool = self._tool
        try:
            if tool == "npu-smi":
                out = subprocess.run(
                    ["npu-smi", "info"], capture_output=True, text=True, timeout=self.timeout_s, check=True
                ).stdout
                self._last = parse_npu_smi(out, self.index)
            elif tool:
                out = subprocess.run(
                    ["nvidia-smi", f"--query-gpu={NVIDIA_QUERY}", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=self.timeout_s,
                    check=True,
                ).stdout
                self._last = parse_nvidia_smi(out, self.index)
        except (OSError, subprocess.SubprocessError) as e:
            log.warning("rankwatch: %s failed (%s); device metrics are off", tool, e)
            self._tool = None
            self._last = None
