"""What a simulated cluster is: its pools of nodes, the router's choice between them, and the machine.

A `ClusterSpec` is a colocated pool, or a prefill and a decode pool (the decode nodes may be the
prefill pool too, `serve_prefill`); each `Pool` is a count of nodes running one engine config with
one profile's step times. `pdserve plan` builds one per candidate layout (pdserve/planner/search.py),
the load mode one per split (pdserve/planner/load_mode.py), and the simulator
(pdserve/planner/simulator.py) runs it.

Pure data and its checks: no clock, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from pdserve.engine.config import EngineConfig
from pdserve.planner.profile import Profile, ServingCosts
from pdserve.router.dispatch.hybrid import PrefillChoice


@dataclass(frozen=True)
class Pool:
    """`count` nodes, each running `config` with the step times of `profile`."""

    count: int
    config: EngineConfig
    profile: Profile

    @property
    def cores_per_node(self) -> int:
        """Each node's `num_threads`, 1 when unset."""
        return self.config.num_threads or 1


@dataclass(frozen=True)
class ClusterSpec:
    colocated: Pool | None = None
    prefill: Pool | None = None
    decode: Pool | None = None
    costs: ServingCosts = ServingCosts()
    # Decode nodes started with `--local-prefill`, and the router's `--disaggregation` choice
    # between them and the prefill pool; None: every request of a pair is disaggregated.
    local_prefill: PrefillChoice | None = None
    # Decode nodes started with `--serve-prefill`: they are the prefill pool (no prefill pool of
    # its own), and local_prefill is the router's choice.
    serve_prefill: bool = False
    # The pool whose cores the router (and a client on this machine) is pinned to: "prefill" or
    # "decode"; None: unpinned, it runs where the OS finds an idle core.
    stack_on: str | None = None
    # The cores the whole cluster runs on, when the nodes' threads outnumber them (unpinned nodes
    # sharing the machine, pdserve/planner/core_sharing.py); None or as many as the nodes': each
    # node has cores of its own.
    machine_cores: int | None = None

    def __post_init__(self) -> None:
        prefill_pool = self.decode if self.serve_prefill else self.prefill
        if (self.colocated is None) == (prefill_pool is None or self.decode is None):
            raise ValueError("a cluster is a colocated pool, or a prefill and a decode pool")
        if self.local_prefill is not None and self.colocated is not None:
            raise ValueError("local_prefill is for a cluster of a prefill and a decode pool")
        if self.serve_prefill and (self.prefill is not None or self.local_prefill is None):
            raise ValueError("serve_prefill: the decode nodes are the prefill pool (no prefill pool), "
                             "and local_prefill is the router's choice")
        if self.stack_on is not None and getattr(self, self.stack_on, None) is None:
            raise ValueError(f"stack_on: {self.stack_on!r} is not a pool of this cluster")
        if self.machine_cores is not None and self.machine_cores < 1:
            raise ValueError(f"machine_cores must be at least 1, got {self.machine_cores}")

    def with_step_scales(self, scales: Mapping[str, float]) -> ClusterSpec:
        """This cluster with each named pool's steps `scales[pool]` times as long as its profile's
        ("colocated", "prefill" or "decode": how fast a pool's steps really ran,
        pdserve/planner/step_speed.py)."""
        pools = {name: replace(pool, profile=replace(pool.profile, step=pool.profile.step.scaled(scale)))
                 for name, scale in scales.items() if (pool := getattr(self, name)) is not None}
        return replace(self, **pools)

    @property
    def node_cores(self) -> int:
        """The cores the nodes run on (each node's `num_threads`, 1 when unset)."""
        pools = (self.colocated, self.prefill, self.decode)
        return sum(p.count * p.cores_per_node for p in pools if p is not None)

    @property
    def shares_cores(self) -> bool:
        """Do the nodes' threads outnumber the machine's cores?"""
        return self.machine_cores is not None and self.machine_cores < self.node_cores

    @property
    def mode(self) -> str:
        if self.colocated is not None:
            return "colocated"
        return "disaggregated" if self.local_prefill is None else "hybrid"
