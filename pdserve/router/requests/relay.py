"""One sample's output as the client sees it, whichever nodes produce its tokens.

Owns the sample's detokenizer and stop-string check (`SequenceStream`), the list of
tokens already sent to the client (what a resume after a node failure re-prefills), the
token-level stop rule for a token the router learns without a finish reason (token 1
from a prefill node), and the responses themselves: each carries the sample's `index`;
the first one the prompt logprobs when asked (sample 0's only: the driver asks no other
sample's node for them); the last one the finish reason, usage and timings.

A relay is one of the driver's two sinks (pdserve/router/requests/beam_results.py is the other, for
a beam search): `event` names the node events it takes, `push` takes one, `take_prefill` a
prefill node's answer.

Must never: talk to a node, pick a node, or pick a status code. The sample's driver
(pdserve/router/dispatch/driver.py, on either route) and the disaggregated route's prefill leg feed it
tokens; it tells them when the sample has ended, and hands each response to the
request's `SendResponse` (the orchestrator's queue of the response stream).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.output_processor import SequenceStream
from pdserve.engine.request import FinishReason
from pdserve.engine.stop_rules import token_finish_reason
from pdserve.proto import node_pb2, pdserve_pb2
from pdserve.proto.convert import finish_reason_from_proto, finish_reason_to_proto
from pdserve.router.model import RouterModel
from pdserve.router.requests.validation import ValidatedRequest

# Hands one response to the request's response stream.
SendResponse = Callable[[pdserve_pb2.GenerateResponse], None]


@dataclass
class PrefillTotals:
    """What the prefill runs of one sample cost; a resume adds a second run."""

    num_cached_tokens: int = 0
    prefill_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0

    def add(self, prefill: node_pb2.PrefillResponse) -> None:
        if not self.prefill_s:  # the client's prompt was cached (or not) on the first run only
            self.num_cached_tokens = prefill.num_cached_tokens
        self.prefill_s += prefill.prefill_s
        self.kv_transfer_s += prefill.kv_transfer_s
        self.kv_transfer_bytes += prefill.kv_transfer_bytes


class TokenRelay:
    event = "tokens"  # the node events it relays
    opening_name = "its first token"  # in messages: what a colocated node's stream opens with

    def __init__(self, request: ValidatedRequest, index: int, model: RouterModel, received_at: float,
                 clock: Callable[[], float], send: SendResponse) -> None:
        self._request = request
        self._index = index
        self._model = model
        self._received_at = received_at
        self._clock = clock
        self._send = send
        detokenizer = IncrementalDetokenizer(model.tokenizer, request.prompt_token_ids)
        self._stream = SequenceStream(f"{request.request_id}-{index}", request.params, detokenizer)
        self.streamed_token_ids: list[int] = []
        self.prefill = PrefillTotals()
        self._first_token_at: float | None = None
        self._wants_logprobs = request.params.logprobs is not None

    @property
    def finished(self) -> bool:
        return self._stream.finish_reason is not None

    def take_prefill(self, prefill: node_pb2.PrefillResponse) -> bool:
        """A prefill node's answer: its costs, and the token it sampled, relayed at once; True
        if that token ended the sample."""
        self.prefill.add(prefill)
        logprobs = prefill.logprobs if prefill.HasField("logprobs") else None
        return self.push_sampled_token(prefill.first_token_id, logprobs, prefill.prompt_logprobs)

    def push(self, event: node_pb2.DecodeEvent) -> bool:
        return self.push_decoded(event.tokens)

    def push_sampled_token(self, token: int, logprobs: pdserve_pb2.TokenLogprobs | None,
                           prompt_logprobs: Sequence[pdserve_pb2.TokenLogprobs] = ()) -> bool:
        """A token sampled by a node that did not judge the stop rules (a prefill node's
        token 1, with the prompt's logprobs when asked, or the next token after a resume);
        True if it ended the sample."""
        request = self._request
        num_generated = len(self.streamed_token_ids) + 1
        total_len = len(request.prompt_token_ids) + num_generated
        reason = token_finish_reason(token, num_generated, total_len, request.params,
                                     self._model.eos_token_ids, self._model.max_model_len)
        text = self._stream.push_text(token, reason)
        self._respond([token], text, [logprobs] if logprobs is not None else [], prompt_logprobs)
        return self.finished

    def push_decoded(self, tokens: node_pb2.DecodeTokens) -> bool:
        """Relay one event of a node that judged the stop rules itself; True if the node
        ended the sample (False when a stop string ended it here, or it goes on)."""
        node_reason = finish_reason_from_proto(tokens.finish_reason)
        stream = self._stream
        token_ids = tokens.token_ids
        count = len(token_ids)
        if count == 1:  # one token: the event as a node front that keeps up sends it
            token = token_ids[0]
            ids, text = [token], stream.push_text(token, node_reason)
        else:
            ids, text = self._push_several(list(token_ids), node_reason)
        if not count and node_reason is not None:
            text += stream.finish(node_reason).text
        logprobs = list(tokens.logprobs[: len(ids)]) if self._wants_logprobs else []
        self._respond(ids, text, logprobs, tokens.prompt_logprobs)
        return node_reason is not None and not stream.hit_stop_string

    def _push_several(self, token_ids: list[int], node_reason: FinishReason | None) -> tuple[list[int], str]:
        """An event's tokens one by one (the node's finish reason with its last), up to the one
        that ends the sample here (a stop string): the tokens relayed and their text."""
        stream, last = self._stream, len(token_ids) - 1
        text = ""
        for i, token in enumerate(token_ids):
            text += stream.push_text(token, node_reason if i == last else None)
            if stream.finish_reason is not None:
                return token_ids[: i + 1], text
        return token_ids, text

    # -- responses ----------------------------------------------------------------------

    def _respond(self, token_ids: list[int], text: str, logprobs: list[pdserve_pb2.TokenLogprobs],
                 prompt_logprobs: Sequence[pdserve_pb2.TokenLogprobs] = ()) -> None:
        if token_ids and self._first_token_at is None:
            self._first_token_at = self._clock()
        # The client gets the prompt's logprobs once, with the sample's first token.
        first = not self.streamed_token_ids and bool(token_ids)
        self.streamed_token_ids.extend(token_ids)
        reason = self._stream.finish_reason
        if not token_ids and not text and reason is None:
            return
        response = pdserve_pb2.GenerateResponse(request_id=self._request.request_id, index=self._index,
                                                token_ids=token_ids, text=text, stop_token_id=-1)
        if logprobs and self._wants_logprobs:
            response.logprobs.extend(logprobs)
        if first and self._request.params.prompt_logprobs is not None:
            response.prompt_logprobs.extend(prompt_logprobs)
        if reason is not None:
            response.finish_reason = finish_reason_to_proto(reason)
            self._finish(response)
        self._send(response)

    def _finish(self, response: pdserve_pb2.GenerateResponse) -> None:
        stop = self._stream.stop_reason
        if isinstance(stop, str):
            response.stop_string = stop
        elif isinstance(stop, int):
            response.stop_token_id = stop
        prefill = self.prefill
        response.usage.CopyFrom(pdserve_pb2.Usage(
            prompt_tokens=len(self._request.prompt_token_ids),
            completion_tokens=len(self.streamed_token_ids),
            cached_prompt_tokens=prefill.num_cached_tokens,
        ))
        now = self._clock()
        first = self._first_token_at if self._first_token_at is not None else now
        response.timings.CopyFrom(pdserve_pb2.Timings(
            ttft_s=first - self._received_at,
            e2e_s=now - self._received_at,
            prefill_s=prefill.prefill_s,
            kv_transfer_s=prefill.kv_transfer_s,
            kv_transfer_bytes=prefill.kv_transfer_bytes,
        ))
