"""Conversions between the node protos and the engine's / the core messages' types.

Owns: proto SamplingParams -> engine `SamplingParams` (with the router's seed), engine
logprobs and finish reasons -> proto, a core's `Tokens` -> `DecodeTokens`, `StatsData` ->
`NodeStats`.

Must never: decide a status code (errors.py does) or touch the network.
"""

from __future__ import annotations

from pdserve.engine.request import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.messages import Logprobs, StatsData, Tokens
from pdserve.proto import node_pb2, pdserve_pb2

# Optional scalar fields of the proto that map 1:1 onto SamplingParams (n is not one:
# a node serves one sample, named by sample_index).
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "max_tokens", "min_tokens", "logprobs")

_FINISH = {
    None: pdserve_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP.value: pdserve_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH.value: pdserve_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT.value: pdserve_pb2.FINISH_REASON_ABORT,
}


def params_from_proto(proto: pdserve_pb2.SamplingParams, seed: int) -> SamplingParams:
    """Engine params; `seed` is the router's resolved seed. Raises ValueError naming a bad field."""
    values: dict[str, object] = {name: getattr(proto, name) for name in _OPTIONAL if proto.HasField(name)}
    values["stop"] = tuple(proto.stop)
    values["stop_token_ids"] = tuple(proto.stop_token_ids)
    values["ignore_eos"] = proto.ignore_eos
    values["seed"] = seed
    return SamplingParams(**values)


def logprobs_to_proto(token_id: int, logprobs: Logprobs) -> pdserve_pb2.TokenLogprobs:
    top = [pdserve_pb2.TopLogprob(token_id=t, logprob=lp)
           for t, lp in zip(logprobs.top_token_ids, logprobs.top_logprobs)]
    return pdserve_pb2.TokenLogprobs(token_id=token_id, logprob=logprobs.token_logprob, top=top)


def finish_reason_to_proto(reason: str | None) -> int:
    return _FINISH[reason]


def tokens_to_proto(msg: Tokens) -> node_pb2.DecodeTokens:
    """The tokens event of a decode or colocated stream; -1 stands for "no stop token" on the wire."""
    logprobs = [logprobs_to_proto(t, lp) for t, lp in zip(msg.token_ids, msg.logprobs) if lp is not None]
    stop_token_id = msg.stop_token_id if msg.stop_token_id is not None else -1
    return node_pb2.DecodeTokens(token_ids=msg.token_ids, logprobs=logprobs,
                                 finish_reason=finish_reason_to_proto(msg.finish_reason), stop_token_id=stop_token_id)


def stats_to_proto(stats: StatsData) -> node_pb2.NodeStats:
    kv = stats.kv_transfer
    return node_pb2.NodeStats(
        kind=stats.kind,
        num_blocks=stats.num_blocks,
        used_blocks=stats.used_blocks,
        reserved_blocks=stats.reserved_blocks,
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        kv_transfer=node_pb2.TransferCounters(bytes=kv.bytes, blocks=kv.blocks, transfers=kv.transfers,
                                              failures=kv.failures, latency_s=kv.latency_s),
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
    )
