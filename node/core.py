"""Starting a node's engine-core process, from the front: light imports only.

Owns the core's spawn (multiprocessing "spawn" context), its IPC addresses and the hooks
naming the node kind's core module. The front imports this module, so it must stay
free of torch and transformers: the process target imports the heavy loop
(node/core_loop.py) only once it runs in the child.

Must never: import the engine, the model or a KV transport at module level.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

from pdserve.node.affinity import pin_to_cpus
from pdserve.node.config import NodeConfig


@dataclass(frozen=True)
class CoreHooks:
    """Names the module holding a node kind's core part.

    It must define `make_policy(config) -> SchedulingPolicy` and
    `make_handler(config, engine, transport, descriptor, emit) -> CoreHandler`; the core
    process imports it, so the front never does. A kind that moves no KV between nodes
    (colocated) says `uses_kv_transport=False`: its core starts no transport listener and
    its handler gets `None` for the transport and the descriptor.
    """

    module: str
    uses_kv_transport: bool = True


@dataclass(frozen=True)
class CoreAddresses:
    to_core: str  # front PUSH (bind) -> core PULL (connect)
    from_core: str  # core PUSH (connect) -> front PULL (bind)

    @classmethod
    def in_dir(cls, folder: str | Path) -> CoreAddresses:
        return cls(to_core=f"ipc://{Path(folder) / 'to_core.sock'}",
                   from_core=f"ipc://{Path(folder) / 'from_core.sock'}")


def start_core(config: NodeConfig, addresses: CoreAddresses, hooks: CoreHooks) -> BaseProcess:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_core_entry, args=(config, addresses, hooks, os.getpid()),
                       name=f"pdserve-{config.kind}-core", daemon=True)
    proc.start()
    return proc


def _core_entry(config: NodeConfig, addresses: CoreAddresses, hooks: CoreHooks, front_pid: int) -> None:
    pin_to_cpus(config.cpus)  # before torch starts its thread pool
    from pdserve.node.core_loop import core_main  # torch, transformers, UCX: the child only

    core_main(config, addresses, hooks, front_pid)
