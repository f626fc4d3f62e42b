"""Greedy, constrained and beam search references from transformers `generate`, the exactness check against
them, and the peak of an `LLM`'s KV blocks over a call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pdserve.engine.model_loader import load_reference_model

NEAR_TIE = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]  # top-1 minus top-2 logit at each generated position


def greedy_references(model_dir, prompts: list[list[int]], max_new_tokens: list[int]) -> list[Reference]:
    model = load_reference_model(model_dir, torch.float32)
    refs = []
    for prompt, n in zip(prompts, max_new_tokens):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        gaps = []
        for step_logits in out.logits:
            top2 = torch.topk(step_logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        refs.append(Reference(out.sequences[0, len(prompt) :].tolist(), gaps))
    return refs


def assert_matches(outputs: list[list[int]], refs: list[Reference]) -> int:
    """Token-exact, except after a near-tie in the reference; returns how many near-ties explained a divergence."""
    near_ties = 0
    for i, (got, ref) in enumerate(zip(outputs, refs)):
        assert len(got) == len(ref.token_ids), f"prompt {i}: {len(got)} tokens, reference has {len(ref.token_ids)}"
        mismatch = next((j for j, (a, b) in enumerate(zip(got, ref.token_ids)) if a != b), None)
        if mismatch is None:
            continue
        gap = ref.top2_gaps[mismatch]
        assert gap < NEAR_TIE, f"prompt {i}: token {mismatch} is {got[mismatch]}, reference {ref.token_ids[mismatch]} (top-2 gap {gap:.2e})"
        print(f"prompt {i}: diverged at token {mismatch} on a near-tie (top-2 gap {gap:.2e})")
        near_ties += 1
    return near_ties


def transformers_beams(model_dir, prompt, params, eos: list[int] | None) -> tuple[list[list[int]], list[float] | None]:
    """`params`: beam_width, max_tokens, length_penalty (a BeamSearchParams). Each beam's generated
    tokens (cut after its eos), best first, and its score (None for width 1: greedy has none)."""
    model = load_reference_model(model_dir, torch.float32)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=params.beam_width, num_return_sequences=params.beam_width, do_sample=False,
            length_penalty=params.length_penalty, early_stopping=False, max_new_tokens=params.max_tokens,
            eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
        )
    sequences = []
    for row in out.sequences[:, len(prompt):].tolist():
        end = next((i + 1 for i, t in enumerate(row) if eos and t in eos), len(row))
        sequences.append(row[:end])
    # num_beams=1 is greedy search in transformers, which reports no sequence scores.
    return sequences, out.sequences_scores.tolist() if params.beam_width > 1 else None


def constrained_references(model_dir, prompts: list[list[int]], structured, max_new_tokens: int) -> list[list[int]]:
    """Greedy transformers `generate` under xgrammar's own HF logits processor on `structured`
    (a StructuredOutput) compiled for the model's tokenizer; each cut after its eos."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pdserve.engine.structured_output import grammar_of

    model = load_reference_model(model_dir, torch.float32)
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model_dir),
                                              vocab_size=model.config.vocab_size, stop_token_ids=eos)
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar_of(structured))
    out = []
    for prompt in prompts:
        with torch.inference_mode():
            tokens = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0,
                                    logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
        out.append(tokens[0, len(prompt):].tolist())
    return out


@contextlib.contextmanager
def peak_blocks(llm) -> Iterator[list[int]]:
    """The most KV blocks `llm`'s engine held after any step inside the block, as `[peak]`."""
    kv, step, peak = llm.engine.kv, llm.engine.step, [0]

    def counting_step():
        outputs = step()
        peak[0] = max(peak[0], kv.num_used_blocks)
        return outputs

    llm.engine.step = counting_step
    try:
        yield peak
    finally:
        del llm.engine.step
