"""Any transformers causal-LM architecture, built tiny with random weights, for the model sweep.

Owns the one recipe that shrinks a config of any family (`tiny_config`: transformers' default
config of the model type, its size keys set small wherever the class has them, its per-layer
lists cut to the layer count), a weight init that gives varied greedy text with clear top-1
margins in any family (`init_weights`), and the folder it saves (`build_tiny_model`: weights,
the demo tokenizer, a generation config with eos 0). A family whose config does not shrink by
that recipe raises `NotBuilt` with transformers' own reason; nothing is special-cased by name.

Must never: download anything (every byte comes from the model type and the seed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PretrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pdserve.engine.model_folder import one_line
from pdserve.model_factory import LOGIT_STD, NORM_WEIGHT_JITTER, BIAS_STD

TINY_VOCAB = 1024  # the demo tokenizer's 960 tokens, rounded up
TINY_LAYERS = 2
# Set on the (text) config wherever its class has the key; MoE keys keep experts few and small.
TINY_SIZES: dict[str, object] = dict(
    hidden_size=64, num_hidden_layers=TINY_LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=TINY_VOCAB, max_position_embeddings=512, rotary_dim=8,
    num_local_experts=4, num_experts=4, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1,
    moe_intermediate_size=64, shared_expert_intermediate_size=64,
    bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
)
MAX_TINY_PARAMS = 30_000_000  # a family whose sizes live in keys of its own stays large: not built


class NotBuilt(Exception):
    """This model type's config does not shrink by the generic recipe; the message says why."""


def tiny_config(model_type: str) -> PretrainedConfig:
    try:
        config = AutoConfig.for_model(model_type)
        text = config.get_text_config()
        num_layers = text.num_hidden_layers if hasattr(text, "num_hidden_layers") else None
        for key, value in TINY_SIZES.items():
            if hasattr(text, key):
                _set(text, key, value)
        for key, value in list(text.to_dict().items()):  # layer_types, mlp_layer_types, ...
            if isinstance(value, list) and num_layers is not None and len(value) == num_layers:
                _set(text, key, value[:TINY_LAYERS])
    except Exception as exc:  # noqa: BLE001 - transformers' config classes raise anything
        raise NotBuilt(one_line(exc)) from exc
    return config


def _set(config: PretrainedConfig, key: str, value: object) -> None:
    try:
        setattr(config, key, value)
    except (AttributeError, TypeError, ValueError):
        pass  # a derived, read-only key: the class computes it from others


@torch.no_grad()
def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from a private generator: norms 1 ± jitter, biases small, the input
    embedding std 1, the output head LOGIT_STD / sqrt(hidden) (logit std ≈ LOGIT_STD), any other
    matrix std 1 / sqrt(fan_in) (a sublayer maps O(1) to O(1))."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.get_text_config().hidden_size
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=gen)
        if param.dim() == 1:
            is_bias = name.endswith("bias")
            param.copy_(BIAS_STD * noise if is_bias or "norm" not in name else 1.0 + NORM_WEIGHT_JITTER * noise)
        elif head is not None and param is head.weight:
            param.copy_(noise * LOGIT_STD / math.sqrt(hidden))
        elif embed is not None and param is embed.weight:
            param.copy_(noise)
        else:
            param.copy_(noise / math.sqrt(param.shape[-1]))


def build_tiny_model(model_type: str, out_dir: Path, tokenizer: PreTrainedTokenizerBase, seed: int = 0,
                     overrides: Mapping[str, object] = MappingProxyType({})) -> Path:
    """Save a tiny random `model_type` with the demo tokenizer to out_dir; `NotBuilt` if it cannot be.
    `overrides`: config keys set after shrinking (a layout of the family the default config lacks)."""
    config = tiny_config(model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    try:
        with torch.device("meta"):
            num_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if num_params > MAX_TINY_PARAMS:
            raise NotBuilt(f"its config does not shrink: {num_params / 1e6:.0f}M parameters at the sweep's sizes")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        init_weights(model, seed)
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model.save_pretrained(out_dir)
    except NotBuilt:
        raise
    except Exception as exc:  # noqa: BLE001 - a family's own validation, missing optional packages
        raise NotBuilt(one_line(exc)) from exc
    tokenizer.save_pretrained(out_dir)
    return out_dir
