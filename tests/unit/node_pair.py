"""A prefill core and a decode core in one process, joined by the in-process transport.

The same handler objects the node processes run (the node core with the KV export stage and
its KVExporter; the node core with the KV import stage and its ReservationTable), driven step by step by the test instead of the
core loop, on tiny real engines sharing one loaded model. Nothing here spawns or sleeps.
Every hand-off state each side enters is recorded (`p_moves`, `d_moves`), and so is
every block reference each pool hands out and takes back (`p_ledger`, `d_ledger`).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from pdserve.decode_node.kv_import import KVImportStage
from pdserve.decode_node.reservations import ReservationTable
from pdserve.engine.block_pool import BlockPool, KVBlock
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_loader import LoadedModel
from pdserve.engine.policy import ColocatedPolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer import InProcessFabric, InProcessTransport, KVCacheSpec
from pdserve.node.core.handoff import HandoffState
from pdserve.ranks.kv_ranks import LocalRank, NodeKVDescriptor, RankedTransport
from pdserve.node.messages import StreamSubmit, FirstToken, Message, PrefillSubmit, Ready, RequestFailed, Tokens
from pdserve.node.core.node_core import NodeCore
from pdserve.prefill_node.kv_export import KVExportStage
from pdserve.prefill_node.exporter import KVExporter
from pdserve.prefill_node.peers import PeerConnections
from pdserve.prefill_node.policy import PrefillPolicy

BLOCK_SIZE = 4


def engine_config(model_dir: str, num_blocks: int, budget: int = 8, max_seqs: int = 8) -> EngineConfig:
    return EngineConfig(model=model_dir, dtype="float32", block_size=BLOCK_SIZE, num_blocks=num_blocks,
                        max_num_batched_tokens=budget, max_num_seqs=max_seqs)


def cache_spec(loaded: LoadedModel, model: str = "tiny") -> KVCacheSpec:
    return KVCacheSpec(model=model, dtype="float32", num_layers=loaded.num_layers,
                       num_kv_heads=loaded.num_kv_heads, head_dim=loaded.head_dim, block_size=BLOCK_SIZE)


def block_bytes(loaded: LoadedModel) -> int:
    return 2 * loaded.num_layers * loaded.num_kv_heads * BLOCK_SIZE * loaded.head_dim * 4


class BlockLedger:
    """Counts, per block id, the references a pool hands out (allocate, touch) and takes back (free).

    The pool itself refuses a free past zero; `balanced()` adds that every reference taken
    was given back: each block freed exactly as often as it was taken, none left held.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.taken: Counter[int] = Counter()
        self.dropped: Counter[int] = Counter()
        allocate, touch, free = pool.allocate, pool.touch, pool.free

        def counting_allocate(num: int) -> list[KVBlock] | None:
            blocks = allocate(num)
            self.taken.update(b.block_id for b in blocks or ())
            return blocks

        def counting_touch(blocks: Iterable[KVBlock]) -> None:
            blocks = list(blocks)
            self.taken.update(b.block_id for b in blocks)
            touch(blocks)

        def counting_free(blocks: Iterable[KVBlock]) -> None:
            blocks = list(blocks)
            self.dropped.update(b.block_id for b in blocks)
            free(blocks)

        pool.allocate, pool.touch, pool.free = counting_allocate, counting_touch, counting_free

    def balanced(self) -> bool:
        return self.taken == self.dropped


class ManualExecutor(Executor):
    """Connects only when the test says so: a prefill node's connection still being made."""

    def __init__(self) -> None:
        self._pending: list[tuple[Future, Callable[[], object]]] = []

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self._pending.append((future, lambda: fn(*args, **kwargs)))
        return future

    def run_pending(self) -> None:
        pending, self._pending = self._pending, []
        for future, call in pending:
            try:
                future.set_result(call())
            except Exception as exc:  # reported through the future, like a worker thread's failure
                future.set_exception(exc)


@dataclass
class Pair:
    model_dir: str
    loaded: LoadedModel
    p_blocks: int = 64
    d_blocks: int = 64
    lease_s: float = 30.0
    d_model_name: str = "tiny"  # another name: a fingerprint mismatch
    connector: Executor | None = None  # None: P connects at once (on the test's thread)
    d_local_prefill: bool = False  # a hybrid decode node: it also computes prompts of its own
    p_out: list[Message] = field(default_factory=list)
    d_out: list[Message] = field(default_factory=list)
    p_moves: defaultdict[str, list[HandoffState]] = field(default_factory=lambda: defaultdict(list))
    d_moves: defaultdict[str, list[HandoffState]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self.fabric = InProcessFabric()
        self.p_engine = EngineCore(engine_config(self.model_dir, self.p_blocks), PrefillPolicy(), self.loaded)
        self.d_engine = EngineCore(engine_config(self.model_dir, self.d_blocks), ColocatedPolicy(), self.loaded)
        self.p_ledger, self.d_ledger = BlockLedger(self.p_engine.kv.pool), BlockLedger(self.d_engine.kv.pool)
        self.p_tx = InProcessTransport("p", self.fabric)
        self.d_tx = InProcessTransport("d", self.fabric)
        runner_p, runner_d = self.p_engine.runner, self.d_engine.runner
        self.p_tx.register(runner_p.k_caches, runner_p.v_caches, cache_spec(self.loaded))
        self.d_tx.register(runner_d.k_caches, runner_d.v_caches, cache_spec(self.loaded, self.d_model_name))
        # Each node's transport as its core holds it: over its ranks (here, one).
        self.p_node, self.d_node = RankedTransport([LocalRank(self.p_tx)]), RankedTransport([LocalRank(self.d_tx)])
        self.exporter = KVExporter(self.p_engine, self.p_node, PeerConnections(self.p_node, self.connector),
                                   self.lease_s, self.p_out.append,
                                   lambda req_id, state: self.p_moves[req_id].append(state))
        self.prefill = NodeCore(self.p_engine, self.p_out.append, local_prefill=False)
        self.prefill.stages = [KVExportStage(self.prefill, self.exporter)]
        self.table = ReservationTable(self.d_engine, self.lease_s, 3 * self.lease_s,
                                      lambda req_id, state: self.d_moves[req_id].append(state))
        self.decode = NodeCore(self.d_engine, self.d_out.append, local_prefill=self.d_local_prefill)
        # What the decode node's GetKVLayout answers: the prefill node's front hands it over.
        self.d_layout = self.d_node.descriptor().to_bytes().decode()
        self.decode.stages = [KVImportStage(self.decode, self.d_node, self.table, self.d_node.descriptor().layout_id)]

    # -- playing the router ---------------------------------------------------------
    def reserve(self, req_id: str, prompt: list[int], params: SamplingParams) -> Ready | RequestFailed:
        self.decode.handle(StreamSubmit(req_id, prompt, params, 0, imports_kv=True))
        reply = self.d_out.pop()
        assert isinstance(reply, (Ready, RequestFailed)) and reply.req_id == req_id
        return reply

    def prefill_from(self, ready: Ready, prompt: list[int], params: SamplingParams) -> None:
        self.prefill.handle(PrefillSubmit(ready.req_id, prompt, params, 0, ready.kv_layout_id, ready.block_ids,
                                          kv_layout=self.d_layout))

    def submit(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        ready = self.reserve(req_id, prompt, params)
        assert isinstance(ready, Ready), ready
        self.prefill_from(ready, prompt, params)

    # -- driving both cores ---------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """One loop iteration of each core (and one transport progress)."""
        now = time.monotonic() if now is None else now
        if self.p_engine.has_unfinished():
            self.prefill.after_step(self.p_engine.step())
        self.p_tx.progress()
        self.prefill.poll(now)
        if self.d_engine.has_unfinished():
            self.decode.after_step(self.d_engine.step())
        self.decode.poll(now)

    def run(self, max_ticks: int = 500) -> None:
        for _ in range(max_ticks):
            if not self.busy():
                return
            self.tick()
        raise AssertionError("the pair did not go idle")

    def busy(self) -> bool:
        return (self.p_engine.has_unfinished() or self.d_engine.has_unfinished() or self.exporter.has_pending()
                or self.table.has_pending() or self.p_tx.pending() > 0)

    # -- reading results ------------------------------------------------------------
    def first_tokens(self) -> dict[str, FirstToken]:
        return {m.req_id: m for m in self.p_out if isinstance(m, FirstToken)}

    def failures(self, side: str) -> dict[str, RequestFailed]:
        out = self.p_out if side == "p" else self.d_out
        return {m.req_id: m for m in out if isinstance(m, RequestFailed)}

    def decoded(self, req_id: str) -> list[Tokens]:
        return [m for m in self.d_out if isinstance(m, Tokens) and m.req_id == req_id]

    def used_blocks(self) -> tuple[int, int]:
        return self.p_engine.kv.num_used_blocks, self.d_engine.kv.num_used_blocks

    def all_blocks_returned(self) -> bool:
        """Zero blocks held on either side, each reference freed exactly once."""
        return self.used_blocks() == (0, 0) and self.p_ledger.balanced() and self.d_ledger.balanced()
