"""A beam search on a prefill + decode pair: the decode node runs it, a prefill node computes its prompt.

    rank decode nodes ──Decode(prompt, beam_search)──▶ READY{descriptor, block ids}
                                  (placement counts beam_width × (prompt + max_tokens) blocks: at most
                                   every beam's own; RESOURCE_EXHAUSTED: the next decode node)
    pick P ──Prefill(prompt, greedy, logprobs = the search's 2k)──▶ its answer (ignored: token 1 is
                                  not the client's; RESOURCE_EXHAUSTED: the next P, same blocks)
    the decode node's one `beams` event, at the search's end

Why the prefill node samples with the search's logprobs: beam search's first step needs the
top 2k log-probabilities of the prompt's last position, which only the node that computes the
prompt has. It computes the whole prompt as for any sample and sends them to the decode node in
its done message (behind the KV), where the search starts from the imported prompt — exactly the
step a colocated node takes, with no token computed twice and nothing new on the prefill node.

Both calls are cancelled in a `finally`: a client that leaves (cancel, deadline) makes the decode
node free its reservation or drop every beam, and the prefill node stop. A decode node lost
mid-search (its call failed the way a lost node's does, or it was dropped) fails this run with
`NodeFailed` and joins the caller's `failed` set: router/dispatch/beam.py runs the whole search
again, never on a node in that set.

Must never: pick a status code itself (router/errors.py does) or change the registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.router.errors import DeadlineExceeded, NodeFailed, NoNodeAvailable, Overloaded, from_node_error
from pdserve.router.cluster.liveness import NodeGone, unless_gone
from pdserve.router.cluster.placement import Candidate, DecodePlacement, PrefillPlacement
from pdserve.router.cluster.registry import NodeEntry, NodeKind, NodeRegistry


class BeamSearchPair:
    """Runs one beam search on the best decode node that takes it, fed by a prefill node."""

    def __init__(self, registry: NodeRegistry, decode: DecodePlacement, prefill: PrefillPlacement,
                 ready_timeout_s: float, prefill_timeout_s: float, clock: Callable[[], float]) -> None:
        self._registry = registry
        self._decode = decode
        self._prefill = prefill
        self._ready_timeout_s = ready_timeout_s
        self._prefill_timeout_s = prefill_timeout_s
        self._clock = clock

    def available(self) -> bool:
        return bool(self._registry.live(NodeKind.PREFILL)) and bool(self._registry.live(NodeKind.DECODE))

    async def run(self, sample: node_pb2.SampleRequest, prefill_params: pdserve_pb2.SamplingParams, num_blocks: int,
                  timeout_s: float | None, failed: set[str]) -> node_pb2.DecodeEvent:
        """The decode node's one event (the caller checks it is `beams`), its cached prompt
        tokens set to those the prefill node found in its prefix cache. `failed`: decode nodes
        lost by earlier runs of this search (skipped), and this run's, if it loses one."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        refused: list[str] = []
        live = [e for e in self._registry.live(NodeKind.DECODE) if e.node_id not in failed]
        if not live:
            raise NoNodeAvailable(f"no decode node is left for the beam search (lost: {', '.join(sorted(failed))})")
        for candidate in self._decode.rank([e.candidate() for e in live]):
            entry = self._registry.get(candidate.node_id)
            if entry is None:
                continue
            self._decode.reserve(candidate, num_blocks)
            call = node_pb2_grpc.DecodeNodeStub(self._registry.channel(entry)).Decode(sample, timeout=timeout_s)
            try:
                ready = await self._ready(call, entry, candidate, num_blocks, deadline)
                if ready is None:
                    refused.append(entry.address)
                    continue
                prefill = await self._run_prefill(sample, prefill_params, ready, entry, deadline)
                event = await unless_gone(call.read(), [entry])
            except NodeGone as gone:
                failed.add(gone.entry.node_id)  # the decode node, or the prefill node feeding it
                raise NodeFailed(f"{gone}: the beam search was lost") from gone
            except grpc.aio.AioRpcError as exc:  # the decode call's (a prefill's error is a RouterError)
                error = from_node_error("decode", entry.address, exc)
                if isinstance(error, NodeFailed):
                    failed.add(entry.node_id)
                raise error from exc
            finally:
                call.cancel()  # a no-op once the node answered; otherwise it drops the search
            if event is not grpc.aio.EOF and event.WhichOneof("event") == "beams":
                event.beams.num_cached_tokens = prefill.num_cached_tokens  # the prompt was computed there
            return event
        nodes = ", ".join(refused) or "every decode node refused moments ago"
        raise Overloaded(f"no decode node can take the beam search ({num_blocks} KV blocks at most): {nodes}")

    async def _ready(self, call: grpc.aio.UnaryStreamCall, entry: NodeEntry, candidate: Candidate, num_blocks: int,
                     deadline: float | None) -> node_pb2.Ready | None:
        """The reservation, or None when the node refused it for lack of room."""
        try:
            event = await asyncio.wait_for(unless_gone(call.read(), [entry]), self._bounded(self._ready_timeout_s,
                                                                                            deadline))
        except grpc.aio.AioRpcError as exc:
            self._decode.reserve(candidate, -num_blocks)
            if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._decode.mark_exhausted(candidate)
                return None
            raise
        except TimeoutError as exc:
            self._decode.reserve(candidate, -num_blocks)
            if deadline is not None and self._clock() >= deadline:
                raise DeadlineExceeded(f"the deadline passed while waiting for READY from {entry.address}") from exc
            raise NodeFailed(f"decode node {entry.address} did not send READY within {self._ready_timeout_s}s") from exc
        if event is grpc.aio.EOF or event.WhichOneof("event") != "ready":
            self._decode.reserve(candidate, -num_blocks)
            what = "nothing" if event is grpc.aio.EOF else event.WhichOneof("event")
            raise NodeFailed(f"decode node {entry.address} answered a beam search with {what}, not READY")
        return event.ready

    async def _run_prefill(self, sample: node_pb2.SampleRequest, params: pdserve_pb2.SamplingParams,
                           ready: node_pb2.Ready, decode: NodeEntry, deadline: float | None) -> node_pb2.PrefillResponse:
        request = node_pb2.PrefillRequest(request_id=sample.request_id, prompt_token_ids=sample.prompt_token_ids,
                                          sampling_params=params, seed=sample.seed,
                                          decode_kv_layout_id=ready.kv_layout_id, decode_address=decode.address,
                                          decode_block_ids=ready.block_ids)
        full: dict[str, str] = {}  # node id -> address: refused RESOURCE_EXHAUSTED, touched nothing
        while True:
            live = [e for e in self._registry.live(NodeKind.PREFILL) if e.node_id not in full]
            if not live:
                if full:
                    raise Overloaded(f"every prefill node's queue is full: {', '.join(full.values())}")
                raise NoNodeAvailable("no prefill node is available for the beam search")
            candidate = self._prefill.choose([e.candidate() for e in live], sample.prompt_token_ids)
            entry = next(e for e in live if e.node_id == candidate.node_id)
            stub = node_pb2_grpc.PrefillNodeStub(self._registry.channel(entry))
            call = stub.Prefill(request, timeout=self._bounded(self._prefill_timeout_s, deadline))
            try:
                return await unless_gone(call, [entry, decode])
            except grpc.aio.AioRpcError as exc:
                if exc.code() is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise from_node_error("prefill", entry.address, exc) from exc
                full[entry.node_id] = entry.address
            finally:
                call.cancel()  # no-op once answered
                self._prefill.finished(candidate, len(sample.prompt_token_ids))

    def _bounded(self, limit_s: float, deadline: float | None) -> float:
        return limit_s if deadline is None else max(0.0, min(limit_s, deadline - self._clock()))
