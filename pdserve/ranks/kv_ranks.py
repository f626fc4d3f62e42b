"""A node's KV transport over its tensor-parallel ranks: every rank pushes its own heads.

A node of T ranks has T KV caches, rank r holding a slice of the KV heads (pdserve/engine/parallel.py),
each behind its own rank-level `KVTransport` (UCX). Its `NodeKVDescriptor` lists the ranks'
descriptors, so a peer node sees the whole layout; its `layout_id` names that layout for one run
of the node (a node started again on the same addresses has another): what a request names.
Between a sending node and a receiving node the work is planned per rank pair (`plan_routes`):
each receiving rank gets each of its heads from the lowest sending rank that holds it, so a head
replicated on several sending ranks is sent once, and no bytes pass through rank 0. A node of one rank is the same thing with one route
per receiving rank.

`RankedTransport` is what the exporter and the decode core talk to (the node's side of the
`KVTransport` calls): `connect` opens every route's rank connection and answers one peer id for
the node pair; `push` and `send_done` fan out over the routes (a done message per route, each
behind that route's pushes, and `done_parts(peer)` says how many the receiver must collect before
the request's KV is whole); `guard_writes`, `poll_done`, the done callback and the counters span
every rank. Ranks other than 0 live in worker processes; pdserve/ranks/tp_group.py gives them a `RankLink`
that forwards these calls over the worker's ordered pipe.

Must never: gather another rank's KV onto rank 0, or pair two layouts that do not both cover the
model's KV heads.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.kv_transfer import (FingerprintMismatch, KVCacheSpec, KVDescriptor, KVTransferError, KVTransport,
                                 TransferHandle, TransferState, TransferStats, WritePermits)
from pdserve.kv_transfer.base import DoneCallback
from pdserve.kv_transfer.counters import sum_stats

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_loader import LoadedModel


def rank_cache_spec(engine: EngineConfig, loaded: LoadedModel) -> KVCacheSpec:
    """A rank's KV cache as peers see it. The model is named by its folder's name (`model_name`),
    so nodes on machines with different paths to the same model still match; the shape fields
    catch the rest. The dtype is the engine's resolved one (`--dtype auto` may differ between
    machines); the head range is the KV heads this rank caches."""
    from pdserve.engine.model_folder import model_name

    return KVCacheSpec(model=model_name(engine.model), dtype=engine.dtype, num_layers=loaded.num_layers,
                       num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim, block_size=engine.block_size,
                       head_range=loaded.local_kv_heads)


@dataclass(frozen=True)
class NodeKVDescriptor:
    """Every rank's descriptor, rank order: how a peer reaches a node's KV caches. JSON on the wire,
    once per node pair: a request names it by `layout_id`."""

    ranks: tuple[KVDescriptor, ...]
    epoch: str = ""  # this run of the node: its caches and listeners exist only while it runs

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a node KV descriptor needs at least one rank")

    @property
    def num_blocks(self) -> int:
        return self.ranks[0].num_blocks  # every rank has the node's block count

    @property
    def key(self) -> str:
        """The node's name among peers: its rank 0's (KVDescriptor.name)."""
        return self.ranks[0].name

    @property
    def layout_id(self) -> str:
        """The name a request gives this layout: the node's key and its run, so a layout fetched
        before the node restarted never names the restarted node's caches."""
        return f"{self.key}/{self.epoch}"

    @property
    def layout(self) -> list[tuple[int, int]]:
        return [d.spec.local_heads for d in self.ranks]

    def to_bytes(self) -> bytes:
        ranks = [json.loads(d.to_bytes()) for d in self.ranks]
        return json.dumps({"ranks": ranks, "epoch": self.epoch}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> NodeKVDescriptor:
        data = json.loads(raw)
        ranks = tuple(KVDescriptor.from_bytes(json.dumps(rank).encode()) for rank in data["ranks"])
        return cls(ranks, str(data["epoch"]))


def describe_layout(layout: Sequence[tuple[int, int]]) -> str:
    return f"tp={len(layout)} KV heads " + " ".join(f"[{a},{b})" for a, b in layout)


def check_pairing(local: NodeKVDescriptor, remote: NodeKVDescriptor) -> None:
    """The caches must match (every fingerprint field named, as a rank handshake does) and both
    layouts must cover the same KV heads; raises FingerprintMismatch naming both."""
    local.ranks[0].spec.check_compatible(remote.ranks[0].spec.fingerprint(), f"peer {remote.key}")
    def covered(desc: NodeKVDescriptor) -> set[int]:
        return {h for a, b in desc.layout for h in range(a, b)}

    totals = {d.spec.num_kv_heads for d in (*local.ranks, *remote.ranks)}
    if len(totals) == 1 and covered(local) == covered(remote) == set(range(totals.pop())):
        return
    raise FingerprintMismatch({"kv_layout": (describe_layout(local.layout), describe_layout(remote.layout))},
                              "these nodes' tensor-parallel KV layouts cannot be paired")


@dataclass(frozen=True, slots=True)
class Route:
    """One rank pair of a node pair: local rank `src` sends global `heads` to remote rank `dst`."""

    src: int
    dst: int
    heads: tuple[int, int]


def plan_routes(src_layout: Sequence[tuple[int, int]], dst_layout: Sequence[tuple[int, int]]) -> list[Route]:
    """Each receiving rank's heads, each from the lowest sending rank holding it, contiguous runs
    of heads from one sender as one route."""
    routes: list[Route] = []
    for dst, (start, end) in enumerate(dst_layout):
        for head in range(start, end):
            src = next(r for r, (a, b) in enumerate(src_layout) if a <= head < b)
            last = routes[-1] if routes else None
            if last is not None and last.dst == dst and last.src == src and last.heads[1] == head:
                routes[-1] = Route(src, dst, (last.heads[0], head + 1))
            else:
                routes.append(Route(src, dst, (head, head + 1)))
    return routes


class RankLink(Protocol):
    """One rank's KV transport as rank 0 reaches it: in this process, or in a worker."""

    def descriptor(self) -> KVDescriptor: ...
    def connect(self, remote: KVDescriptor) -> str: ...
    def push(self, req_id: str, src: list[int], dst: list[int], heads: tuple[int, int], peer: str,
             nbytes: int) -> TransferHandle: ...
    def send_done(self, req_id: str, payload: bytes, peer: str) -> TransferHandle: ...
    def poll_done(self) -> list[tuple[str, bytes]]: ...
    def set_done_callback(self, callback: DoneCallback | None) -> None: ...
    def follow_permits(self, permits: WritePermits) -> None: ...
    def stats(self) -> TransferStats: ...
    def recv_stats(self) -> TransferStats: ...


class LocalRank:
    """A rank whose transport runs in this process (rank 0; every rank of an in-process test)."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport

    def descriptor(self) -> KVDescriptor:
        return self.transport.descriptor()

    def connect(self, remote: KVDescriptor) -> str:
        return self.transport.connect(remote)

    def push(self, req_id, src, dst, heads, peer, nbytes) -> TransferHandle:
        return self.transport.push(req_id, src, dst, head_range=heads, peer=peer)

    def send_done(self, req_id: str, payload: bytes, peer: str) -> TransferHandle:
        return self.transport.send_done(req_id, payload, peer=peer)

    def poll_done(self) -> list[tuple[str, bytes]]:
        return self.transport.poll_done()

    def set_done_callback(self, callback: DoneCallback | None) -> None:
        self.transport.set_done_callback(callback)

    def follow_permits(self, permits: WritePermits) -> None:
        self.transport.guard_writes(permits)

    def stats(self) -> TransferStats:
        return self.transport.stats()

    def recv_stats(self) -> TransferStats:
        return self.transport.recv_stats()


class GroupHandle:
    """A push or done message of a node pair: one rank-level handle per route, ended when all
    have (failed when one has). Read like a `TransferHandle`: `poll()`, `done`, `nbytes`, `error`."""

    def __init__(self, req_id: str, parts: list[TransferHandle]) -> None:
        self.req_id = req_id
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)

    def poll(self) -> TransferState:
        states = [p.poll() for p in self.parts]
        if TransferState.FAILED in states:
            return TransferState.FAILED
        if all(s is TransferState.SUCCESS for s in states):
            return TransferState.SUCCESS
        return TransferState.TRANSFERRING

    @property
    def done(self) -> bool:
        return self.poll() in (TransferState.SUCCESS, TransferState.FAILED)

    @property
    def error(self) -> str | None:
        return next((p.error for p in self.parts if p.error), None)

    def wait(self, timeout: float | None = None) -> TransferState:
        """Block until every part ended or `timeout` (each); tests and benchmarks only."""
        for part in self.parts:
            part.wait(timeout)
        return self.poll()


@dataclass(frozen=True, slots=True)
class _Link:
    route: Route
    peer: str  # the rank-level peer id on the sending rank


class RankedTransport:
    def __init__(self, ranks: Sequence[RankLink], closers: Sequence = (), epoch: str | None = None) -> None:
        """`ranks`: every rank's transport, rank order, each with its caches registered; `epoch`
        names this run of the node's caches (a fresh one unless given: tests name theirs)."""
        self.ranks = list(ranks)
        self.epoch = uuid.uuid4().hex[:12] if epoch is None else epoch
        self.spec: KVCacheSpec = self.ranks[0].descriptor().spec  # the shape every rank shares
        self._closers = list(closers)  # what close() stops: rank 0's transport, the worker group
        self._lock = threading.Lock()
        self._peers: dict[str, list[_Link]] = {}

    # -- the node's layout -----------------------------------------------------------
    def descriptor(self) -> NodeKVDescriptor:
        return NodeKVDescriptor(tuple(rank.descriptor() for rank in self.ranks), self.epoch)

    # -- sending -----------------------------------------------------------------------
    def connect(self, remote: NodeKVDescriptor) -> str:
        """Open every route's rank connection (blocking: the caller's worker thread); the node
        pair's peer id. Raises FingerprintMismatch for layouts or caches that cannot pair."""
        local = self.descriptor()
        check_pairing(local, remote)
        links = []
        for route in plan_routes(local.layout, remote.layout):
            peer = self.ranks[route.src].connect(remote.ranks[route.dst])
            links.append(_Link(route, peer))
        with self._lock:
            self._peers[remote.key] = links
        return remote.key

    def done_parts(self, peer: str) -> int:
        """How many done messages one request sends this peer (one per route)."""
        return len(self._links(peer))

    def push(self, req_id: str, src_block_ids: Sequence[int], dst_block_ids: Sequence[int], *,
             peer: str) -> GroupHandle:
        src, dst = list(src_block_ids), list(dst_block_ids)
        parts = []
        for link in self._links(peer):
            heads = link.route.heads
            nbytes = 2 * self.spec.num_layers * len(dst) * self.spec.block_nbytes(heads[1] - heads[0])
            parts.append(self.ranks[link.route.src].push(req_id, src, dst, heads, link.peer, nbytes))
        return GroupHandle(req_id, parts)

    def send_done(self, req_id: str, payload: bytes, *, peer: str) -> GroupHandle:
        parts = [self.ranks[link.route.src].send_done(req_id, payload, link.peer) for link in self._links(peer)]
        return GroupHandle(req_id, parts)

    def _links(self, peer: str) -> list[_Link]:
        with self._lock:
            links = self._peers.get(peer)
        if links is None:
            raise KVTransferError(f"not connected to {peer}")
        return links

    # -- receiving -----------------------------------------------------------------------
    def guard_writes(self, permits: WritePermits) -> None:
        for rank in self.ranks:
            rank.follow_permits(permits)

    def poll_done(self) -> list[tuple[str, bytes]]:
        return [done for rank in self.ranks for done in rank.poll_done()]

    def set_done_callback(self, callback: DoneCallback | None) -> None:
        for rank in self.ranks:
            rank.set_done_callback(callback)

    # -- counters ------------------------------------------------------------------------
    def rank_stats(self) -> list[TransferStats]:
        return [rank.stats() for rank in self.ranks]

    def rank_recv_stats(self) -> list[TransferStats]:
        return [rank.recv_stats() for rank in self.ranks]

    def stats(self) -> TransferStats:
        return sum_stats(self.rank_stats())

    def recv_stats(self) -> TransferStats:
        return sum_stats(self.rank_recv_stats())

    def close(self) -> None:
        for closer in self._closers:
            closer.close()

