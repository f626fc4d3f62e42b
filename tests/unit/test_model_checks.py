"""Model folders the engine cannot serve are refused at start, in one line naming the folder and
what is wrong: by the engine's loader (what `LLM(...)` and every node's core run) and by the
router, which runs the same check (pdserve/engine/model_folder.py) without loading weights.

Every bad folder is built here from a good tiny model or a random transformers config; nothing
is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models
from transformers import (AutoConfig, BertConfig, BertForMaskedLM, FalconConfig, GPT2Config, GPTBigCodeConfig, LlamaConfig,
                          MistralConfig, PreTrainedTokenizerFast)

from pdserve.common.refusal import EXIT_USAGE
from pdserve.engine.model_facts import num_kv_heads
from pdserve.engine.model_folder import ModelRefused, open_model_folder
from pdserve.engine.model_loader import choose_impl, load_model
from pdserve.llm import LLM
from pdserve.router.model import load_router_model

TINY = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128)


@pytest.fixture(scope="module")
def good(tiny_model) -> Path:
    """The good folder every bad one is built from (copied first: the shared one is never changed)."""
    return tiny_model


def copy_of(good: Path, folder: Path) -> Path:
    shutil.copytree(good, folder)
    return folder


def with_tokenizer(good: Path, folder: Path) -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(good / name, folder / name)
    return folder


def no_tokenizer(good, tmp_path):
    folder = copy_of(good, tmp_path / "no-tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()
    return folder


def masked_lm(good, tmp_path):
    folder = tmp_path / "bert"
    BertForMaskedLM(BertConfig(**TINY)).save_pretrained(folder)
    return with_tokenizer(good, folder)


def sliding_window(good, tmp_path):
    folder = tmp_path / "mistral-window"
    MistralConfig(**TINY, sliding_window=64, max_position_embeddings=4096).save_pretrained(folder)
    return with_tokenizer(good, folder)


def alibi(good, tmp_path):
    folder = tmp_path / "falcon-alibi"  # Falcon-RW's layout: a position bias on every score
    FalconConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=128, alibi=True,
                 multi_query=False).save_pretrained(folder)
    return with_tokenizer(good, folder)


def fp8_weights(good, tmp_path):
    folder = tmp_path / "fp8"
    LlamaConfig(**TINY).save_pretrained(folder)
    save_file({"model.embed_tokens.weight": torch.zeros(128, 32, dtype=torch.float8_e4m3fn)},
              folder / "model.safetensors")
    return with_tokenizer(good, folder)


def quantized(good, tmp_path):
    folder = copy_of(good, tmp_path / "gptq")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "gptq"}}))
    return folder


def no_config(good, tmp_path):
    folder = copy_of(good, tmp_path / "no-config")
    (folder / "config.json").unlink()
    return folder


REFUSALS = [
    (no_tokenizer, "no tokenizer (tokenizer.json or tokenizer_config.json) there"),
    (masked_lm, "BertForMaskedLM is not a causal language model (...ForCausalLM)"),
    (sliding_window, "mistral: sliding window 64 < max_position_embeddings 4096; "
                     "the engine's attention has no sliding window"),
    (alibi, "falcon: ALiBi position bias (alibi: true); the engine's paged attention adds no bias"),
    (fp8_weights, "weights stored as F8_E4M3 (model.embed_tokens.weight) cannot run here: "
                  "the engine computes in float32 or bfloat16"),
    (quantized, "quantized weights (gptq) cannot run here: the engine computes in float32 or bfloat16"),
    (no_config, "no config.json there"),
]


@pytest.mark.parametrize("build, reason", REFUSALS, ids=[build.__name__ for build, _ in REFUSALS])
def test_the_loader_and_the_router_refuse_the_same_folders_in_one_line(good, tmp_path, build, reason):
    folder = build(good, tmp_path)
    with pytest.raises(ModelRefused) as loader:
        load_model(folder, torch.float32)
    with pytest.raises(ModelRefused) as router:
        load_router_model(folder)
    assert str(loader.value) == str(router.value) == f"model {folder}: {reason}"
    assert loader.value.cli_message() == f"--model {folder}: {reason}"
    assert loader.value.exit_code == EXIT_USAGE


@pytest.mark.parametrize("config, heads", [
    (FalconConfig(num_attention_heads=4, num_kv_heads=2), 1),  # Falcon-7B: multi-query
    (FalconConfig(num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True), 2),  # Falcon-40B
    (GPTBigCodeConfig(n_head=4, multi_query=True, num_key_value_heads=4), 1),
    (LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 2),
], ids=["falcon-multi-query", "falcon-new-decoder", "gpt-bigcode", "llama-gqa"])
def test_the_kv_heads_are_the_ones_the_model_computes(config, heads):
    assert num_kv_heads(config) == heads


def test_a_missing_folder_and_an_unknown_model_type(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(ModelRefused, match=f"^model {missing}: no such directory$"):
        open_model_folder(missing)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ModelRefused) as err:
        open_model_folder(tmp_path)
    # transformers' own words for it, on one line
    assert str(err.value).startswith(f"model {tmp_path}: config.json: ") and "no-such-model" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_tokenizer_that_does_not_load_or_makes_no_tokens(good, tmp_path):
    broken = copy_of(good, tmp_path / "broken")
    (broken / "tokenizer.json").unlink()  # tokenizer_config.json alone names a backend with nothing to load
    with pytest.raises(ModelRefused) as err:
        open_model_folder(broken)
    assert str(err.value).startswith(f"model {broken}: the tokenizer does not load: ")
    assert "\n" not in str(err.value)

    empty = copy_of(good, tmp_path / "empty")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (empty / name).unlink()
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab={}, merges=[]))).save_pretrained(empty)
    with pytest.raises(ModelRefused, match=f"^model {empty}: the tokenizer turns 'hello world' into no tokens$"):
        open_model_folder(empty)


def test_a_forced_native_forward_that_cannot_run_names_the_flag(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=128).save_pretrained(tmp_path)
    config = AutoConfig.from_pretrained(tmp_path, local_files_only=True)
    with pytest.raises(ModelRefused) as err:
        choose_impl(tmp_path, config, "native")
    assert err.value.cli_message() == (f"--model-impl native: cannot run {tmp_path}: model type 'gpt2' is not one "
                                       "of ['llama', 'mistral', 'qwen2', 'qwen3']")


def test_llm_refuses_a_masked_lm_before_loading_it(good, tmp_path):
    folder = masked_lm(good, tmp_path)
    with pytest.raises(ValueError, match=r"^model .*/bert: BertForMaskedLM is not a causal language model"):
        LLM(folder, dtype="float32")


def test_a_servable_folder_opens_with_its_tokenizer(good):
    opened = open_model_folder(good)
    assert opened.config.model_type == "llama"
    assert opened.tokenizer.encode("hello world", add_special_tokens=False)
