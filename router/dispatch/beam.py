"""A beam search request (`GenerateRequest.beam_search`, checked by router/requests/beam_option.py):
its run on a colocated node or a pair.

The run (`BeamSearchRoute`): beam search needs every step's top logprobs of every beam in
one engine. On a colocated node, when one is live: the router ranks colocated nodes as for a
sample, asks the best with the option (RESOURCE_EXHAUSTED: the next one) and waits for the
node's one `beams` event. Else on a prefill + decode pair (router/dispatch/beam_pair.py): the decode
node runs the search from the prompt a prefill node computed. With neither live:
FAILED_PRECONDITION naming beam_width. The beams come back as one GenerateResponse each,
index = rank (best first). Nothing streams before the end: the beams change until the search
ends. The node calls are cancelled in a `finally`, so a client that leaves (cancel, deadline)
frees every beam's blocks. A node lost mid-search (UNAVAILABLE, a dropped node) costs the client
nothing it saw, since nothing streamed: the whole search runs again, under a new node request
id, on another node (a colocated node, or a pair's decode node, that failed this search is
skipped), at most `--max-resumes` times and while fewer than `--max-node-failures-per-request`
attempts have failed; beam search is deterministic, so the answer is the same.

Must never: pick a status code itself (router/errors.py does) or change the registry.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import grpc

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.sampling_params import SamplingParams, beams_to_keep
from pdserve.proto import node_pb2, node_pb2_grpc, pdserve_pb2
from pdserve.router.dispatch.beam_pair import BeamSearchPair
from pdserve.router.errors import NeedsNodes, NodeFailed, NoNodeAvailable, Overloaded, from_node_error
from pdserve.router.cluster.liveness import NodeGone, unless_gone
from pdserve.router.model import RouterModel
from pdserve.router.cluster.placement import ColocatedPlacement
from pdserve.router.dispatch.recovery import check_node_failures
from pdserve.router.cluster.registry import NodeKind, NodeRegistry

if TYPE_CHECKING:
    from pdserve.router.requests.validation import ValidatedRequest

log = logging.getLogger(__name__)

class BeamSearchRoute:
    """Runs one beam search on the best colocated node that takes it, else on a prefill + decode pair."""

    def __init__(self, registry: NodeRegistry, placement: ColocatedPlacement, model: RouterModel,
                 block_size: int, pair: BeamSearchPair | None = None, max_retries: int = 0,
                 max_node_failures: int = 1) -> None:
        self._registry = registry
        self._placement = placement
        self._model = model
        self._block_size = block_size
        self._pair = pair
        self._max_retries = max_retries  # whole searches run again after a lost node
        self._max_node_failures = max_node_failures  # ... while fewer attempts than this have failed

    def check_available(self) -> None:
        if self._registry.live(NodeKind.COLOCATED) or (self._pair is not None and self._pair.available()):
            return
        raise NeedsNodes("beam_width", "beam_width: beam search runs on a colocated node or a prefill + decode "
                                       "pair (every step needs every beam's top logprobs in one engine), and this "
                                       "cluster has neither live")

    async def run(self, request: ValidatedRequest, node_req_id: str, timeout_s: float | None) -> list[pdserve_pb2.GenerateResponse]:
        """The returned beams' responses, best first."""
        failed: set[str] = set()  # nodes lost by this search (colocated, or a pair's decode node)
        for attempt in itertools.count():  # ends by returning or raising
            req_id = node_req_id if attempt == 0 else f"{node_req_id}~{attempt}"
            try:
                return await self._run_once(request, req_id, timeout_s, failed)
            except NodeFailed as exc:
                check_node_failures(attempt + 1, self._max_node_failures, exc, exc)
                if attempt >= self._max_retries:
                    raise
                log.warning("beam search %s runs again on another node: %s", request.request_id, exc)

    async def _run_once(self, request: ValidatedRequest, node_req_id: str, timeout_s: float | None,
                        failed: set[str]) -> list[pdserve_pb2.GenerateResponse]:
        self.check_available()
        beam = request.beam
        assert beam is not None, "the orchestrator sends only beam searches here"
        # At most every beam's own blocks (sharing makes it fewer): what placement counts.
        num_blocks = beam.beam_width * request.max_kv_blocks(self._block_size, self._model.max_model_len)
        sample = node_pb2.SampleRequest(request_id=node_req_id, prompt_token_ids=request.prompt_token_ids,
                                        sampling_params=_node_params(request.params), seed=request.params.seed,
                                        beam_search=beam.to_proto())
        if self._registry.live(NodeKind.COLOCATED) or self._pair is None:
            event, address = await self._run_colocated(request, sample, num_blocks, timeout_s, failed)
            return self._responses(request, event, f"colocated node {address}")
        keep = beams_to_keep(beam.beam_width, len(self._model.eos_token_ids), request.params.ignore_eos)
        prefill_params = pdserve_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=request.params.max_tokens,
                                                    logprobs=keep)
        event = await self._pair.run(sample, prefill_params, num_blocks, timeout_s, failed)
        return self._responses(request, event, "the decode node")

    async def _run_colocated(self, request: ValidatedRequest, sample: node_pb2.SampleRequest, num_blocks: int,
                             timeout_s: float | None, failed: set[str]) -> tuple[node_pb2.DecodeEvent, str]:
        num_tokens = len(request.prompt_token_ids)
        refused: list[str] = []
        live = [e for e in self._registry.live(NodeKind.COLOCATED) if e.node_id not in failed]
        if not live:
            raise NoNodeAvailable(f"no colocated node is left for the beam search (lost: {', '.join(sorted(failed))})")
        for candidate in self._placement.rank([e.candidate() for e in live]):
            entry = self._registry.get(candidate.node_id)
            if entry is None:
                continue
            self._placement.assign(candidate, num_tokens, num_blocks)
            call = node_pb2_grpc.ColocatedNodeStub(self._registry.channel(entry)).Generate(sample, timeout=timeout_s)
            try:
                event = await unless_gone(call.read(), [entry])
            except grpc.aio.AioRpcError as exc:
                self._placement.withdraw(candidate, num_tokens, num_blocks)
                if exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._placement.mark_exhausted(candidate)
                    refused.append(entry.address)
                    continue
                error = from_node_error("colocated", entry.address, exc)
                if isinstance(error, NodeFailed):
                    failed.add(entry.node_id)
                raise error from exc
            except NodeGone as gone:
                self._placement.withdraw(candidate, num_tokens, num_blocks)
                failed.add(entry.node_id)
                raise NodeFailed(f"{gone}: the beam search was lost") from gone
            finally:
                call.cancel()  # a no-op once the node answered; otherwise the node drops every beam
            self._placement.prefilled(candidate, num_tokens)
            return event, entry.address
        nodes = ", ".join(refused) or "every colocated node refused moments ago"
        raise Overloaded(f"no colocated node can take the beam search ({num_blocks} KV blocks at most): {nodes}")

    def _responses(self, request: ValidatedRequest, event: node_pb2.DecodeEvent, node: str) -> list[pdserve_pb2.GenerateResponse]:
        if event is grpc.aio.EOF or event.WhichOneof("event") != "beams":
            what = "nothing" if event is grpc.aio.EOF else event.WhichOneof("event")
            raise NodeFailed(f"{node} answered a beam search with {what}, not beams")
        results = event.beams
        return [self._response(request, i, hyp, results) for i, hyp in enumerate(results.beams[: request.params.n])]

    def _response(self, request: ValidatedRequest, index: int, hyp: node_pb2.BeamHypothesis,
                  results: node_pb2.BeamResults) -> pdserve_pb2.GenerateResponse:
        detokenizer = IncrementalDetokenizer(self._model.tokenizer, request.prompt_token_ids)
        text = "".join(detokenizer.push(t) for t in hyp.token_ids) + detokenizer.flush()
        usage = pdserve_pb2.Usage(prompt_tokens=results.num_prompt_tokens, completion_tokens=len(hyp.token_ids),
                                  cached_prompt_tokens=results.num_cached_tokens)
        return pdserve_pb2.GenerateResponse(request_id=request.request_id, index=index, token_ids=hyp.token_ids,
                                            text=text, finish_reason=hyp.finish_reason, stop_token_id=-1,
                                            usage=usage, cumulative_logprob=hyp.cumulative_logprob,
                                            beam_score=hyp.score)


def _node_params(params: SamplingParams) -> pdserve_pb2.SamplingParams:
    # The node reads max_tokens and ignore_eos; the rest are defaults the router already checked.
    return pdserve_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos)
