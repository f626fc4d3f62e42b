"""What a preempted request gives up: its KV (recompute) or only its device blocks (swap).

The scheduler picks the victim; the `PreemptionPolicy` (--preemption-mode) says how it is
preempted:

- `RecomputePreemption` (recompute): the victim's blocks are freed and it waits to compute
  its tokens again (what survives is what the prefix cache still holds).
- `SwapPreemption` (swap): the victim's computed blocks are copied to the host swap space
  (pdserve/engine/swap_space.py) and swapped back in, unchanged, when the device pool has room. A
  victim the swap space cannot hold now is recomputed, with a warning: swap was asked for,
  so running short of swap space is worth saying.
- `AutoPreemption` (auto, the default): swap when the swap space holds the victim, recompute
  otherwise, silently; with no swap space (--swap-space-bytes 0, the default) it recomputes.

Must never: choose victims, move requests between queues, or copy blocks.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

from pdserve.engine.config import PREEMPTION_MODES
from pdserve.engine.request import Request
from pdserve.engine.swap_space import SwapSpace

logger = logging.getLogger(__name__)


class PreemptionPolicy(ABC):
    def __init__(self, swap: SwapSpace | None = None) -> None:
        self.swap = swap or SwapSpace(0)

    @abstractmethod
    def swaps(self, victim: Request, num_blocks: int) -> bool:
        """Swap `victim`, whose computed KV fills `num_blocks` blocks, out (else recompute)?"""


class RecomputePreemption(PreemptionPolicy):
    def swaps(self, victim: Request, num_blocks: int) -> bool:
        return False


class SwapPreemption(PreemptionPolicy):
    def swaps(self, victim: Request, num_blocks: int) -> bool:
        if self.swap.can_hold(num_blocks):
            return True
        logger.warning("request %s: %d blocks do not fit the swap space (%d of %d free, --swap-space-bytes): "
                       "recomputed instead", victim.req_id, num_blocks, self.swap.num_free_blocks, self.swap.num_blocks)
        return False


class AutoPreemption(PreemptionPolicy):
    def swaps(self, victim: Request, num_blocks: int) -> bool:
        return self.swap.can_hold(num_blocks)


def preemption_policy_for(mode: str, swap: SwapSpace) -> PreemptionPolicy:
    policies: dict[str, type[PreemptionPolicy]] = {
        "auto": AutoPreemption, "swap": SwapPreemption, "recompute": RecomputePreemption}
    return policies[mode](swap)
