"""What a node kind plugs into its engine-core process, declared by its front without loading it.

To the shared machinery a node kind is three things: the engine's scheduling policy, a
`CoreHandler` (the kind's request-level logic: submit and abort messages, what follows
each engine step, polling transfers and leases) and whether it moves KV between nodes.
Its front declares them in one `CorePart`, e.g.

    CorePart(PrefillPolicy, "pdserve.prefill_node.core:make_handler")

The policy class is light (no torch) and named directly. The handler's module loads the
engine and a KV transport, so the front names its factory as "module:function" and only
the engine-core process imports it (`load_handler_factory`). The kinds import this
module, never node/core_loop.py, and the core loop gets the part as an argument: no
import cycle, and a front that never loads torch.

Must never: import torch, the engine core or a KV transport at module level.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.node.messages import Message

if TYPE_CHECKING:
    from pdserve.engine.engine_core import EngineCore, EngineCoreOutput
    from pdserve.engine.policy import SchedulingPolicy
    from pdserve.node.kv_ranks import NodeKVDescriptor, RankedTransport
    from pdserve.node.config import NodeConfig

ToFront = Callable[[Message], None]
"""Sends one message from the engine core to its front (in tests: a list's `append`)."""


class CoreHandler(Protocol):
    """What differs between the engine cores of the node kinds, driven by the core loop."""

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


class MakeHandler(Protocol):
    """A node kind's handler factory; transport and descriptor are None for a kind that moves no KV."""

    def __call__(self, config: NodeConfig, engine: EngineCore, transport: RankedTransport | None,
                 descriptor: NodeKVDescriptor | None, to_front: ToFront) -> CoreHandler: ...


@dataclass(frozen=True)
class CorePart:
    policy: type[SchedulingPolicy]
    handler: str  # "module:function", a MakeHandler; imported by the engine-core process only
    uses_kv_transport: bool = True  # False: the core starts no KV listener (colocated)

    def __post_init__(self) -> None:
        module, _, function = self.handler.partition(":")
        if not module or not function:
            raise ValueError(f"handler must be 'module:function', got {self.handler!r}")

    def load_handler_factory(self) -> MakeHandler:
        """Import the handler's module (engine-core process only: it loads torch)."""
        module, _, function = self.handler.partition(":")
        factory = getattr(importlib.import_module(module), function, None)
        if not callable(factory):
            raise TypeError(f"{self.handler} is not a core handler factory")
        return factory
