"""Stack captures and alerts as the incident tests craft them: a hanging script, fake captures, a webhook record."""

from __future__ import annotations

import time

from trainer_bridge.rundir import stackfiles

HANGER = """
import sys, threading, time
def hang_here():
    print("ready", flush=True)
    while True:
        time.sleep(3600)
def side():
    time.sleep(3600)
threading.Thread(target=side, name="side-worker", daemon=True).start()
hang_here()
"""


def fake_capture(run_dir, rank: int, frames: list[tuple], native: list[str] = (), at: float | None = None):
    threads = [
        {
            "id": 1000 + rank,
            "name": "MainThread",
            "training": True,
            "frames": [{"function": f, "file": p, "line": n, "code": None} for f, p, n in frames],
            "omitted": 0,
            "native": [{"function": f, "file": "libmindspore_cluster.so", "line": 0} for f in native],
        }
    ]
    capture = stackfiles.build_capture(
        rank=rank,
        captured_at=at or time.time(),
        source="bridge",
        trigger="stall",
        threads=threads,
    )
    stackfiles.write_capture(run_dir, capture)


LIB = "/venv/lib/python3.11/site-packages/mindspore"


HUNG = [("hang_here", "/job/train.py", 42), ("Hang.on_train_step_end", "/job/train.py", 50)]


WAITING = [
    ("_CellGraphExecutor._exec_pip", f"{LIB}/graph/api.py", 2432),
    ("Model._train_process", f"{LIB}/train/model.py", 1265),
    ("main", "/job/train.py", 230),
]


COLLECTIVE = ["pthread_cond_timedwait", "mindspore::fl::server::CollectiveOpsImpl::AllReduce<float>"]


class Sent:
    """A stand-in sender that records payloads: the desk's decisions, without the network."""

    enabled = True
    version = 0

    def __init__(self):
        self.payloads = []

    def send(self, payload, dedup_key=None):
        self.payloads.append(payload)

    def was_sent(self, key):
        return False
