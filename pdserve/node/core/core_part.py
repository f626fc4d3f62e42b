"""What a node kind plugs into its engine-core process, declared by its front without loading it.

To the shared machinery a node kind is three things: the engine's scheduling policy, the KV
stages its node core runs (pdserve/node/core/node_core.py: a decode node's import, a prefill node's export;
none for a colocated node) and whether its node core computes prompts of its own. Its front
declares them in one `CorePart` (a row of pdserve/node_kinds.py), e.g.

    CorePart(PrefillPolicy, stages=("pdserve.prefill_node.kv_export:make_stage",), local_prefill=False)

The policy class is light (no torch) and named directly. A stage's module loads the engine and a
KV transport, so the part names its factory as "module:function" and only the engine-core
process imports it (`load_stage_factories`). A kind with stages starts a KV transport; one
without starts none. The kinds import this module, never pdserve/node/core/core_loop.py, and the core loop
gets the part as an argument: no import cycle, and a front that never loads torch.

Must never: import torch, the engine core or a KV transport at module level.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.node.messages import Message

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineCoreOutput
    from pdserve.engine.policy import SchedulingPolicy
    from pdserve.node.config import NodeConfig
    from pdserve.ranks.kv_ranks import NodeKVDescriptor, RankedTransport
    from pdserve.node.core.node_core import KVStage, NodeCore

ToFront = Callable[[Message], None]
"""Sends one message from the engine core to its front (in tests: a list's `append`)."""


class CoreHandler(Protocol):
    """What the core loop drives: the node core (pdserve/node/core/node_core.py), whatever the kind."""

    def handle(self, msg: Message) -> None:
        """A request-level message from the front (submit / abort)."""

    def after_step(self, outputs: list[EngineCoreOutput]) -> None:
        """The engine just stepped (possibly sampling nothing)."""

    def poll(self, now: float) -> None:
        """Advance transfers, take done messages, enforce leases."""

    def fail(self, req_id: str, message: str) -> None:
        """A step this engine request was in raised: answer its caller RequestFailed(INTERNAL,
        message) and free everything the request holds here."""

    def wants_fast_poll(self) -> bool:
        """Is something outstanding that only polling advances, and soon (push acknowledgements)?"""

    def num_blocks_outside_scheduler(self) -> int:
        """Blocks this core holds that no scheduled request does (a decode node's reservations,
        a prefill node's blocks awaiting push acknowledgements); stats report them as reserved."""


class MakeStage(Protocol):
    """A KV stage's factory, called in the engine-core process once the node core exists."""

    def __call__(self, config: NodeConfig, core: NodeCore, transport: RankedTransport,
                 descriptor: NodeKVDescriptor) -> KVStage: ...


@dataclass(frozen=True)
class CorePart:
    policy: type[SchedulingPolicy]
    stages: tuple[str, ...] = ()  # "module:function" MakeStage factories; imported by the core process only
    local_prefill: bool = True  # does the node core compute prompts of its own (a `Generate` call)?

    def __post_init__(self) -> None:
        for stage in self.stages:
            module, _, function = stage.partition(":")
            if not module or not function:
                raise ValueError(f"a stage must be 'module:function', got {stage!r}")

    @property
    def uses_kv_transport(self) -> bool:
        """A kind with KV stages moves KV between nodes; one without starts no KV listener."""
        return bool(self.stages)

    def load_stage_factories(self) -> list[MakeStage]:
        """Import each stage's module (engine-core process only: they load torch)."""
        factories = []
        for stage in self.stages:
            module, _, function = stage.partition(":")
            factory = getattr(importlib.import_module(module), function, None)
            if not callable(factory):
                raise TypeError(f"{stage} is not a KV stage factory")
            factories.append(factory)
        return factories
