"""Who this rank is, and the one collective the engine's votes ride on.

``world()`` asks MindSpore's communication layer (one process alone when it
is not initialised); ``sum_all_reduce()`` compiles the float32 SUM
AllReduce over the world group that carries every vote
(``trainer_bridge.agreement``).
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when the communication layer is not initialised."""
    try:
        from mindspore.communication import get_group_size, get_rank

        return get_rank(), get_group_size()
    except (RuntimeError, ValueError):
        return 0, 1


class _SumAllReduce(nn.Cell):
    """float32 SUM AllReduce over the world group: the vote carrier."""

    def __init__(self):
        super().__init__()
        self.all_reduce = ops.AllReduce()

    def construct(self, x):
        return self.all_reduce(x)


def sum_all_reduce():
    """``vote_sum(a, b, c)``: the three floats summed over every rank."""
    cell = _SumAllReduce()
    op = ms.jit(cell.construct) if ms.get_context("mode") == ms.PYNATIVE_MODE else cell

    def vote_sum(a: float, b: float, c: float) -> tuple[float, float, float]:
        out = op(Tensor(np.array([a, b, c], np.float32))).asnumpy()
        return float(out[0]), float(out[1]), float(out[2])

    return vote_sum
