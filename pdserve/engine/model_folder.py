"""Is this folder a model the engine can serve? Answered once, at start, before any weight loads.

Owns the checks every entry point runs on `--model DIR` (the router, every node kind's engine
core, `LLM(...)`), in this order: the folder and its config.json exist and parse; the config
names a causal language model (transformers' `...ForCausalLM` classes; a masked LM or an
encoder-decoder saved beside a tokenizer would otherwise "generate"); its attention is one the
engine reproduces exactly (`unservable_reason`); its weights are stored in a dtype the engine
computes from (float32, bfloat16, float16; not fp8 or quantized, which need kernels this CPU
engine does not have); and it has a tokenizer that loads and turns text into tokens. The
answer is a `ModelFolder` (config + tokenizer, reused by the caller) or `ModelRefused`, whose
one line names the folder and what is wrong.

It imports no torch and never loads weights (a safetensors header is plain JSON), so the router,
which runs no model, refuses the same folders the nodes do. It never reaches the network.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig
from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
                                                    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pdserve.common.config_flags import flag_name
from pdserve.common.refusal import Refused
from pdserve.engine.model_facts import num_kv_heads, optional

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROBE_TEXT = "hello world"  # a tokenizer that makes no tokens of this would refuse every prompt
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# safetensors dtype names the engine converts from exactly; integer buffers (position ids) are
# not weights and pass; any other float type (F8_*, F4, ...) needs scales and kernels it lacks.
FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")
MAX_REASON_CHARS = 300


class ModelRefused(Refused, ValueError):
    """A model folder this engine cannot serve. `str()` names the field (`model /x: ...`, what
    `LLM(...)` raises), `cli_message()` the flag (`--model /x: ...`, what a command prints)."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} {value}: {reason}")

    def cli_message(self) -> str:
        return f"{flag_name(self.field)} {self.value}: {self.reason}"


@dataclass(frozen=True)
class ModelFolder:
    path: Path
    config: PretrainedConfig
    tokenizer: PreTrainedTokenizerBase


def model_name(folder: str | os.PathLike) -> str:
    """The model's name across a cluster: its folder's name, so machines with different paths
    to the same model agree (the KV handshake and the router's registration compare it)."""
    return Path(folder).resolve().name


def open_model_folder(folder: str | os.PathLike) -> ModelFolder:
    """The folder's config and tokenizer, or `ModelRefused` naming the first thing that is wrong."""
    path = Path(folder)
    if not path.is_dir():
        raise ModelRefused("model", folder, "no such directory")
    if not (path / "config.json").is_file():
        raise ModelRefused("model", folder, "no config.json there")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:  # unparsable JSON, an unknown model_type
        raise ModelRefused("model", folder, f"config.json: {one_line(exc)}") from exc
    reason = unservable_reason(config) or _weights_reason(path, config)
    if reason is not None:
        raise ModelRefused("model", folder, reason)
    return ModelFolder(path, config, _tokenizer(path, folder))


def unservable_reason(config: PretrainedConfig) -> str | None:
    """Why the engine cannot serve this config's model, or None: not a causal LM, or a feature
    the engine's attention cannot reproduce."""
    name = config.model_type
    if config.is_encoder_decoder:
        return f"{name}: encoder-decoder models are not supported (decoder-only causal LMs only)"
    reason = _not_causal_reason(config) or _not_decoder_only_reason(config)
    if reason is not None:
        return reason
    text = config.get_text_config()
    try:
        return _attention_shape_reason(name, text) or _layers_reason(name, text)
    except RuntimeError as exc:  # a config of per-layer shapes refuses a read of one global shape
        return f"{name}: layers of different shapes are not supported ({one_line(exc)})"


def _layers_reason(name: str, text: PretrainedConfig) -> str | None:
    # transformers 5 lists each layer's attention kind; anything else than full
    # attention (sliding, chunked, linear/recurrent) would silently differ.
    layer_types = set(optional(text, "layer_types") or [])
    if layer_types - {"full_attention"}:
        return f"{name}: layer types {sorted(layer_types)} are not supported; only full attention is"
    window = optional(text, "sliding_window")
    window_enabled = optional(text, "use_sliding_window") is not False
    if window is not None and window_enabled and window < text.max_position_embeddings:
        return (f"{name}: sliding window {window} < max_position_embeddings {text.max_position_embeddings}; "
                "the engine's attention has no sliding window")
    if text.num_attention_heads % num_kv_heads(text):
        return f"{name}: {text.num_attention_heads} heads is not a multiple of the KV heads"
    return None


def check_servable(config: PretrainedConfig) -> None:
    """Raise ValueError with `unservable_reason` (for a config that has no folder)."""
    reason = unservable_reason(config)
    if reason is not None:
        raise ValueError(reason)


def _not_causal_reason(config: PretrainedConfig) -> str | None:
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = optional(config, "architectures") or []
    if architectures and not causal.intersection(architectures):
        return f"{', '.join(architectures)} is not a causal language model (...ForCausalLM)"
    if not architectures and config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return f"model type {config.model_type!r} has no causal language model (...ForCausalLM) in transformers"
    return None


def _not_decoder_only_reason(config: PretrainedConfig) -> str | None:
    """A `...ForCausalLM` class whose family is not decoder-only: an encoder's (BERT, RoBERTa:
    attention both ways unless reconfigured, position ids offset by the padding id) or the
    decoder half of an encoder-decoder (BART, Pegasus: its layer shapes are the decoder_* keys)."""
    name = config.model_type
    if name in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        return f"{name}: the decoder of an encoder-decoder architecture, not a decoder-only causal LM"
    if name in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return (f"{name}: an encoder architecture (transformers has it as a masked LM too), "
                "not a decoder-only causal LM")
    return None


def _attention_shape_reason(name: str, text: PretrainedConfig) -> str | None:
    """Layers the paged KV cache (per layer: K and V of `num_kv_heads` heads of one size,
    positions up to a known maximum) cannot hold."""
    if not hasattr(text, "num_attention_heads"):
        return f"{name}: no attention heads (a state-space or recurrent model); the engine serves attention models"
    if optional(text, "kv_lora_rank") is not None:
        return f"{name}: multi-head latent attention (kv_lora_rank) is not supported; the KV cache holds K and V per head"
    if not hasattr(text, "max_position_embeddings"):
        return (f"{name}: the config names no maximum length (max_position_embeddings; ALiBi and recurrent "
                "models have none)")
    if any(key.startswith("mamba_") for key in text.to_dict()):
        return f"{name}: Mamba layers beside attention; their state is not in the paged KV cache"
    if optional(text, "alibi"):  # Falcon's flag (Falcon-RW): a bias on every score
        return f"{name}: ALiBi position bias (alibi: true); the engine's paged attention adds no bias"
    return None


def _weights_reason(path: Path, config: PretrainedConfig) -> str | None:
    """Quantized or fp8 weights: the engine computes in float32 or bfloat16 from plain float weights."""
    quantization = optional(config, "quantization_config")
    if quantization:
        method = quantization.get("quant_method", "unknown") if isinstance(quantization, dict) else "unknown"
        return f"quantized weights ({method}) cannot run here: the engine computes in float32 or bfloat16"
    for name, dtype in _stored_dtypes(path):
        if dtype.startswith("F") and dtype not in FLOAT_DTYPES:
            return f"weights stored as {dtype} ({name}) cannot run here: the engine computes in float32 or bfloat16"
    return None


def _stored_dtypes(path: Path) -> list[tuple[str, str]]:
    """(tensor name, safetensors dtype) of every tensor, from the files' JSON headers only."""
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [SAFETENSORS_FILE] if (path / SAFETENSORS_FILE).is_file() else []
    out = []
    for file in files:
        with open(path / file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        out += [(name, info["dtype"]) for name, info in header.items() if name != "__metadata__"]
    return out


def _tokenizer(path: Path, folder: str | os.PathLike) -> PreTrainedTokenizerBase:
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelRefused("model", folder, f"no tokenizer ({' or '.join(TOKENIZER_FILES)}) there")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken tokenizer
        raise ModelRefused("model", folder, f"the tokenizer does not load: {one_line(exc)}") from exc
    if not tokenizer.encode(PROBE_TEXT, add_special_tokens=False):
        raise ModelRefused("model", folder, f"the tokenizer turns {PROBE_TEXT!r} into no tokens")
    return tokenizer


def one_line(exc: BaseException) -> str:
    """An exception as one line of at most MAX_REASON_CHARS, for a refusal's reason."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."
