"""The facts every node behind one router must share, compared when a node registers.

Owns `RouterFacts` (what the router itself serves: the model, its `--block-size`, the KV shape
its model's config implies) and `disagreements`, the comparison of a registering node's
`NodeFingerprint` (node.proto: what its engine core runs, the fields the KV handshake compares)
with the router's facts and with the fingerprints of the nodes already registered.

Why each field is compared where:
- model, block_size, num_layers, num_kv_heads, head_dim: with the router. It tokenizes for one
  model, and counts blocks of its own block size for capacity checks, decode reservations and
  prefix affinity; a node with other blocks would silently skew all three.
- dtype, layout_version: with the nodes already registered, since the router computes nothing
  and has no dtype of its own. A prefill/decode pair whose KV differs could not move it (the
  KV handshake would refuse every transfer). Colocated nodes move no KV, yet are held to the
  same rule: a sample that loses its node resumes on another, and it continues exactly as an
  uninterrupted run (greedy and seeded alike) only if every node computes in the same dtype;
  a different layout version means a different pdserve release, which one router does not mix.

Pure: never logs, never calls a node, never changes the registry.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.proto import node_pb2

if TYPE_CHECKING:  # the registry imports this module; transformers stays out of it
    from pdserve.router.model import RouterModel

ROUTER_FIELDS = ("model", "block_size", "num_layers", "num_kv_heads", "head_dim")
CLUSTER_FIELDS = ("dtype", "layout_version")


@dataclass(frozen=True)
class RouterFacts:
    model: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: RouterModel, block_size: int) -> RouterFacts:
        return cls(model.name, block_size, model.num_layers, model.num_kv_heads, model.head_dim)


def disagreements(node: node_pb2.NodeFingerprint, router: RouterFacts,
                  others: Iterable[tuple[str, node_pb2.NodeFingerprint]]) -> list[str]:
    """One line per field that differs, naming both values: `block_size: this node has 16, the
    router 8`; `dtype: this node has float32, node d0 bfloat16` (the first other node that differs)."""
    lines = [f"{name}: this node has {getattr(node, name)}, the router {getattr(router, name)}"
             for name in ROUTER_FIELDS if getattr(node, name) != getattr(router, name)]
    others = list(others)
    for name in CLUSTER_FIELDS:
        other = next(((node_id, fp) for node_id, fp in others if getattr(fp, name) != getattr(node, name)), None)
        if other is not None:
            # `--dtype auto` is decided per machine, so nodes on different CPUs may differ.
            hint = " (set the same --dtype on every node)" if name == "dtype" else ""
            lines.append(f"{name}: this node has {getattr(node, name)}, node {other[0]} {getattr(other[1], name)}{hint}")
    return lines
