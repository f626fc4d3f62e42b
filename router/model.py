"""What the router knows of the model: its tokenizer and the facts of its config.

Owns loading the tokenizer, config and EOS ids from a model directory. It must never
load weights or import the engine's model code: the router runs no model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


@dataclass(frozen=True)
class RouterModel:
    name: str
    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    vocab_size: int  # rows of the lm_head: the ids a prompt may contain
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str


def load_router_model(model_dir: str | os.PathLike) -> RouterModel:
    """Tokenizer + config of a local model directory (never the network, never the weights)."""
    path = Path(model_dir)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return RouterModel(
        name=path.name,
        tokenizer=tokenizer,
        vocab_size=text.vocab_size,
        max_model_len=text.max_position_embeddings,
        eos_token_ids=_eos_token_ids(path, text.to_dict().get("eos_token_id"), tokenizer.eos_token_id),
        dtype=_dtype_name(text.to_dict()),
    )


def _eos_token_ids(path: Path, config_eos: object, tokenizer_eos: int | None) -> tuple[int, ...]:
    # The same union the engine's loader takes: generation config, model config, tokenizer.
    candidates = [config_eos, tokenizer_eos]
    if (path / "generation_config.json").is_file():
        candidates.insert(0, GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    ids: list[int] = []
    for c in candidates:
        for token_id in c if isinstance(c, list) else [c]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return tuple(ids)


def _dtype_name(config: dict) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or ""
    return str(dtype).removeprefix("torch.")
