"""Random test models and their tokenizer: built to disk, loaded back, served exactly.

Covers pdserve/model_factory.py and pdserve/engine/model_loader.py: every arch builds at the
tiny size and, loaded through the engine's paged attention, gives the logits of
transformers' own attention; smol135m has the published SmolLM2-135M shape; the
tokenizer round-trips text; the same seed gives the same weights.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, T5Config

from pdserve.engine.attention import ATTENTION_NAME, ForwardContext
from pdserve.common.paths import DEMO_MODEL_NAME, cached_model
from pdserve.model_factory import ARCHS, build_tokenizer, ensure_demo_model, make_config, make_model
from pdserve.engine.model_folder import check_servable
from pdserve.engine.model_loader import load_model, load_reference_model
from pdserve.engine.models.llama import NativeLlama
from pdserve.kernels import AttentionMetadata, cpu_ext, paged_attention, paged_attention_reference

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def add(x, y):\n    return x + y  # 🚀\n\n\tclass A: pass",
    "我们在服务器上运行大型语言模型。東京の天気は晴れです。안녕하세요",
    "emoji 😀👨‍👩‍👧‍👦🏳️‍🌈 flags 🇯🇵 and skin tones 👍🏽",
    "combining: e\u0301 a\u0308 n\u0303 — precomposed: é ä ñ",
    "مرحبا بالعالم नमस्ते Ελληνικά Кириллица",
    "  leading and trailing spaces  \n\n",
    "\x00\x01\x7f control chars and U+FFFD \ufffd itself",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∑ᵢ xᵢ² ≤ ∞ and rare CJK 𠀋𪚥",
]
# SmolLM2-135M as published (llama arch): 134,515,008 parameters.
SMOL_SHAPE = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
)
SMOL_LLAMA_PARAMS = 134_515_008


def paged_forward(loaded, token_ids: list[int], block_size: int = 4, dtype=torch.float32,
                  backend=paged_attention_reference) -> torch.Tensor:  # fmt: skip
    """One prefill of token_ids through the engine's attention; returns [len, vocab] logits."""
    num_blocks = (len(token_ids) + block_size - 1) // block_size
    block_ids = list(range(num_blocks + 3, 3, -1))  # non-contiguous, reversed
    positions = torch.arange(len(token_ids))
    slot_mapping = torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.tensor([0, len(token_ids)], dtype=torch.int32),
        seq_lens=torch.tensor([len(token_ids)], dtype=torch.int32),
        block_tables=torch.tensor([block_ids], dtype=torch.int32),
        num_decodes=0,
        block_size=block_size,
        query_lens_cpu=[len(token_ids)],
        seq_lens_cpu=[len(token_ids)],
    )
    shape = (num_blocks + 4, loaded.num_kv_heads, block_size, loaded.head_dim)
    k_caches = [torch.zeros(shape, dtype=dtype) for _ in range(loaded.num_layers)]
    v_caches = [torch.zeros(shape, dtype=dtype) for _ in range(loaded.num_layers)]
    ctx = ForwardContext(metadata, k_caches, v_caches, backend)
    with torch.inference_mode():
        return loaded.model(torch.tensor(token_ids), positions, ctx, torch.arange(len(token_ids)))


@pytest.mark.parametrize("impl", ["native", "transformers"])
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_and_paged_forward_matches_transformers(tiny_models, arch, impl):
    # Reference attention: the native model's Python layer loop (see the next test for its C++ one).
    loaded = load_model(tiny_models[arch], torch.float32, impl)
    assert loaded.impl == impl
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (3, 2, 16)
    assert loaded.vocab_size == 960 >= len(loaded.tokenizer)
    assert loaded.max_model_len == 4096
    assert loaded.eos_token_ids == [0]
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())

    token_ids = loaded.tokenizer("Paged attention must match: 世界 😀 def f(x): return x")["input_ids"]
    reference = load_reference_model(tiny_models[arch], torch.float32)
    with torch.inference_mode():
        expected = reference(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(paged_forward(loaded, token_ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_native_layer_stack_in_cpp_matches_transformers(tiny_models, arch, monkeypatch):
    # The fast attention on a whole prompt: the native model runs all layers in one C++ call.
    if not cpu_ext.available():
        pytest.skip("C++ CPU kernels unavailable")

    def python_loop(*args):
        raise AssertionError("the Python layer loop ran")

    monkeypatch.setattr(NativeLlama, "_layers_python", python_loop)
    loaded = load_model(tiny_models[arch], torch.float32, "native")
    token_ids = [(11 * i) % 900 + 1 for i in range(40)]
    with torch.inference_mode():
        expected = load_reference_model(tiny_models[arch], torch.float32)(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(paged_forward(loaded, token_ids, backend=paged_attention), expected, atol=1e-4, rtol=1e-4)


def copy_with_config(src, dst, **edit):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **edit}))
    return dst


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
])
def test_native_forward_matches_transformers_with_scaled_rope(tiny_models, tmp_path, rope):
    model_dir = copy_with_config(tiny_models["llama"], tmp_path / "scaled", rope_parameters={"rope_theta": 10000.0, **rope})
    loaded = load_model(model_dir, torch.float32, "native")
    token_ids = [(13 * i) % 900 + 1 for i in range(300)]  # past original_max_position_embeddings
    with torch.inference_mode():
        expected = load_reference_model(model_dir, torch.float32)(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(paged_forward(loaded, token_ids), expected, atol=1e-4, rtol=1e-4)


def test_transformers_impl_keeps_its_attention_apart_from_the_reference(tiny_models):
    loaded = load_model(tiny_models["llama"], torch.float32, "transformers")
    hf_model = loaded.model.model
    assert hf_model.config._attn_implementation == ATTENTION_NAME
    reference = load_reference_model(tiny_models["llama"], torch.float32)
    assert reference.config is not hf_model.config
    assert hf_model.config._attn_implementation == ATTENTION_NAME  # untouched by the reference


@pytest.mark.parametrize(("edit", "reason"), [
    ({"hidden_act": "gelu"}, "activation 'gelu'"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}, "RoPE type 'dynamic'"),
])
def test_auto_impl_is_native_for_the_llama_family_and_refuses_native_elsewhere(tiny_models, tmp_path, edit, reason):
    assert load_model(tiny_models["qwen3"], torch.float32).impl == "native"
    edited = copy_with_config(tiny_models["llama"], tmp_path / "edited", **edit)
    assert load_model(edited, torch.float32).impl == "transformers"
    with pytest.raises(ValueError, match=f"^model_impl native: cannot run .*{reason}"):
        load_model(edited, torch.float32, "native")


@pytest.mark.parametrize("arch", ARCHS)
def test_random_init_gives_varied_greedy_text_with_clear_margins(tiny_models, arch):
    model = load_reference_model(tiny_models[arch], torch.float32)
    for prompt in ([17, 300, 42], [5, 6, 7, 8, 9]):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0,
                output_logits=True, return_dict_in_generate=True,
            )
        new_tokens = out.sequences[0, len(prompt) :].tolist()
        gaps = [float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits]
        assert len(set(new_tokens)) >= 16, new_tokens
        assert sorted(gaps)[len(gaps) // 2] > 0.1  # median top-1/top-2 gap
        assert min(gaps) > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_smol135m_config_has_published_shape(arch):
    config = make_config(arch, "smol135m")
    for key, value in SMOL_SHAPE.items():
        assert getattr(config, key) == value, key
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.hidden_size // config.num_attention_heads == 64
    check_servable(config)
    if arch in ("llama", "mistral"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        assert sum(p.numel() for p in model.parameters()) == SMOL_LLAMA_PARAMS


def test_factory_configs_have_full_attention_only():
    assert make_config("mistral", "tiny").sliding_window is None
    assert set(make_config("qwen2", "tiny").layer_types) == {"full_attention"}
    assert make_config("qwen2", "tiny").num_hidden_layers == 3


def test_unservable_configs_are_refused(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="sliding window"):
        check_servable(MistralConfig(sliding_window=1024, max_position_embeddings=4096))
    with pytest.raises(ValueError, match="layer types"):
        check_servable(Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=0))
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_servable(T5Config())
    config = json.loads((tiny_models["mistral"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"sliding_window": 128}))
    with pytest.raises(ValueError, match="sliding window 128"):
        load_model(tmp_path, torch.float32)


def test_special_ids_are_endoftext(tiny_models):
    generation = json.loads((tiny_models["llama"] / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (0, 0, 0)
    tokenizer = load_model(tiny_models["llama"], torch.float32).tokenizer
    assert tokenizer.convert_ids_to_tokens(0) == "<|endoftext|>"
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 0, 0)


@pytest.mark.parametrize("arch", ARCHS)
def test_loaded_tokenizer_agrees_with_tokenizer_json(tiny_models, arch):
    # AutoTokenizer swaps in a model-specific class for some model types (qwen2).
    loaded = load_model(tiny_models[arch], torch.float32).tokenizer
    on_disk = Tokenizer.from_file(str(tiny_models[arch] / "tokenizer.json"))
    for text in TEXTS:
        assert loaded(text)["input_ids"] == on_disk.encode(text).ids
        # Qwen2Tokenizer normalises to NFC, as the real Qwen2 tokenizer does.
        expected = unicodedata.normalize("NFC", text) if arch == "qwen2" else text
        assert loaded.decode(loaded(text)["input_ids"]) == expected


@pytest.fixture(scope="module")
def tokenizers_by_style():
    return {"bytelevel": build_tokenizer(960), "qwen2": build_tokenizer(960, qwen2_style=True)}


def test_tokenizer_round_trips_fixed_texts(tokenizers_by_style):
    for text in TEXTS:
        ids = tokenizers_by_style["bytelevel"](text)["input_ids"]
        assert tokenizers_by_style["bytelevel"].decode(ids) == text
        nfc = unicodedata.normalize("NFC", text)
        assert tokenizers_by_style["qwen2"].decode(tokenizers_by_style["qwen2"](nfc)["input_ids"]) == nfc


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=64))
def test_tokenizer_round_trips_any_text(tokenizers_by_style, text):
    tokenizer = tokenizers_by_style["bytelevel"]
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tokenizer_vocab_sizes(tokenizers_by_style):
    assert len(tokenizers_by_style["bytelevel"]) == 960
    assert 257 < len(build_tokenizer(49152)) <= 49152


def weights_hash(model_dir) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(load_file(model_dir / "model.safetensors").items()):
        digest.update(name.encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def test_same_seed_gives_same_weights(tiny_models, tmp_path):
    again = make_model(tmp_path / "again", "qwen3", "tiny", seed=0)
    other = make_model(tmp_path / "other", "qwen3", "tiny", seed=1)
    assert weights_hash(again) == weights_hash(tiny_models["qwen3"])
    assert weights_hash(other) != weights_hash(again)
    assert (again / "tokenizer.json").read_bytes() == (tiny_models["qwen3"] / "tokenizer.json").read_bytes()


def test_make_model_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    make_model(tmp_path, "llama", "tiny", seed=7)
    torch.testing.assert_close(torch.rand(3), expected)


def test_bfloat16_model_is_saved_and_loaded_in_bfloat16(tmp_path):
    model_dir = make_model(tmp_path, "qwen2", "tiny", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(model_dir / "model.safetensors").values()} == {torch.bfloat16}
    loaded = load_model(model_dir, torch.bfloat16)
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    logits = paged_forward(loaded, [1, 2, 3, 4, 5, 6], dtype=torch.bfloat16)
    assert torch.isfinite(logits).all()


def test_bfloat16_checkpoint_in_float32_keeps_bf16_matrices_and_float32_results(tmp_path):
    # A CPU without native bf16 computes in float32; the bf16 checkpoint's matrices stay bf16
    # (same values, half the bytes). Logits match transformers' float32 forward of the upcast weights.
    model_dir = make_model(tmp_path, "qwen2", "tiny", dtype=torch.bfloat16)
    loaded = load_model(model_dir, torch.float32, "native")
    if cpu_ext.available():
        assert loaded.model.layers[0].gate_up.dtype == torch.bfloat16
    assert loaded.model.layers[0].input_norm.dtype == torch.float32
    reference = load_reference_model(model_dir, torch.float32)
    # 1 token: the GEMV kernel; 24 tokens (> GEMV_MAX_ROWS): torch's GEMM on a float32 copy.
    for token_ids in ([5], [(7 * i) % 900 + 1 for i in range(24)]):
        with torch.inference_mode():
            expected = reference(torch.tensor([token_ids])).logits[0]
        torch.testing.assert_close(paged_forward(loaded, token_ids), expected, atol=1e-4, rtol=1e-4)


def test_ensure_demo_model_builds_once(tmp_path):
    assert cached_model(DEMO_MODEL_NAME, tmp_path) is None
    first = ensure_demo_model(tmp_path)
    assert cached_model(DEMO_MODEL_NAME, tmp_path) == first  # what the launcher finds without torch
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name == "demo-llama-small"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-llama-small"]  # no staging left behind
