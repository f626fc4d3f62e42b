"""Every causal-LM architecture of transformers' auto mapping, tiny with random weights, through
`LLM` as a user starts it (pdserve/model_sweep.py): token-exact against transformers `generate`
in float32, or refused at start in one line naming the folder and the reason. Never wrong
tokens, never a crash. A type whose config the generic recipe cannot shrink is skipped, saying
why (docs/models.md lists them)."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.engine.model_folder import ModelRefused
from pdserve.engine.sampling_params import SamplingParams
from pdserve.llm import LLM
from pdserve.model_factory import SMALL_TOKENIZER_VOCAB, build_tokenizer
from pdserve.model_sweep import Outcome, causal_lm_types, serve_and_compare, sweep_one
from pdserve.tiny_models import build_tiny_model

# Served exactly before this sweep existed, or made so by it (StableLM and Nemotron drop the
# attention kwargs on the way down), or since transformers 5.25 (its Falcon attention goes through
# AttentionInterface): a refusal of any of them is a regression, not a pass.
MUST_BE_EXACT = ("llama", "qwen2", "mistral", "qwen3", "gpt_neox", "phi3", "phi", "granite", "olmo2", "gpt2",
                 "gemma", "qwen3_moe", "mixtral", "opt", "starcoder2", "gptj", "cohere", "stablelm", "nemotron",
                 "falcon")
NATIVE = ("llama", "qwen2", "mistral", "qwen3")


@pytest.fixture(scope="module")
def tokenizer():
    torch.set_num_threads(2)
    return build_tokenizer(SMALL_TOKENIZER_VOCAB)


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_served_exactly_or_refused_at_start(model_type, tmp_path, tokenizer):
    result = sweep_one(model_type, tmp_path / model_type, tokenizer)
    if result.outcome is Outcome.NOT_BUILT:
        pytest.skip(f"{model_type}: not built: {result.detail}")
    assert result.outcome in (Outcome.EXACT, Outcome.REFUSED), f"{model_type}: {result.outcome.value}: {result.detail}"
    if model_type in MUST_BE_EXACT:
        assert result.outcome is Outcome.EXACT, f"{model_type}: {result.detail}"
        assert result.detail == ("native" if model_type in NATIVE else "transformers")


@pytest.mark.parametrize("model_type, reason", [
    # Its attention ignores AttentionInterface (Falcon's did before transformers 5.25, and answered
    # wrong tokens on packed batches when served).
    ("gpt_neo", "GPTNeoForCausalLM: the engine's paged attention ran for layers none of 2 in one step; "
                "this model class computes attention its own way"),
    ("bloom", "bloom: the config names no maximum length (max_position_embeddings; ALiBi and recurrent "
              "models have none)"),
    ("doge", "DogeForCausalLM: its attention asks for an attention mask or bias of its own, which the "
             "engine's paged attention does not do"),
    ("bert-generation", "BertGenerationDecoder: its attention asks for attention both ways (not causal), which "
                        "the engine's paged attention does not do"),
])
def test_a_refusal_is_one_line_naming_the_folder(model_type, reason, tmp_path, tokenizer):
    folder = build_tiny_model(model_type, tmp_path / model_type, tokenizer)
    with pytest.raises(ModelRefused) as refused:
        LLM(folder, dtype="float32", num_blocks=64)
    assert str(refused.value) == f"model {folder}: {reason}"
    assert refused.value.cli_message() == f"--model {folder}: {reason}"


def test_the_logits_check_refuses_what_the_attention_probe_cannot_see(tmp_path, tokenizer, monkeypatch):
    # A model whose every layer runs the engine's attention but whose logits are still wrong (here:
    # positions shifted by one, as a model that numbers positions its own way would have them).
    from pdserve.engine.models import hf

    folder = build_tiny_model("gpt2", tmp_path / "gpt2", tokenizer)
    forward = hf.TransformersCausalLM.forward
    monkeypatch.setattr(hf.TransformersCausalLM, "forward",
                        lambda self, ids, positions, ctx, rows: forward(self, ids, positions + 1, ctx, rows))
    with pytest.raises(ModelRefused, match=r"GPT2LMHeadModel: on this engine its next-token logits after \d+ tokens "
                                           r"differ from its own computation \(cosine similarity 0\.\d+\)"):
        LLM(folder, dtype="float32", num_blocks=64)


def test_the_first_steps_leave_the_block_pool_as_they_found_it(tmp_path, tokenizer):
    folder = build_tiny_model("gpt2", tmp_path / "gpt2", tokenizer)
    llm = LLM(folder, dtype="float32", num_blocks=64)
    pool = llm.engine.kv.pool
    assert (pool.num_free_blocks, llm.engine.kv.num_used_blocks) == (64, 0)
    # The free queue is untouched: the first request takes block 0 on, as on a fresh pool.
    request = llm.engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    llm.engine.step()
    assert llm.engine.kv.block_ids(request.req_id) == [0]


def test_every_type_that_must_be_exact_is_in_the_mapping():
    # Otherwise the sweep would stop checking it without a word.
    assert set(MUST_BE_EXACT) <= set(causal_lm_types())


def test_falcon_40b_layout_is_served_exactly(tmp_path, tokenizer):
    # The new decoder architecture (Falcon-40B/180B) has grouped KV heads although its config also
    # says multi_query: the KV cache must hold num_kv_heads of them, not the one multi-query has.
    layout = {"new_decoder_architecture": True, "num_kv_heads": 2}
    folder = build_tiny_model("falcon", tmp_path / "falcon-40b", tokenizer, overrides=layout)
    assert json.loads((folder / "config.json").read_text())["multi_query"] is True
    result = serve_and_compare("falcon", folder, tokenizer)
    assert (result.outcome, result.detail) == (Outcome.EXACT, "transformers")
