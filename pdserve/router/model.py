"""What the router knows of the model: its tokenizer and the facts of its config.

Owns loading the tokenizer and config from a model directory, after the engine's own check of
the folder (pdserve/engine/model_folder.py: the router refuses at start exactly the folders a node
would); the EOS ids are the engine's own union (pdserve/engine/model_facts.py), so router and nodes
stop on the same tokens; the KV shape the config implies is what a registering node's
fingerprint must show (pdserve/router/cluster/node_facts.py). It must never load weights or import the engine's
model code: the router runs no model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from pdserve.engine.model_facts import eos_token_ids, head_dim, num_kv_heads
from pdserve.engine.model_folder import model_name, open_model_folder


@dataclass(frozen=True)
class RouterModel:
    name: str
    tokenizer: PreTrainedTokenizerBase = field(repr=False)
    vocab_size: int  # rows of the lm_head: the ids a prompt may contain
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


def load_router_model(model_dir: str | os.PathLike) -> RouterModel:
    """Tokenizer + config of a local model directory (never the network, never the weights);
    `ModelRefused` (one line naming the folder) for a folder no node could serve."""
    folder = open_model_folder(model_dir)
    text = folder.config.get_text_config()
    return RouterModel(
        name=model_name(folder.path),
        tokenizer=folder.tokenizer,
        vocab_size=text.vocab_size,
        max_model_len=text.max_position_embeddings,
        eos_token_ids=eos_token_ids(folder.path, folder.config, folder.tokenizer.eos_token_id),
        dtype=_dtype_name(text.to_dict()),
        num_layers=text.num_hidden_layers,
        num_kv_heads=num_kv_heads(text),
        head_dim=head_dim(text),
    )


def _dtype_name(config: dict) -> str:
    dtype = config.get("dtype") or config.get("torch_dtype") or ""
    return str(dtype).removeprefix("torch.")
