"""Conversions between the node protos and the core messages' types.

Owns: a core's `Tokens` -> `DecodeTokens`, `BeamsDone` -> `BeamResults`, `StatsData` -> `NodeStats`. Sampling params,
finish reasons and logprobs convert as they do for the router, in pdserve.proto.convert.

Must never: decide a status code (errors.py does) or touch the network.
"""

from __future__ import annotations

import dataclasses

from pdserve.kv_transfer.counters import TransferStats
from pdserve.node.messages import BeamsDone, StatsData, Tokens
from pdserve.proto import node_pb2
from pdserve.proto.convert import finish_reason_to_proto, logprobs_to_proto, prompt_logprobs_to_proto


def tokens_to_proto(msg: Tokens) -> node_pb2.DecodeTokens:
    """The tokens event of a decode or colocated stream; -1 stands for "no stop token" on the wire."""
    logprobs = [logprobs_to_proto(t, lp) for t, lp in zip(msg.token_ids, msg.logprobs) if lp is not None]
    stop_token_id = msg.stop_token_id if msg.stop_token_id is not None else -1
    prompt = prompt_logprobs_to_proto(msg.prompt_logprobs) if msg.prompt_logprobs is not None else []
    return node_pb2.DecodeTokens(token_ids=msg.token_ids, logprobs=logprobs,
                                 finish_reason=finish_reason_to_proto(msg.finish_reason), stop_token_id=stop_token_id,
                                 prompt_logprobs=prompt)


def beams_to_proto(msg: BeamsDone) -> node_pb2.BeamResults:
    beams = [node_pb2.BeamHypothesis(token_ids=b.token_ids, finish_reason=finish_reason_to_proto(b.finish_reason),
                                     cumulative_logprob=b.cumulative_logprob, score=b.score) for b in msg.beams]
    return node_pb2.BeamResults(beams=beams, num_prompt_tokens=msg.num_prompt_tokens,
                                num_cached_tokens=msg.num_cached_tokens)


def _counters(kv: TransferStats) -> node_pb2.TransferCounters:
    return node_pb2.TransferCounters(bytes=kv.bytes, blocks=kv.blocks, transfers=kv.transfers, failures=kv.failures,
                                     latency_s=kv.latency_s, checksum_failures=kv.checksum_failures)


def stats_to_proto(stats: StatsData) -> node_pb2.NodeStats:
    return node_pb2.NodeStats(
        kind=stats.kind,
        num_blocks=stats.num_blocks,
        used_blocks=stats.used_blocks,
        reserved_blocks=stats.reserved_blocks,
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        kv_transfer=_counters(stats.kv_transfer),
        prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits,
        tensor_parallel_size=stats.tensor_parallel_size,
        kv_transfer_ranks=[_counters(rank) for rank in stats.kv_transfer_ranks],
        num_swapped=stats.num_swapped,
        swap_blocks=stats.swap_blocks,
        used_swap_blocks=stats.used_swap_blocks,
        swaps_out=stats.swaps_out,
        swaps_in=stats.swaps_in,
        forked_samples=stats.forked_samples,
        failed_requests=stats.failed_requests,
        kv_transfer_sent=_counters(stats.kv_transfer_sent),
        placed_through=stats.placed_through,
        steps=node_pb2.StepTotals(**dataclasses.asdict(stats.steps)),
    )
