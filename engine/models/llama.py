"""The engine's own forward for the Llama family: llama, mistral, qwen2 and qwen3 checkpoints.

Owns reading such a checkpoint's safetensors into fused weights (q/k/v as one matrix, gate/up as
one) and the forward over a packed batch with the fewest ops per layer: one GEMM per projection,
one fused op for the residual add and RMSNorm, one for RoPE (after Qwen3's q/k norms) and the
KV-cache write, the paged attention kernel. Per-step work shared by all layers (RoPE angles) is
done once per step. The math is transformers' (same formulas, same rounding points), so float32
greedy output matches transformers `generate`; transformers remains the reference in tests and
the runner for every other architecture (engine/models/hf.py).

It never schedules, samples or allocates KV blocks, and never reads anything but the local
model directory.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import PretrainedConfig

from pdserve.engine.attention import ForwardContext
from pdserve.kernels.layer_ops import add_rms_norm, rms_norm, rope_write_kv

# model_type -> the prefix of its transformers classes (for the rotary embedding).
ARCHITECTURES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def unsupported_reason(model_dir: Path, config: PretrainedConfig) -> str | None:
    """Why this checkpoint cannot run on the native path, or None if it can."""
    text = config.get_text_config()
    if config.model_type not in ARCHITECTURES:
        return f"model type {config.model_type!r} is not one of {sorted(ARCHITECTURES)}"
    if getattr(text, "hidden_act", "silu") != "silu":
        return f"activation {text.hidden_act!r} (the native MLP is SiLU-gated)"
    if not ((model_dir / SINGLE_FILE).is_file() or (model_dir / SHARD_INDEX).is_file()):
        return f"no {SINGLE_FILE} or {SHARD_INDEX} in {model_dir}"
    return None


@dataclass(frozen=True, slots=True)
class LlamaShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention softmax scale

    @classmethod
    def of(cls, text: PretrainedConfig) -> LlamaShape:
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        return cls(
            num_layers=text.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            eps=text.rms_norm_eps,
            scale=head_dim**-0.5,
        )


class LlamaLayer(torch.nn.Module):
    """One decoder layer's weights, fused for the forward below."""

    def __init__(self, weights: dict[str, torch.Tensor | None]) -> None:
        super().__init__()
        for name, tensor in weights.items():
            self.register_parameter(name, None if tensor is None else torch.nn.Parameter(tensor, requires_grad=False))

    def head_norms(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self.q_norm is None else (self.q_norm, self.k_norm)


class NativeLlama(torch.nn.Module):
    def __init__(self, shape: LlamaShape, rotary: torch.nn.Module, embed: torch.Tensor, layers: list[LlamaLayer],
                 norm: torch.Tensor, lm_head: torch.Tensor) -> None:  # fmt: skip
        super().__init__()
        self.shape = shape
        self.rotary = rotary  # transformers' own rotary embedding for the config (every RoPE scaling type)
        self.embed = torch.nn.Parameter(embed, requires_grad=False)
        self.layers = torch.nn.ModuleList(layers)
        self.norm = torch.nn.Parameter(norm, requires_grad=False)
        tied = lm_head.data_ptr() == embed.data_ptr()
        self.lm_head = self.embed if tied else torch.nn.Parameter(lm_head, requires_grad=False)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:  # [num_sampled, vocab]
        cos, sin = self._rope_angles(positions)
        residual = F.embedding(input_ids, self.embed)  # [num_tokens, hidden]
        hidden = rms_norm(residual, self.layers[0].input_norm, self.shape.eps)
        for index, layer in enumerate(self.layers):
            if index:
                hidden = add_rms_norm(hidden, residual, layer.input_norm, self.shape.eps)
            attn = self._attention(index, layer, hidden, cos, sin, ctx)
            hidden = add_rms_norm(attn, residual, layer.post_norm, self.shape.eps)
            hidden = self._mlp(layer, hidden)
        # The final norm is per row: normalise only the rows that are sampled.
        hidden = add_rms_norm(hidden[logits_indices], residual[logits_indices], self.norm, self.shape.eps)
        return F.linear(hidden, self.lm_head)

    def _rope_angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # float32 angles whatever the weights' dtype: [num_tokens, head_dim] each.
        probe = torch.empty(0, dtype=torch.float32, device=positions.device)
        cos, sin = self.rotary(probe, positions.unsqueeze(0))
        return cos[0].contiguous(), sin[0].contiguous()

    def _attention(self, index: int, layer: LlamaLayer, hidden: torch.Tensor, cos, sin, ctx: ForwardContext):
        qkv = F.linear(hidden, layer.qkv, layer.qkv_bias)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        k_cache, v_cache = ctx.k_caches[index], ctx.v_caches[index]
        q = rope_write_kv(qkv, cos, sin, layer.head_norms(), self.shape.eps, k_cache, v_cache,
                          ctx.metadata.slot_mapping, self.shape.num_heads)  # fmt: skip
        out = ctx.backend(q, k_cache, v_cache, ctx.metadata, self.shape.scale)  # [num_tokens, heads, head_dim]
        return F.linear(out.view(out.shape[0], -1), layer.o_proj, layer.o_bias)

    @staticmethod
    def _mlp(layer: LlamaLayer, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(hidden, layer.gate_up)  # [num_tokens, 2 * intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down_proj)


def load_native_llama(model_dir: Path, config: PretrainedConfig, dtype: torch.dtype) -> NativeLlama:
    """Read the checkpoint's tensors one at a time into fused weights of `dtype`."""
    text = config.get_text_config()
    shape = LlamaShape.of(text)
    with _Checkpoint(model_dir) as ckpt:
        take = lambda name: ckpt.tensor(name, dtype)  # noqa: E731
        embed = take("model.embed_tokens.weight")
        layers = [_load_layer(ckpt, f"model.layers.{i}.", dtype) for i in range(shape.num_layers)]
        norm = take("model.norm.weight")
        tied = getattr(config, "tie_word_embeddings", False) or not ckpt.has("lm_head.weight")
        lm_head = embed if tied else take("lm_head.weight")
    return NativeLlama(shape, _rotary(config), embed, layers, norm, lm_head).eval()


def _load_layer(ckpt: _Checkpoint, prefix: str, dtype: torch.dtype) -> LlamaLayer:
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    fuse = lambda *names: torch.cat([ckpt.tensor(n, dtype) for n in names]).contiguous()  # noqa: E731
    optional = lambda name: ckpt.tensor(name, dtype) if ckpt.has(name) else None  # noqa: E731
    qkv_bias = [attn + p + "_proj.bias" for p in "qkv"]
    return LlamaLayer({
        "input_norm": ckpt.tensor(prefix + "input_layernorm.weight", dtype),
        "qkv": fuse(*(attn + p + "_proj.weight" for p in "qkv")),
        "qkv_bias": fuse(*qkv_bias) if ckpt.has(qkv_bias[0]) else None,
        "q_norm": optional(attn + "q_norm.weight"),
        "k_norm": optional(attn + "k_norm.weight"),
        "o_proj": ckpt.tensor(attn + "o_proj.weight", dtype),
        "o_bias": optional(attn + "o_proj.bias"),
        "post_norm": ckpt.tensor(prefix + "post_attention_layernorm.weight", dtype),
        "gate_up": fuse(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
        "down_proj": ckpt.tensor(mlp + "down_proj.weight", dtype),
    })  # fmt: skip


def _rotary(config: PretrainedConfig) -> torch.nn.Module:
    prefix = ARCHITECTURES[config.model_type]
    module = importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")
    return getattr(module, f"{prefix}RotaryEmbedding")(config=config.get_text_config()).eval()


class _Checkpoint:
    """The tensors of a single-file or sharded safetensors checkpoint, opened lazily by name."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / SHARD_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._files = {name: model_dir / file for name, file in weight_map.items()}
        else:
            with safe_open(model_dir / SINGLE_FILE, framework="pt") as f:
                self._files = {name: model_dir / SINGLE_FILE for name in f.keys()}
        self._open: dict[Path, object] = {}

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self._open.clear()

    def has(self, name: str) -> bool:
        return name in self._files

    def tensor(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self._files:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        path = self._files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(name).to(dtype).contiguous()
