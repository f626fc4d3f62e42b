"""Starting a node's engine-core process, from the front: light imports only.

Owns the core's spawn (multiprocessing "spawn" context) and its IPC addresses; the node
kind's part of the core travels to the child as a `CorePart` (pdserve/node/core/core_part.py). The
front imports this module, so it must stay free of torch and transformers: the process
target imports the heavy loop (pdserve/node/core/core_loop.py) only once it runs in the child.

Must never: import the engine, the model or a KV transport at module level.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path

from pdserve.common.affinity import pin_to_cpus
from pdserve.node.config import NodeConfig
from pdserve.node.core.core_part import CorePart


@dataclass(frozen=True)
class CoreAddresses:
    to_core: str  # front PUSH (bind) -> core PULL (connect)
    from_core: str  # core PUSH (connect) -> front PULL (bind)

    @classmethod
    def in_dir(cls, folder: str | Path) -> CoreAddresses:
        return cls(to_core=f"ipc://{Path(folder) / 'to_core.sock'}",
                   from_core=f"ipc://{Path(folder) / 'from_core.sock'}")


def start_core(config: NodeConfig, addresses: CoreAddresses, part: CorePart) -> BaseProcess:
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_core_entry, args=(config, addresses, part, os.getpid()),
                       name=f"pdserve-{config.kind}-core", daemon=True)
    proc.start()
    return proc


def _core_entry(config: NodeConfig, addresses: CoreAddresses, part: CorePart, front_pid: int) -> None:
    # Ctrl-C reaches the whole process group; the front answers it (Shutdown). Ignored from
    # here, not only in the loop: a Ctrl-C while torch imports would print a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pin_to_cpus(config.cpus)  # before torch starts its thread pool
    from pdserve.node.core.core_loop import core_main  # torch, transformers, UCX: the child only

    core_main(config, addresses, part, front_pid)
