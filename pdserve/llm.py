"""The offline API: `LLM(model_dir).generate(prompts, params)`.

Runs one in-process engine core. Prompts may be strings or token-id lists; outputs
come back in input order. `stream()` yields deltas as they are produced; `generate()`
collects them. A request with `n > 1` computes its prompt once, as sample 0: samples
1..n-1 draw their first tokens from the same logits (each its own random stream) and are
forked off it, sharing every prompt block, its partial last one included, until one writes
there (copy-on-write). Prompt logprobs are a request's, not a sample's: sample 0 alone
scores the prompt. `beam_search()` runs transformers' beam search (pdserve/engine/beam_search.py).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from pdserve.engine.beam_runner import BeamSearchRunner
from pdserve.engine.beam_search import BeamSearchParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.ranks.tp_group import start_engine
from pdserve.engine.output_processor import CompletionDelta, SequenceStream
from pdserve.engine.prompt_logprobs import Logprob, as_vllm
from pdserve.engine.request import FinishReason, PendingFork
from pdserve.engine.sampler import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | Sequence[int]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # vLLM's shape, when the params ask: None for the first prompt token, then per prompt token
    # a dict token id -> Logprob holding the token itself and its top alternatives.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated, eos included when eos ended it
    text: str
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty: what ranks the sequences
    finish_reason: FinishReason


@dataclass
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # beam_width of them, best first


@dataclass(slots=True)
class StreamEvent:
    prompt_index: int
    sample_index: int
    delta: CompletionDelta


class LLM:
    def __init__(self, model: str | Path, **engine_kwargs) -> None:
        """`engine_kwargs`: EngineConfig's fields; `tensor_parallel_size=T` runs the model on T
        processes (this one and T-1 workers it owns, stopped by `close()` or at exit)."""
        self.engine, self._group = start_engine(EngineConfig(model=str(model), **engine_kwargs))
        self.config = self.engine.config  # resolved: dtype="auto" is this machine's choice
        self.tokenizer = self.engine.loaded.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the worker ranks (tensor_parallel_size > 1); nothing to do otherwise."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _as_prompt_list(prompts)
        results = [self._empty_output(p) for p in prompt_list]
        for r, p in zip(results, self._params_list(params, len(prompt_list))):
            r.outputs = [CompletionOutput(i) for i in range(p.n)]
        with tqdm(total=len(results), desc="generate", disable=not use_tqdm) as bar:
            for event in self.stream(prompt_list, params):
                result = results[event.prompt_index]
                _accumulate(result.outputs[event.sample_index], event.delta)
                if event.delta.prompt_logprobs is not None:
                    result.prompt_logprobs = as_vllm(event.delta.prompt_logprobs, self._decode_token)
                if event.delta.finish_reason is not None and result.finished:
                    bar.update(1)
        return results

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best sequences, best first: transformers' beam search
        (pdserve/engine/beam_search.py). Beams are engine requests forked from each other, sharing blocks."""
        prompt_list = _as_prompt_list(prompts)
        token_lists = [self._tokenize(p) for p in prompt_list]
        results = BeamSearchRunner(self.engine).run(token_lists, params, prefix=f"beam-{next(self._ids)}")
        return [
            BeamSearchOutput(p if isinstance(p, str) else None, ids, [
                BeamSequence(h.token_ids, self.tokenizer.decode(h.token_ids), h.cum_logprob, h.score,
                             FinishReason.STOP if h.ended_by_eos else FinishReason.LENGTH) for h in hyps])
            for p, ids, hyps in zip(prompt_list, token_lists, results)
        ]

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {role, content} messages) or several: each is rendered
        by the tokenizer's chat template (or `chat_template`), ready for the assistant's turn, and
        generated like a prompt."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("messages: this model has no chat template; pass chat_template= or use generate()")
        prompts = [self.tokenizer.apply_chat_template(list(c), chat_template=chat_template, tokenize=False,
                                                      add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def stream(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> Iterator[StreamEvent]:
        """Run the prompts to completion, yielding every sequence's delta as it comes."""
        prompt_list = _as_prompt_list(prompts)
        streams: dict[str, tuple[int, int, SequenceStream]] = {}
        batch_id = next(self._ids)
        try:
            for index, (prompt, p) in enumerate(zip(prompt_list, self._params_list(params, len(prompt_list)))):
                self._add(f"{batch_id}-{index}", self._tokenize(prompt), p, index, streams)
            yield from self._drive(streams)
        finally:
            for req_id in streams:
                self.engine.abort(req_id)

    def _drive(self, streams) -> Iterator[StreamEvent]:
        while self.engine.has_unfinished():
            for out in self.engine.step():
                prompt_index, sample_index, stream = streams[out.req_id]
                delta = stream.push(out)
                if stream.hit_stop_string and out.finish_reason is None:
                    self.engine.abort(out.req_id)
                if delta.finish_reason is not None:
                    del streams[out.req_id]
                yield StreamEvent(prompt_index, sample_index, delta)

    def _add(self, req_id, token_ids, params, prompt_index, streams) -> None:
        """Sample 0 joins the engine; samples 1..n-1 are forked off it at its first token."""
        forks = [PendingFork(f"{req_id}-{i}", i) for i in range(1, params.n)]
        self.engine.add_request(req_id, token_ids, params, 0, forks=forks)
        # Samples after the first never see the prompt's logprobs: sample 0 reports them.
        sibling_params = dataclasses.replace(params, prompt_logprobs=None)
        for sample_index, sample_id in enumerate([req_id, *(f.req_id for f in forks)]):
            detok = IncrementalDetokenizer(self.tokenizer, token_ids)
            stream = SequenceStream(sample_id, params if sample_index == 0 else sibling_params, detok)
            streams[sample_id] = (prompt_index, sample_index, stream)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _empty_output(self, prompt: Prompt) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        return RequestOutput(str(next(self._ids)), text, self._tokenize(prompt), [])

    @staticmethod
    def _params_list(params, count: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * count
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"params has {len(params)} entries for {count} prompts")
        return list(params)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)


def _accumulate(output: CompletionOutput, delta: CompletionDelta) -> None:
    output.text += delta.text
    output.token_ids.extend(delta.token_ids)
    output.logprobs.extend(delta.logprobs)
    output.finish_reason = delta.finish_reason
    output.stop_reason = delta.stop_reason
