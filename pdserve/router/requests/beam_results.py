"""A beam search's answer as the client sees it: the node's one `beams` event, as one response per beam.

The driver's other sink, beside the token relay (pdserve/router/requests/relay.py): the driver runs a
beam search like any sample, on a colocated node or a prefill + decode pair, and hands this
collector the events its route produces. Nothing streams before the end, since the beams
change until the search ends, so nothing was sent when a node is lost: every loss is a retry
from the start (`streamed_token_ids` stays empty), and beam search is deterministic, so the
answer is the same. The beams come back as one GenerateResponse each, index = rank (best first),
`n` of them.

Must never: talk to a node, pick a node, or pick a status code.
"""

from __future__ import annotations

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.proto import node_pb2, pdserve_pb2
from pdserve.router.model import RouterModel
from pdserve.router.requests.relay import SendResponse
from pdserve.router.requests.validation import ValidatedRequest


class BeamResults:
    event = "beams"  # the node events it takes: one, at the search's end
    opening_name = "its beams"  # in messages: what a colocated node's stream opens with

    def __init__(self, request: ValidatedRequest, model: RouterModel, send: SendResponse) -> None:
        self._request = request
        self._model = model
        self._send = send
        self.streamed_token_ids: list[int] = []  # never any: nothing streams before the end
        self.finished = False
        self._num_cached_tokens: int | None = None  # from the prefill node, on a pair

    def take_prefill(self, prefill: node_pb2.PrefillResponse) -> bool:
        """The prompt computed on a prefill node: its token 1 is not the client's (the decode
        node starts the search from the prompt's top logprobs), only its cache hit counts."""
        self._num_cached_tokens = prefill.num_cached_tokens
        return False

    def push(self, event: node_pb2.DecodeEvent) -> bool:
        results = event.beams
        if self._num_cached_tokens is not None:
            results.num_cached_tokens = self._num_cached_tokens  # the prompt was computed there
        for index, hyp in enumerate(results.beams[: self._request.params.n]):
            self._send(self._response(index, hyp, results))
        self.finished = True
        return True

    def _response(self, index: int, hyp: node_pb2.BeamHypothesis,
                  results: node_pb2.BeamResults) -> pdserve_pb2.GenerateResponse:
        request = self._request
        detokenizer = IncrementalDetokenizer(self._model.tokenizer, request.prompt_token_ids)
        text = "".join(detokenizer.push(t) for t in hyp.token_ids) + detokenizer.flush()
        usage = pdserve_pb2.Usage(prompt_tokens=results.num_prompt_tokens, completion_tokens=len(hyp.token_ids),
                                  cached_prompt_tokens=results.num_cached_tokens)
        return pdserve_pb2.GenerateResponse(request_id=request.request_id, index=index, token_ids=hyp.token_ids,
                                            text=text, finish_reason=hyp.finish_reason, stop_token_id=-1,
                                            usage=usage, cumulative_logprob=hyp.cumulative_logprob,
                                            beam_score=hyp.score)
