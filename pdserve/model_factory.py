"""Random transformer models and a real byte-level BPE tokenizer, built locally.

Owns: the shapes of the test/demo models (`tiny`, `small`, `smol135m`) for four
architectures, a seeded weight init that makes random models produce varied greedy
text with clear top-1 margins, the built-in training corpus, and the on-disk layout
(`save_pretrained` of model, tokenizer and generation config into one directory).
Must never download anything: every byte on disk is derived from `arch`, `size`,
`dtype` and `seed`.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

# What Qwen2Tokenizer rebuilds on load (see `build_tokenizer`); imported so the two agree.
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX as QWEN2_PRETOKENIZE_REGEX

from pdserve.common.paths import DEMO_MODEL_NAME, cached_model, default_cache_dir

ARCHS = ("llama", "qwen2", "mistral", "qwen3")
SIZES = ("tiny", "small", "smol135m")
SPECIAL_TOKEN = "<|endoftext|>"  # id 0: bos, eos and pad
# Tokenizer vocab for tiny/small (256 bytes + 1 special + merges); the model vocab
# is this rounded up to a multiple of 64.
SMALL_TOKENIZER_VOCAB = 960
# smol135m: train as many merges as the corpus yields (it stops well below this).
MAX_TOKENIZER_VOCAB = 49152
# Weight init (see `_init_weights`). transformers' default (std 0.02 everywhere) gives
# nearly flat logits and greedy text that repeats one token; exactness tests need
# varied text and a clear top-1/top-2 margin.
LOGIT_STD = 4.0  # std of the logits at init: top-1/top-2 gap median ≈ 0.8
NORM_WEIGHT_JITTER = 0.1  # norms start at 1 ± this, so a dropped norm weight shows
BIAS_STD = 0.1  # qwen2's qkv biases are random, so a dropped bias shows


@dataclass(frozen=True)
class InitScales:
    """How strongly the residual branches write and how sharp attention is at init."""

    # o_proj/down_proj write branch_gain / sqrt(num_layers) into the residual.
    branch_gain: float
    # Scales q and k (or qwen3's q/k norm weights): attention-score std ≈ qk_gain².
    qk_gain: float


UNTIED_INIT = InitScales(branch_gain=1.0, qk_gain=1.0)
# With tied embeddings the token just predicted is the row of E that best matched the
# last hidden state, so a random net falls into 1–5 token cycles. Branches that drown
# the token's own (small, lm_head-scaled) embedding and sharper attention break them.
TIED_INIT = InitScales(branch_gain=16.0, qk_gain=1.5)

_SHAPES: dict[str, dict[str, object]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=4096,
        tie_word_embeddings=False, rope_theta=10000.0,
    ),
    "small": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        head_dim=32, intermediate_size=512, max_position_embeddings=4096,
        tie_word_embeddings=False, rope_theta=10000.0,
    ),
    # The published SmolLM2-135M shape.
    "smol135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
        tie_word_embeddings=True, rope_theta=100000.0, vocab_size=49152,
    ),
}

_ENGLISH_WORDS = (
    "the a of to and in is that for it with as was on be by at this from or an are not "
    "which have but had they were his her one all there been has when who will more no "
    "if out so said what up its about into than them can only other new some time could "
    "these two may then do first any like now my such make over our even most me state "
    "after also made many did must before back see through way where get much go well "
    "your know should down work year because come people just say each those take day "
    "good how long little very world still own here between both life being under never "
    "system server request token model cache block decode prefill batch queue memory "
    "latency throughput engine kernel layer attention scheduler transfer network"
).split()

_CODE_TEMPLATES = (
    "def {f}({a}, {b}):\n    \"\"\"Return the {n} of {a} and {b}.\"\"\"\n    return {a} {op} {b}\n",
    "class {C}:\n    def __init__(self, {a}: int) -> None:\n        self.{a} = {a}\n\n"
    "    def {f}(self) -> int:\n        return self.{a} {op} {k}\n",
    "for {a} in range({k}):\n    if {a} % 2 == 0:\n        print(f\"{{{a}}} is even\")\n",
    "{a} = [{b} * {k} for {b} in {f}({a}s)]\nassert len({a}) == {k}, \"bad length\"\n",
    "fn {f}({a}: u32, {b}: u32) -> u32 {{\n    {a}.wrapping_{n}({b})\n}}\n",
    "int {f}(int {a}, int {b}) {{ return {a} {op} {b}; }}  // {n}\n",
    "{{\"{a}\": {k}, \"{b}\": [{k}, {k}], \"name\": \"{C}\"}}\n",
)

_NON_ASCII = (
    "Le café où nous étions était très agréable, à côté de la forêt.",
    "Über die Brücke gehen fünf Mädchen; die Straße ist groß.",
    "El niño comió piña y jalapeños en la mañana, ¿verdad?",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.",
    "我们在服务器上运行大型语言模型，预填充和解码分开进行。",
    "東京の天気は晴れです。今日はとても暖かいですね。",
    "안녕하세요, 만나서 반갑습니다. 오늘 날씨가 좋네요.",
    "مرحبا بالعالم، هذا نص تجريبي باللغة العربية.",
    "नमस्ते दुनिया, यह एक परीक्षण वाक्य है।",
    "Emoji time 😀🚀✨ — done ✅ with naïve coöperation and résumé.",
    "Math: ∑ᵢ xᵢ² ≤ ∞, π ≈ 3.14159, α + β = γ, 10 °C → 50 °F.",
)


def build_corpus(seed: int = 0, num_docs: int = 1500) -> list[str]:
    """The deterministic training corpus: English-ish prose, code and non-ASCII text."""
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        kind = i % 5
        if kind < 3:
            docs.append(_prose(rng))
        elif kind == 3:
            docs.append(_code(rng))
        else:
            docs.append(rng.choice(_NON_ASCII) + " " + _prose(rng))
    return docs


def _prose(rng: random.Random) -> str:
    sentences = []
    for _ in range(rng.randint(1, 4)):
        words = [rng.choice(_ENGLISH_WORDS) for _ in range(rng.randint(4, 14))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 4096)))
        sentences.append(" ".join(words) + rng.choice(".!?.,;"))
    return " ".join(sentences)


def _code(rng: random.Random) -> str:
    names = ("x", "y", "count", "value", "items", "seq", "block", "token")
    return rng.choice(_CODE_TEMPLATES).format(
        f=rng.choice(("add", "merge", "step", "compute", "schedule", "load")),
        a=rng.choice(names[:4]),
        b=rng.choice(names[4:]),
        C=rng.choice(("Engine", "BlockPool", "Request", "Scheduler")),
        n=rng.choice(("sum", "add", "sub", "mul")),
        op=rng.choice("+-*"),
        k=rng.randint(0, 256),
    )


# ChatML, as Qwen's models use it: what /v1/chat/completions and LLM.chat render messages with.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(
    vocab_size: int, qwen2_style: bool = False, model_max_length: int = 4096, seed: int = 0
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus; any UTF-8 text round-trips.

    `qwen2_style` trains with the pipeline transformers' Qwen2Tokenizer rebuilds on
    load (its pre-tokenizer regex and an NFC normalizer): AutoTokenizer always uses
    that class for a `qwen2` model dir, and the tokenizer.json on disk must agree with
    what it loads. Such a tokenizer round-trips NFC-normalised text exactly.
    """
    tok = Tokenizer(models.BPE())
    tok.decoder = decoders.ByteLevel()
    if qwen2_style:
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[SPECIAL_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(build_corpus(seed), trainer=trainer)
    assert tok.token_to_id(SPECIAL_TOKEN) == 0, "the special token must be id 0"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SPECIAL_TOKEN,
        eos_token=SPECIAL_TOKEN,
        pad_token=SPECIAL_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        chat_template=CHAT_TEMPLATE,
    )


def make_config(arch: str, size: str, vocab_size: int | None = None, num_kv_heads: int | None = None) -> PretrainedConfig:
    """The model config for `arch` × `size`; `vocab_size` is ignored for smol135m; `num_kv_heads`
    (a divisor of the size's attention heads) changes the head grouping: MHA, GQA or MQA."""
    _check_arch_and_size(arch, size)
    shape = dict(_SHAPES[size])
    shape.setdefault("vocab_size", vocab_size or 1024)
    if num_kv_heads is not None:
        shape["num_key_value_heads"] = num_kv_heads
    theta = shape.pop("rope_theta")
    common = dict(
        shape,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
        rms_norm_eps=1e-5, hidden_act="silu",
    )
    if arch == "llama":
        return LlamaConfig(**common, attention_bias=False, mlp_bias=False)
    if arch == "qwen2":
        # Qwen2 always has q/k/v biases; its `head_dim` is hidden // heads.
        common.pop("head_dim")
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "mistral":
        # The engine's attention has no sliding window.
        return MistralConfig(**common, sliding_window=None)
    return Qwen3Config(**common, attention_bias=False, use_sliding_window=False)


def make_model(
    out_dir: str | os.PathLike,
    arch: str,
    size: str,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    num_kv_heads: int | None = None,
) -> Path:
    """Build a seeded random model plus tokenizer and `save_pretrained` both to out_dir
    (`num_kv_heads`: see make_config)."""
    _check_arch_and_size(arch, size)
    out = Path(out_dir)
    target = MAX_TOKENIZER_VOCAB if size == "smol135m" else SMALL_TOKENIZER_VOCAB
    max_len = int(_SHAPES[size]["max_position_embeddings"])
    # The tokenizer never depends on `seed`: only the weights do.
    tokenizer = build_tokenizer(target, qwen2_style=arch == "qwen2", model_max_length=max_len)
    config = make_config(arch, size, vocab_size=_round_up(len(tokenizer), 64), num_kv_heads=num_kv_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model = model.to(dtype).eval()
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def _check_arch_and_size(arch: str, size: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Re-initialise every parameter from a private generator (global RNG untouched).

    Linear weights get std gain/sqrt(fan_in), so a sublayer maps O(1) inputs to O(1)
    outputs. The lm_head gets LOGIT_STD/sqrt(hidden): after the final RMSNorm the
    logits then have std ≈ LOGIT_STD. Untied embeddings get std 1; tied ones share
    the lm_head's scale.
    """
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    scales = TIED_INIT if config.tie_word_embeddings else UNTIED_INIT
    head_std = LOGIT_STD / math.sqrt(config.hidden_size)
    branch_std = scales.branch_gain / math.sqrt(config.num_hidden_layers)
    for name, param in model.named_parameters():  # tied weights appear once
        noise = torch.randn(param.shape, generator=gen)
        if name.endswith("embed_tokens.weight"):
            std = head_std if config.tie_word_embeddings else 1.0
        elif name == "lm_head.weight":
            std = head_std
        elif name.endswith((".q_norm.weight", ".k_norm.weight")):
            param.copy_(scales.qk_gain * (1.0 + NORM_WEIGHT_JITTER * noise))
            continue
        elif "norm" in name:
            param.copy_(1.0 + NORM_WEIGHT_JITTER * noise)
            continue
        elif name.endswith(".bias"):
            std = BIAS_STD
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            std = branch_std / math.sqrt(param.shape[-1])
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            std = scales.qk_gain / math.sqrt(param.shape[-1])
        else:
            std = 1.0 / math.sqrt(param.shape[-1])
        param.copy_(noise * std)


def ensure_demo_model(cache_dir: str | os.PathLike | None = None) -> Path:
    """Build the llama-small demo model once under the cache dir; reuse it afterwards."""
    return ensure_cached_model(DEMO_MODEL_NAME, "llama", "small", torch.float32, cache_dir)


def ensure_cached_model(
    name: str, arch: str, size: str, dtype: torch.dtype, cache_dir: str | os.PathLike | None = None
) -> Path:
    """Build `arch`/`size` in `dtype` once as `name` under the cache dir; reuse it afterwards."""
    cached = cached_model(name, cache_dir)
    if cached is not None:
        return cached
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / name
    root.mkdir(parents=True, exist_ok=True)
    # Build aside and rename, so a concurrent or interrupted build never leaves a
    # half-written directory at the final path.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-build-", dir=root))
    try:
        make_model(staging, arch, size, dtype=dtype)
        staging.rename(final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
