"""Load a causal LM from disk, on the native Llama-family forward or on transformers itself,
either way wired to the engine's paged attention.

Owns: reading a model directory (weights, config, tokenizer, generation config) once
pdserve/engine/model_folder.py has accepted it, choosing the implementation (`model_impl`; a forced
`native` that cannot run the checkpoint is refused), and the shape facts the KV cache is sized
from (`num_layers`, `num_kv_heads`, `head_dim`, ...). Every refusal is a `ModelRefused` raised
before the weights load, except a transformers class that turns out not to take the engine's
attention. It never edits the files on disk and never reaches the network (`local_files_only`).
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.distributed import DistributedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pdserve.engine.attention import register_paged_attention
from pdserve.engine.config import MODEL_IMPLS
from pdserve.engine.model_facts import eos_token_ids, head_dim, num_kv_heads
from pdserve.engine.model_folder import ModelRefused, one_line, open_model_folder
from pdserve.engine.models import CausalLM
from pdserve.engine.models.hf import TransformersCausalLM
from pdserve.engine.models.llama import load_native_llama, unsupported_reason
from pdserve.engine.parallel import TPShard, split_reason

log = logging.getLogger(__name__)

REFERENCE_ATTENTION = "sdpa"


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM  # eval mode, no grad, writing and reading the engine's paged KV cache
    impl: str  # "native" or "transformers": which implementation runs it
    tokenizer: PreTrainedTokenizerBase
    config: PretrainedConfig
    eos_token_ids: list[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # rows of the lm_head (may exceed the tokenizer's vocab)
    max_model_len: int
    shard: TPShard = TPShard()  # which rank of the node's tensor-parallel group this copy is
    device: torch.device = torch.device("cpu")  # where the weights are; the caches and step tensors follow
    kv_heads: tuple[int, int] | None = None  # the global KV heads this rank caches; None: all

    @property
    def local_kv_heads(self) -> tuple[int, int]:
        return self.kv_heads or (0, self.num_kv_heads)

    @property
    def num_local_kv_heads(self) -> int:
        start, end = self.local_kv_heads
        return end - start


def load_model(model_dir: str | os.PathLike, dtype: torch.dtype | str, impl: str = "auto",
               shard: TPShard = TPShard(), device: torch.device | str = "cpu") -> LoadedModel:
    """Load weights, tokenizer and config with the chosen implementation (see choose_impl), the
    weights on `device`; on a tensor-parallel rank (`shard`), only that rank's slice of the
    weights and KV heads."""
    folder = open_model_folder(model_dir)
    path, config, tokenizer = folder.path, folder.config, folder.tokenizer
    impl = choose_impl(path, config, impl)
    text = config.get_text_config()
    _check_split(text, impl, shard)
    torch_dtype, device = _as_dtype(dtype), torch.device(device)
    if impl == "native":
        model = load_native_llama(path, config, torch_dtype, shard, device)
    else:
        model = TransformersCausalLM(_load_transformers(path, torch_dtype, shard).to(device))
    model.eval().requires_grad_(False)
    return LoadedModel(
        model=model,
        impl=impl,
        tokenizer=tokenizer,
        config=config,
        eos_token_ids=list(eos_token_ids(path, config, tokenizer.eos_token_id)),
        num_layers=text.num_hidden_layers,
        num_kv_heads=num_kv_heads(text),
        head_dim=head_dim(text),
        vocab_size=text.vocab_size,
        max_model_len=text.max_position_embeddings,
        shard=shard,
        device=device,
        kv_heads=shard.kv_heads(num_kv_heads(text)),
    )


def check_tensor_parallel(model_dir: str | os.PathLike, impl: str, size: int) -> None:
    """Refuse a folder, or a tensor-parallel size its shapes cannot split, before any rank starts."""
    folder = open_model_folder(model_dir)
    _check_split(folder.config.get_text_config(), choose_impl(folder.path, folder.config, impl), TPShard(0, size))


def _check_split(text: PretrainedConfig, impl: str, shard: TPShard) -> None:
    """Refuse, before any weight loads, a tensor-parallel size the model's shapes cannot split."""
    reason = split_reason(shard.size, text.num_attention_heads, num_kv_heads(text),
                          getattr(text, "intermediate_size", None), replicates_kv=impl == "native")
    if reason is not None:
        raise ModelRefused("tensor_parallel_size", shard.size, reason)


def choose_impl(path: Path, config: PretrainedConfig, impl: str) -> str:
    """`auto`: the native forward where the architecture has one, else transformers."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {MODEL_IMPLS}, got {impl!r}")
    reason = unsupported_reason(path, config)
    if impl == "native" and reason is not None:
        raise ModelRefused("model_impl", impl, f"cannot run {path}: {reason}")
    if impl == "auto":
        impl = "transformers" if reason is not None else "native"
        log.info("model %s runs on the %s implementation%s", path.name, impl, f" ({reason})" if reason else "")
    return impl


def _load_transformers(path: Path, dtype: torch.dtype, shard: TPShard) -> torch.nn.Module:
    # transformers' own tensor-parallel plan for the architecture, on the process group the node's
    # ranks already joined (pdserve/ranks/tp_group.py); tp_size is explicit: without it transformers reads
    # $WORLD_SIZE and, unset, silently loads the whole model on every rank. Each rank holds a
    # contiguous block of the heads, as pdserve/engine/parallel.py says; every rank gets the whole logits.
    parallel = {} if shard.is_single else {"distributed_config": DistributedConfig(tp_size=shard.size)}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **parallel)
    except Exception as exc:  # noqa: BLE001 - an unknown class, missing or mismatched weights, a missing package
        raise ModelRefused("model", path, f"transformers cannot load it as a causal LM: {one_line(exc)}") from exc
    try:
        model.set_attn_implementation(register_paged_attention())
    except (ValueError, NotImplementedError) as exc:
        raise ModelRefused("model", path, f"model class {type(model).__name__} cannot use the engine's attention: "
                                          f"{exc}") from exc
    return model


def load_reference_model(model_dir: str | os.PathLike, dtype: torch.dtype | str,
                         attention: str = REFERENCE_ATTENTION) -> torch.nn.Module:
    """An independent copy with transformers' stock attention (`attention`: sdpa, or eager, which
    every class that takes one has), for tests, benchmarks and the model sweep.

    The config is deep-copied: `set_attn_implementation` writes into the config
    object, and a config shared with the engine's model would switch both.
    """
    path = Path(model_dir)
    config = copy.deepcopy(AutoConfig.from_pretrained(path, local_files_only=True))
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=_as_dtype(dtype), attn_implementation=attention, local_files_only=True
    )
    return model.eval().requires_grad_(False)


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return resolved
