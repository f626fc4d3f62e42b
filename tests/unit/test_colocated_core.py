"""The node core's own admission (a colocated node's: no KV stage): the node's queue bounds, then the
engine's own refusals; beam searches; a decode node's core that computes no prompts of its own.

A real tiny engine with the colocated handler in one process; the test plays the front
(messages in) and the core loop (step, after_step). `--max-waiting-requests` bounds the
requests not yet scheduled, `--max-queued-tokens` the tokens not yet computed (prompt
and resumed tokens alike); beyond either the handler answers RESOURCE_EXHAUSTED at once
and the engine never sees the request. What was admitted comes out token-exact, and
every block is free afterwards.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.node.core.node_core import NodeCore, make_node_core
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.model_loader import load_model
from pdserve.engine.policy import ColocatedPolicy
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.config import NodeConfig, parse_node_args
from pdserve.node.errors import ErrorCode
from pdserve.node.messages import Abort, BeamOption, BeamsDone, StreamSubmit, Message, RequestFailed, Tokens
from pdserve.node.core.stats import QueueBounds, build_stats

from ..integration.reference import assert_matches, greedy_references
from .node_pair import engine_config

NUM_BLOCKS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_llama):
    model_dir = tiny_llama
    return str(model_dir), load_model(model_dir, torch.float32)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 * i + 5 + salt) % 900 + 3 for i in range(n)]


class Node:
    """A colocated core handler over a real engine; `out` collects what it emits."""

    def __init__(self, model, bounds: QueueBounds) -> None:
        model_dir, loaded = model
        self.engine = EngineCore(engine_config(model_dir, NUM_BLOCKS, budget=16), ColocatedPolicy(), loaded)
        self.out: list[Message] = []
        self.core = NodeCore(self.engine, self.out.append, bounds)  # a colocated node: no KV stage

    def submit(self, req_id: str, tokens: list[int], resumed: list[int] | None = None) -> RequestFailed | None:
        return self.submit_params(req_id, tokens, GREEDY, resumed)

    def submit_params(self, req_id: str, tokens: list[int], params: SamplingParams,
                      resumed: list[int] | None = None) -> RequestFailed | None:
        """The handler's immediate answer: a refusal, or None (admitted, nothing emitted yet)."""
        self.core.handle(StreamSubmit(req_id, tokens, params, 0, resumed_token_ids=resumed or []))
        if not self.out:
            return None
        reply = self.out.pop()
        assert isinstance(reply, RequestFailed) and reply.req_id == req_id and not self.out
        return reply

    def run(self) -> dict[str, list[int]]:
        while self.engine.has_unfinished():
            self.core.after_step(self.engine.step())
        streamed: dict[str, list[int]] = {}
        for msg in self.out:
            assert isinstance(msg, Tokens)
            streamed.setdefault(msg.req_id, []).extend(msg.token_ids)
        self.out.clear()
        return streamed

    def used_blocks(self) -> int:
        return self.engine.kv.pool.num_used_blocks


def refusal(reply: RequestFailed | None) -> tuple[ErrorCode, str] | None:
    return None if reply is None else (reply.code, reply.message)


def test_beyond_max_waiting_requests_is_refused_at_once(model):
    node = Node(model, QueueBounds(max_waiting_requests=2, max_queued_tokens=10_000))
    prompts = {"a": prompt(9), "b": prompt(6, 1), "c": prompt(7, 2)}
    assert node.submit("a", prompts["a"]) is None
    assert node.submit("b", prompts["b"]) is None
    assert refusal(node.submit("c", prompts["c"])) == (ErrorCode.RESOURCE_EXHAUSTED,
                                                       "queue full: 2 requests waiting (limit 2)")
    assert len(node.engine.scheduler.waiting) == 2  # the refused request never reached the engine

    streamed = node.run()
    assert sorted(streamed) == ["a", "b"]
    assert_matches([streamed["a"], streamed["b"]],
                   greedy_references(model[0], [prompts["a"], prompts["b"]], [GREEDY.max_tokens] * 2))
    assert node.used_blocks() == 0

    # Once the queue drained the same request is admitted.
    assert node.submit("c", prompts["c"]) is None
    assert len(node.run()["c"]) == GREEDY.max_tokens
    assert node.used_blocks() == 0


def test_beyond_max_queued_tokens_is_refused_and_resumed_tokens_count(model):
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=20))
    assert node.submit("a", prompt(12)) is None
    assert refusal(node.submit("b", prompt(9, 1))) == (
        ErrorCode.RESOURCE_EXHAUSTED, "queue full: 12 tokens to compute, this request adds 9 (limit 20)")
    # A resume recomputes prompt + resumed tokens: 6 + 4.
    assert refusal(node.submit("c", prompt(6, 2), resumed=[7, 8, 9, 10])) == (
        ErrorCode.RESOURCE_EXHAUSTED, "queue full: 12 tokens to compute, this request adds 10 (limit 20)")
    assert node.submit("d", prompt(8, 3)) is None  # 12 + 8 is exactly the bound
    assert sorted(node.run()) == ["a", "d"]
    assert node.used_blocks() == 0


def test_the_stats_count_the_prompt_tokens_a_new_prompt_waits_behind(model):
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=10_000))
    assert node.submit("a", prompt(12)) is None and node.submit("b", prompt(9, 1)) is None

    def queued(kind: str) -> int:
        return build_stats(kind, node.engine, None, 0).queued_prefill_tokens

    # A decode node started with --local-prefill computes prompts too: the router's hybrid
    # routing compares this with the prefill pool's queue.
    assert queued("colocated") == queued("decode") == 21
    node.core.after_step(node.engine.step())  # a budget of 16: all of a, 4 of b
    assert queued("decode") == 5
    node.core.after_step(node.engine.step())
    assert queued("decode") == 0  # decoding: the tokens left are no prompt's
    assert sorted(node.run()) == ["a", "b"]
    assert node.used_blocks() == 0


def test_a_prompt_longer_than_the_token_bound_waits_for_an_idle_node(model):
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=8))
    assert node.submit("long", prompt(30)) is None  # nothing queued: admitted, never refused forever
    assert refusal(node.submit("short", prompt(2, 1)))[0] is ErrorCode.RESOURCE_EXHAUSTED
    assert len(node.run()["long"]) == GREEDY.max_tokens
    assert node.submit("short", prompt(2, 1)) is None
    assert sorted(node.run()) == ["short"]
    assert node.used_blocks() == 0


def test_kv_that_can_never_fit_this_node_is_refused_resource_exhausted_before_the_engine_sees_it(model):
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=10_000))
    too_long = NUM_BLOCKS * 4  # blocks of 4 tokens: prompt + max_tokens need one block more than the node has
    reply = node.submit_params("too-long", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=too_long - 2))
    assert refusal(reply) == (ErrorCode.RESOURCE_EXHAUSTED,
                              f"prompt + max_tokens need {NUM_BLOCKS + 1} KV blocks; this node has {NUM_BLOCKS}")
    assert not node.engine.has_unfinished() and node.used_blocks() == 0
    assert refusal(node.submit("bad", [10**6]))[0] is ErrorCode.INVALID_ARGUMENT  # bad input stays bad input


def test_an_aborted_request_leaves_the_queue_and_frees_its_blocks(model):
    node = Node(model, QueueBounds(max_waiting_requests=1, max_queued_tokens=10_000))
    assert node.submit("a", prompt(20)) is None
    node.core.after_step(node.engine.step())  # part of the prompt computed, blocks held
    assert node.used_blocks() > 0
    node.core.handle(Abort("a"))
    assert node.used_blocks() == 0 and not node.engine.has_unfinished()
    assert node.submit("b", prompt(4, 1)) is None
    assert sorted(node.run()) == ["b"]


def test_the_node_flags_reach_the_colocated_handler(model):
    config = parse_node_args(["--model", model[0], "--max-waiting-requests", "3", "--max-queued-tokens", "50"],
                             "colocated", {})
    assert (config.max_waiting_requests, config.max_queued_tokens) == (3, 50)
    node = Node(model, QueueBounds(1, 1))
    handler = make_node_core(config, node.engine, node.out.append, local_prefill=True)
    assert handler.bounds == QueueBounds(max_waiting_requests=3, max_queued_tokens=50)
    defaults = NodeConfig(EngineConfig(model[0]), kind="colocated")
    assert make_node_core(defaults, node.engine, node.out.append, local_prefill=True).bounds == QueueBounds(
        defaults.max_waiting_requests, defaults.max_queued_tokens)


def test_a_beam_search_runs_beside_streams_and_answers_once_with_every_beam(model):
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=10_000))
    beam_params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    node.core.handle(StreamSubmit("beam", prompt(11), beam_params, 0, beam=BeamOption(3, 1.0)))
    assert node.submit("plain", prompt(9, 1)) is None
    while node.engine.has_unfinished():
        node.core.after_step(node.engine.step())
    (done,) = [m for m in node.out if isinstance(m, BeamsDone)]
    streamed = [t for m in node.out if isinstance(m, Tokens) for t in m.token_ids]
    assert all(m.req_id == "plain" for m in node.out if isinstance(m, Tokens))
    assert_matches([streamed], greedy_references(model[0], [prompt(9, 1)], [GREEDY.max_tokens]))
    assert (done.req_id, len(done.beams), done.num_prompt_tokens) == ("beam", 3, 11)
    assert [len(b.token_ids) for b in done.beams] == [6, 6, 6]
    assert [b.finish_reason for b in done.beams] == ["length"] * 3
    assert [b.score for b in done.beams] == sorted((b.score for b in done.beams), reverse=True)
    assert node.used_blocks() == 0


def test_an_aborted_beam_search_frees_every_beam_and_bad_options_are_refused(model):
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=10_000))
    beam_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    node.core.handle(StreamSubmit("beam", prompt(11), beam_params, 0, beam=BeamOption(4, 1.0)))
    for _ in range(4):
        node.core.after_step(node.engine.step())
    assert node.used_blocks() > 0 and not node.out
    node.core.handle(Abort("beam"))
    assert node.used_blocks() == 0 and not node.engine.has_unfinished()
    node.core.handle(StreamSubmit("wide", prompt(5), beam_params, 0, beam=BeamOption(11, 1.0)))
    (reply,) = node.out
    assert isinstance(reply, RequestFailed) and reply.code is ErrorCode.INVALID_ARGUMENT
    assert reply.message.startswith("beam_width 11 needs the top 22 log-probabilities")


def test_a_failed_step_answers_its_requests_internal_and_frees_them(model):
    # What the core loop does with an engine's StepFailed: `fail` each of the step's requests.
    node = Node(model, QueueBounds(max_waiting_requests=100, max_queued_tokens=10_000))
    assert node.submit("plain", prompt(9)) is None
    node.core.handle(StreamSubmit("search", prompt(11, 1), GREEDY, 0, beam=BeamOption(2, 1.0)))
    node.core.after_step(node.engine.step())
    engine_ids = [r.req_id for r in node.engine.scheduler.running]
    assert engine_ids == ["plain", "search/beam-0"]  # a search runs its beams under ids of their own
    for req_id in engine_ids:
        node.core.fail(req_id, "the model failed on a step of this request: KeyError: 'x'")
    failed = [m for m in node.out if isinstance(m, RequestFailed)]
    assert {(m.req_id, m.code, m.message) for m in failed} == {
        (req_id, ErrorCode.INTERNAL, "the model failed on a step of this request: KeyError: 'x'")
        for req_id in ("plain", "search")}
    assert not node.engine.has_unfinished() and node.used_blocks() == 0
