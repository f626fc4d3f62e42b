"""The engine's own forward for the Llama family: llama, mistral, qwen2 and qwen3 checkpoints.

Owns reading such a checkpoint's safetensors into fused weights (q/k/v as one matrix, gate/up as
one) and the forward over a packed batch with the fewest ops per layer: one GEMM per projection,
one fused op for the residual add and RMSNorm, one for RoPE (after Qwen3's q/k norms) and the
KV-cache write, the paged attention kernel; for steps whose attention stays in the C++ kernel,
all layers in one C++ call (pdserve/kernels/csrc/layer_stack.cpp). Per-step work shared by all layers
(RoPE angles, pdserve/engine/models/rope.py) is done once per step. The math is transformers' (same
formulas, same rounding points), so float32 greedy output matches transformers `generate`;
transformers remains the reference in tests and the runner for every other architecture
(pdserve/engine/models/hf.py).

It never schedules, samples or allocates KV blocks, and never reads anything but the local
model directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import PretrainedConfig

from pdserve.engine.attention import ForwardContext
from pdserve.engine.model_facts import head_dim, num_kv_heads, optional
from pdserve.engine.models.rope import STATIC_ROPE_TYPES, RotaryAngles, rope_type
from pdserve.engine.parallel import TPShard
from pdserve.kernels import cpu_ext
from pdserve.kernels.layer_ops import LayerOps
from pdserve.kernels.paged_attention import SdpaSplit, leaves_chunks_to_sdpa, paged_attention

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def unsupported_reason(model_dir: Path, config: PretrainedConfig) -> str | None:
    """Why this checkpoint cannot run on the native path, or None if it can."""
    text = config.get_text_config()
    if config.model_type not in ARCHITECTURES:
        return f"model type {config.model_type!r} is not one of {sorted(ARCHITECTURES)}"
    if optional(text, "hidden_act") not in (None, "silu"):
        return f"activation {text.hidden_act!r} (the native MLP is SiLU-gated)"
    if optional(text, "mlp_bias"):
        return "MLP biases (mlp_bias)"
    rope = optional(text, "rope_parameters") or {}
    if (optional(text, "partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0) != 1.0:
        return "partial rotary embeddings (partial_rotary_factor)"
    kind = rope_type(text)
    if kind not in STATIC_ROPE_TYPES:
        return f"RoPE type {kind!r} (its angles depend on the sequence length)"
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
        dim = head_dim(text)
        return cls(
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=num_kv_heads(text),
            head_dim=dim,
            eps=text.rms_norm_eps,
            scale=dim**-0.5,
        )


@dataclass(slots=True)
class LlamaLayer:
    """One decoder layer's weights, fused: plain tensors, so the forward reads them without
    nn.Module's attribute machinery (NativeLlama registers them as parameters)."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    head_norms: tuple[torch.Tensor, torch.Tensor] | None  # Qwen3's (q_norm, k_norm)
    o_proj: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows, then up rows
    down_proj: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        norms = list(self.head_norms or ())
        fields = [self.input_norm, self.qkv, self.qkv_bias, *norms, self.o_proj, self.o_bias, self.post_norm,
                  self.gate_up, self.down_proj]  # fmt: skip
        return [t for t in fields if t is not None]


@dataclass(frozen=True, slots=True)
class LayerStack:
    """Every layer's weights as one list per kind: the arguments of the C++ layer loop
    (pdserve/kernels/csrc/layer_stack.cpp), built once."""

    input_norms: list[torch.Tensor]
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor | None]
    q_norms: list[torch.Tensor | None]
    k_norms: list[torch.Tensor | None]
    o_proj: list[torch.Tensor]
    o_bias: list[torch.Tensor | None]
    post_norms: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down_proj: list[torch.Tensor]

    @classmethod
    def of(cls, layers: list[LlamaLayer]) -> LayerStack:
        norms = [layer.head_norms or (None, None) for layer in layers]
        return cls(
            [layer.input_norm for layer in layers], [layer.qkv for layer in layers],
            [layer.qkv_bias for layer in layers], [q for q, _ in norms], [k for _, k in norms],
            [layer.o_proj for layer in layers], [layer.o_bias for layer in layers],
            [layer.post_norm for layer in layers], [layer.gate_up for layer in layers],
            [layer.down_proj for layer in layers],
        )  # fmt: skip


class NativeLlama(torch.nn.Module):
    def __init__(self, shape: LlamaShape, rotary: RotaryAngles, embed: torch.Tensor, layers: list[LlamaLayer],
                 norm: torch.Tensor, lm_head: torch.Tensor, shard: TPShard = TPShard()) -> None:  # fmt: skip
        super().__init__()
        self.shape = shape
        self.shard = shard
        self.num_local_heads = shape.num_heads // shard.size  # query heads this rank attends with
        self.rotary = rotary
        self.embed, self.norm, self.lm_head = embed, norm, lm_head
        self.layers = layers
        self.stack = LayerStack.of(layers)
        self.compute_dtype = norm.dtype  # matrices may be stored narrower (see storage_dtype)
        # Registered once each (a tied lm_head is the embedding itself): parameters() and
        # the weight byte count see every tensor the forward reads.
        unique = {t.data_ptr(): t for t in [embed, norm, lm_head, *(t for l in layers for t in l.tensors())]}
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(t, requires_grad=False) for t in unique.values())

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:  # [num_sampled, vocab]
        ops = LayerOps.for_step(self.compute_dtype, input_ids.shape[0], input_ids.device)
        eps = self.shape.eps
        cos, sin = self.rotary(positions)  # [num_tokens, head_dim] float32, whatever the weights' dtype
        residual = F.embedding(input_ids, self.embed).to(self.compute_dtype)  # [num_tokens, hidden]
        hidden = ops.rms_norm(residual, self.layers[0].input_norm, eps)
        # One C++ call for all layers when the step's attention stays in the C++ kernel (decode
        # steps, short chunks) on a single rank; the Python loop otherwise (tensor-parallel ranks
        # sum their partial outputs between the ops), and wherever the C++ ops are not built.
        if (ops.cpp is not None and self.shard.is_single and ctx.backend is paged_attention
                and not leaves_chunks_to_sdpa(ctx.metadata,
                                              SdpaSplit.for_kernel(self.shape.head_dim, self.compute_dtype))):
            hidden = self._layers_cpp(ops, hidden, residual, cos, sin, ctx)
        else:
            hidden = self._layers_python(ops, hidden, residual, cos, sin, ctx)
        if self.shard.rank != 0:  # only rank 0 samples: the others stop at the replicated hidden state
            return hidden.new_empty((0, self.lm_head.shape[0]))
        # The final norm is per row: normalise only the rows that are sampled.
        rows = LayerOps.for_step(self.compute_dtype, logits_indices.shape[0], input_ids.device)
        hidden = rows.add_rms_norm(hidden[logits_indices], residual[logits_indices], self.norm, eps)
        return rows.linear(hidden, self.lm_head)

    def _layers_python(self, ops: LayerOps, hidden, residual, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        """The layer loop, one op at a time: residual is updated in place, the last layer's MLP
        output is returned. pdserve/kernels/csrc/layer_stack.cpp runs the same ops in the same order."""
        eps = self.shape.eps
        for index, layer in enumerate(self.layers):
            if index:
                hidden = ops.add_rms_norm(hidden, residual, layer.input_norm, eps)
            attn = self._attention(ops, ctx, index, layer, hidden, cos, sin)
            hidden = ops.add_rms_norm(attn, residual, layer.post_norm, eps)
            gate_up = ops.linear(hidden, layer.gate_up)  # [num_tokens, 2 * intermediate]
            hidden = self.shard.all_reduce(ops.gated_linear(gate_up, layer.down_proj))
        return hidden

    def _layers_cpp(self, ops: LayerOps, hidden, residual, cos, sin, ctx: ForwardContext) -> torch.Tensor:
        st, meta = self.stack, ctx.metadata
        return ops.cpp.layer_stack(
            hidden, residual, st.input_norms, st.qkv, st.qkv_bias, st.q_norms, st.k_norms, st.o_proj, st.o_bias,
            st.post_norms, st.gate_up, st.down_proj, ctx.k_caches, ctx.v_caches, cos, sin, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.shape.eps, self.shape.scale,
            self.num_local_heads, ops.gemv,
        )  # fmt: skip

    def _attention(self, ops: LayerOps, ctx: ForwardContext, index: int, layer: LlamaLayer, hidden, cos, sin):
        qkv = ops.linear(hidden, layer.qkv, layer.qkv_bias)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        k_cache, v_cache = ctx.k_caches[index], ctx.v_caches[index]
        q = ops.rope_write_kv(qkv, cos, sin, layer.head_norms, self.shape.eps, k_cache, v_cache,
                              ctx.metadata.slot_mapping, self.num_local_heads)  # fmt: skip
        out = ctx.backend(q, k_cache, v_cache, ctx.metadata, self.shape.scale)  # [num_tokens, heads, head_dim]
        if self.shard.is_single:
            return ops.linear(out.view(out.shape[0], -1), layer.o_proj, layer.o_bias)
        # Row-parallel: each rank's heads give a partial sum; the bias joins once, after it.
        partial = self.shard.all_reduce(ops.linear(out.view(out.shape[0], -1), layer.o_proj))
        return partial if layer.o_bias is None else partial + layer.o_bias


def load_native_llama(model_dir: Path, config: PretrainedConfig, dtype: torch.dtype,
                      shard: TPShard = TPShard(), device: torch.device = torch.device("cpu")) -> NativeLlama:
    """Read the checkpoint's tensors one at a time into fused weights on `device`, this rank's
    slice of each layer (pdserve/engine/parallel.py); compute in `dtype`. Embedding, norms and lm_head
    are whole."""
    text = config.get_text_config()
    shape = LlamaShape.of(text)
    slices = _RankSlices.of(shape, text.intermediate_size, shard)
    with _Checkpoint(model_dir, device) as ckpt:
        store = storage_dtype(ckpt.dtype("model.embed_tokens.weight"), dtype, device)
        embed = ckpt.tensor("model.embed_tokens.weight", store)
        layers = [_load_layer(ckpt, f"model.layers.{i}.", dtype, store, slices) for i in range(shape.num_layers)]
        norm = ckpt.tensor("model.norm.weight", dtype)
        tied = bool(optional(config, "tie_word_embeddings")) or not ckpt.has("lm_head.weight")
        lm_head = embed if tied else ckpt.tensor("lm_head.weight", store)
    return NativeLlama(shape, RotaryAngles(text, device), embed, layers, norm, lm_head, shard).eval()


@dataclass(frozen=True, slots=True)
class _RankSlices:
    """The rows of each fused matrix a rank keeps: its query heads, its KV heads, its MLP rows."""

    q: slice
    kv: slice
    mlp: slice
    keeps_bias: bool  # a row-parallel layer's bias is added once, by rank 0's share

    @classmethod
    def of(cls, shape: LlamaShape, intermediate: int, shard: TPShard) -> _RankSlices:
        dim = shape.head_dim
        q0, q1 = shard.block(shape.num_heads)
        kv0, kv1 = shard.kv_heads(shape.num_kv_heads)
        m0, m1 = shard.block(intermediate)
        return cls(slice(q0 * dim, q1 * dim), slice(kv0 * dim, kv1 * dim), slice(m0, m1), shard.rank == 0)


def storage_dtype(checkpoint: torch.dtype, compute: torch.dtype, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """The matrices' dtype in memory. A bf16 checkpoint computed in float32 (a CPU without native
    bf16) keeps bf16 matrices: the values are the same, half the bytes are read per step, and
    kernels/linear.py converts them in registers (the C++ kernels: CPU only). Otherwise the
    compute dtype."""
    if checkpoint == torch.bfloat16 and compute == torch.float32 and device.type == "cpu" and cpu_ext.available():
        return torch.bfloat16
    return compute


def _load_layer(ckpt: _Checkpoint, prefix: str, dtype: torch.dtype, store: torch.dtype,
                rank: _RankSlices) -> LlamaLayer:
    """Matrices in `store`, norms and biases (small) in the compute `dtype`; column-parallel
    matrices keep the rank's rows, row-parallel ones its columns (one rank: everything)."""
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv_rows = (rank.q, rank.kv, rank.kv)

    def rows(dt: torch.dtype, names, parts) -> torch.Tensor:
        return torch.cat([ckpt.tensor(n, dt)[part] for n, part in zip(names, parts)]).contiguous()

    def columns(name: str, part: slice) -> torch.Tensor:
        return ckpt.tensor(name, store)[:, part].contiguous()

    optional = lambda name: ckpt.tensor(name, dtype) if ckpt.has(name) else None  # noqa: E731
    qkv_bias = [attn + p + "_proj.bias" for p in "qkv"]
    has_head_norms = ckpt.has(attn + "q_norm.weight")
    return LlamaLayer(
        input_norm=ckpt.tensor(prefix + "input_layernorm.weight", dtype),
        qkv=rows(store, [attn + p + "_proj.weight" for p in "qkv"], qkv_rows),
        qkv_bias=rows(dtype, qkv_bias, qkv_rows) if ckpt.has(qkv_bias[0]) else None,
        head_norms=(optional(attn + "q_norm.weight"), optional(attn + "k_norm.weight")) if has_head_norms else None,
        o_proj=columns(attn + "o_proj.weight", rank.q),
        o_bias=optional(attn + "o_proj.bias") if rank.keeps_bias else None,
        post_norm=ckpt.tensor(prefix + "post_attention_layernorm.weight", dtype),
        gate_up=rows(store, [mlp + "gate_proj.weight", mlp + "up_proj.weight"], (rank.mlp, rank.mlp)),
        down_proj=columns(mlp + "down_proj.weight", rank.mlp),
    )


class _Checkpoint:
    """The tensors of a single-file or sharded safetensors checkpoint, opened lazily by name."""

    def __init__(self, model_dir: Path, device: torch.device = torch.device("cpu")) -> None:
        self._device = device
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
        return self._file(name).get_tensor(name).to(device=self._device, dtype=dtype).contiguous()

    def dtype(self, name: str) -> torch.dtype:
        stored = self._file(name).get_slice(name).get_dtype()
        return {"BF16": torch.bfloat16, "F16": torch.float16}.get(stored, torch.float32)

    def _file(self, name: str):
        if name not in self._files:
            raise ValueError(f"checkpoint has no tensor {name!r}")
        path = self._files[name]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]
