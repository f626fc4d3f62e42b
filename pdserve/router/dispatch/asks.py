"""What a sample asks of its nodes: the node messages' fields, built once when the sample starts.

Two kinds, one driver (pdserve/router/dispatch/driver.py):

- a sample: the request's sampling params with n = 1 (a node runs one sample; sample_index
  says which), the prompt's logprobs asked of sample 0 only, and of no resume once the client
  has them (they come with token 1); KV for prompt + max_tokens;
- a beam search: greedy params the node reads max_tokens and ignore_eos from, the search's
  option; on a pair, the prefill node samples with the search's 2k top logprobs (the first
  step's candidates, which only the node computing the prompt has); KV for every beam's own
  prompt + max_tokens at most (sharing makes it fewer).

Owns the node request messages a sample sends (`SampleRequest`, `PrefillRequest`). Must never
call a node, or rebuild the sampling params per attempt.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import beams_to_keep
from pdserve.proto import node_pb2, pdserve_pb2
from pdserve.proto.convert import params_to_proto
from pdserve.router.model import RouterModel
from pdserve.router.requests.validation import ValidatedRequest


@dataclass(frozen=True, slots=True)
class NodeAsks:
    request: ValidatedRequest
    sample_index: int
    params: pdserve_pb2.SamplingParams  # the sample's, on its first attempt
    resumed_params: pdserve_pb2.SamplingParams  # after the client has tokens
    prefill_params: pdserve_pb2.SamplingParams | None  # None: the sample's own
    beam_search: pdserve_pb2.BeamSearch | None
    sequences: int  # how many sequences' KV a node may hold for it
    stream_interval: int = 1  # tokens per streamed event (SampleRequest.stream_interval); a beam search streams none

    @classmethod
    def for_sample(cls, request: ValidatedRequest, index: int, stream_interval: int) -> NodeAsks:
        params = params_to_proto(request.params)
        params.n = 1  # a node runs one sample; sample_index says which
        if index != 0:
            # Prompt logprobs are the request's and come with sample 0's token 1.
            params.ClearField("prompt_logprobs")
        resumed = pdserve_pb2.SamplingParams()
        resumed.CopyFrom(params)
        resumed.ClearField("prompt_logprobs")  # the client has them: a resume would only score the prompt again
        return cls(request, index, params, resumed, None, None, 1, stream_interval)

    @classmethod
    def for_beam_search(cls, request: ValidatedRequest, model: RouterModel) -> NodeAsks:
        beam, params = request.beam, request.params
        assert beam is not None, "only a beam search's request has a beam option"
        # The node reads max_tokens and ignore_eos; the rest are defaults the router already checked.
        node_params = pdserve_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=params.max_tokens,
                                                 ignore_eos=params.ignore_eos)
        keep = beams_to_keep(beam.beam_width, len(model.eos_token_ids), params.ignore_eos)
        prefill = pdserve_pb2.SamplingParams(n=1, temperature=0.0, max_tokens=params.max_tokens, logprobs=keep)
        return cls(request, 0, node_params, node_params, prefill, beam.to_proto(), beam.beam_width)

    def sample_request(self, req_id: str, resumed: list[int], stamp: int) -> node_pb2.SampleRequest:
        """`stamp`: the placement's (pdserve/router/cluster/placement.py `PlacementStamps`)."""
        request = self.request
        return node_pb2.SampleRequest(
            request_id=req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=self._params(resumed),
            seed=request.params.seed,
            sample_index=self.sample_index,
            resumed_token_ids=resumed,
            beam_search=self.beam_search,
            placement_stamp=stamp,
            stream_interval=self.stream_interval,
        )

    def prefill_request(self, req_id: str, resumed: list[int], ready: node_pb2.Ready,
                        decode_address: str, stamp: int) -> node_pb2.PrefillRequest:
        """The prefill leg's request: the decode node's reserved blocks, and its KV layout by id
        (the prefill node fetches a layout it does not know from `decode_address` once)."""
        request = self.request
        return node_pb2.PrefillRequest(
            request_id=req_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=self.prefill_params or self._params(resumed),
            seed=request.params.seed,
            sample_index=self.sample_index,
            decode_kv_layout_id=ready.kv_layout_id,
            decode_address=decode_address,
            decode_block_ids=ready.block_ids,
            resumed_token_ids=resumed,
            placement_stamp=stamp,
        )

    def num_blocks(self, block_size: int, max_model_len: int) -> int:
        """The most KV blocks a node may hold for it, as placement counts them."""
        return self.sequences * self.request.max_kv_blocks(block_size, max_model_len)

    def _params(self, resumed: list[int]) -> pdserve_pb2.SamplingParams:
        return self.resumed_params if resumed else self.params
