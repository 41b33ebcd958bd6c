"""A Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3) in plain PyTorch.

The model owns no weights of its own: ``bind`` points it at processed tensors (from disk
or from the cache process) without copying. Linear layers call the kernel their recipe
names. Attention reads and writes the paged KV cache (engine/native/kv_cache.py, engine/native/attention.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cache.checkpoint.architecture import ModelShape
from cache.processors.native import LinearRecipe, ProcessedWeights
from engine.native.attention import StepBatch, paged_attention
from engine.native.kernels import Kernel, cublas_sized, deep_gemm_rows, fp8_block_scaled_mm, kernel_for, quantized_rows
from engine.native.kv_cache import KVCache

if TYPE_CHECKING:
    from engine.native.deep_gemm import DeepGemm
    from engine.native.fused_ops import Quantized


@dataclass(frozen=True)
class ModelArgs:
    shape: ModelShape
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        return cls(
            shape=ModelShape.from_config(config),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope if rope_type != "default" else None,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama 3's long-context rescaling when configured."""
    dim = args.shape.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq.float()
    rope_type = scaling.get("rope_type") or scaling.get("type")
    if rope_type == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported (supported: default, linear, llama3)")
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled).float()


class Linear:
    """One Linear layer: its processed tensors and the kernel its recipe names."""

    def __init__(self, tensors: dict[str, torch.Tensor], recipe: LinearRecipe) -> None:
        self.tensors = tensors
        self.recipe = recipe
        self.kernel: Kernel = kernel_for(recipe)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel(x, self.tensors, self.recipe)

    def quantized_rows(self, rows: int) -> int:
        """The rows in which its input may come quantized (engine/native/fused_ops.py: the norm or activation
        before it does it), or 0 (engine/native/kernels.py's quantized_rows)."""
        return quantized_rows(self.recipe, rows)


class Projections:
    """Several projections of one input: one GEMM when processing merged them, else one each."""

    def __init__(self, merged: Linear | None, separate: list[Linear], names: list[str]) -> None:
        self.merged = merged
        self.separate = separate
        self.slices = [merged.recipe.part(n) for n in names] if merged else []

    @classmethod
    def build(cls, merged: str, names: list[str], make: Any, recipes: dict[str, LinearRecipe]) -> Projections:
        if merged in recipes:
            return cls(make(merged), [], names)
        return cls(None, [make(n) for n in names], names)

    def quantized_rows(self, rows: int) -> int:
        wanted = {linear.quantized_rows(rows) for linear in ([self.merged] if self.merged else self.separate)}
        return wanted.pop() if len(wanted) == 1 else 0

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.merged is not None:
            y = self.merged(x)
            return [y[:, sl] for sl in self.slices]
        return [linear(x) for linear in self.separate]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos/sin [T, head_dim/2]; the rotate-half layout of HF checkpoints."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@dataclass
class Layer:
    qkv: Projections
    o: Linear
    gate_up: Projections
    down: Linear
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None


class Transformer:
    """One forward pass over a flat token batch: prompt chunks and decode tokens of many sequences."""

    def __init__(self, args: ModelArgs, weights: ProcessedWeights) -> None:
        self.args = args
        self.device = weights.device
        self.dtype = weights.dtype
        s = args.shape
        t, r = weights.tensors, weights.recipes

        def linear(module: str) -> Linear:
            parts = {leaf: t[f"{module}.{leaf}"] for leaf in ("weight", "weight_scale", "input_scale", "bias")
                     if f"{module}.{leaf}" in t}  # fmt: skip
            return Linear(parts, r[module])

        self.embed = t["model.embed_tokens.weight"]
        self.norm = t["model.norm.weight"]
        if s.tied_embeddings:
            tied = LinearRecipe("dense", "unquantized", "none", s.vocab, s.hidden, s.vocab, s.hidden)
            self.lm_head = Linear({"weight": self.embed}, tied)
        else:
            self.lm_head = linear("lm_head")
        self.layers = []
        for i in range(s.layers):
            p = f"model.layers.{i}"
            attn, mlp = f"{p}.self_attn", f"{p}.mlp"
            self.layers.append(
                Layer(
                    qkv=Projections.build(f"{attn}.qkv_proj", [f"{attn}.{n}_proj" for n in "qkv"], linear, r),
                    o=linear(f"{attn}.o_proj"),
                    gate_up=Projections.build(f"{mlp}.gate_up_proj", [f"{mlp}.gate_proj", f"{mlp}.up_proj"], linear, r),
                    down=linear(f"{mlp}.down_proj"),
                    input_norm=t[f"{p}.input_layernorm.weight"],
                    post_norm=t[f"{p}.post_attention_layernorm.weight"],
                    q_norm=t.get(f"{attn}.q_norm.weight"),
                    k_norm=t.get(f"{attn}.k_norm.weight"),
                )
            )
        inv_freq = rope_inv_freq(args).to(self.device)
        positions = torch.arange(args.max_position_embeddings, device=self.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()
        self.scale = 1.0 / math.sqrt(s.head_dim)
        self.fused = self.device.type == "cuda"  # Triton kernels for norms and rotary embedding

    def linears(self) -> Iterator[Linear]:
        yield self.lm_head
        for layer in self.layers:
            for p in (layer.qkv, layer.gate_up):
                yield from [p.merged] if p.merged else p.separate
            yield from (layer.o, layer.down)

    def use_deep_gemm(self, deep: DeepGemm, step_rows: list[int]) -> int:
        """Run the block-FP8 GEMMs that cuBLAS would at these steps' sizes through DeepGEMM's kernels (engine/
        native/deep_gemm.py), built here first; returns the kernels built or loaded."""
        linears = [linear for linear in self.linears() if cublas_sized(linear.recipe)]
        weights = {tuple(x.tensors["weight"].shape): (x.tensors["weight"], x.tensors["weight_scale"]) for x in linears}
        built = deep.prepare(list(weights.values()), deep_gemm_rows(step_rows))
        for linear in linears:
            linear.kernel = functools.partial(fp8_block_scaled_mm, deep=deep)
        return built

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
              into: Linear | Projections | None = None) -> torch.Tensor:  # fmt: skip
        """``x += delta`` (the residual stream, in place) and return rms_norm(x) * weight, quantized for ``into``
        (the layer it goes to) where that takes it so (fused kernels only)."""
        if self.fused:
            from engine.native.fused_ops import add_rms_norm

            rows = into.quantized_rows(x.shape[0]) if into is not None else 0
            return add_rms_norm(x, delta, weight, self.args.rms_norm_eps, rows)  # type: ignore[return-value]
        if delta is not None:
            x.add_(delta)
        return rms_norm(x, weight, self.args.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from engine.native.fused_ops import rope

            return rope(x, cos, sin)
        return apply_rope(x, cos, sin)

    def _qkv(self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s = self.args.shape
        q, k, v = layer.qkv(h)
        q = q.view(-1, s.heads, s.head_dim)
        k = k.view(-1, s.kv_heads, s.head_dim)
        v = v.view(-1, s.kv_heads, s.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q = self._norm(q.reshape(-1, s.head_dim), None, layer.q_norm).view_as(q)
            k = self._norm(k.reshape(-1, s.head_dim), None, layer.k_norm).view_as(k)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _mlp(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up(h)
        if self.fused:
            from engine.native.fused_ops import silu_mul

            return layer.down(silu_mul(gate, up, layer.down.quantized_rows(gate.shape[0])))  # type: ignore[arg-type]
        return layer.down(F.silu(gate) * up)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(hidden, None, self.norm)).float()

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention: Any) -> torch.Tensor:
        """Embed, run every layer with ``attention(layer_index, layer, h, cos, sin) -> [T, heads * head_dim]``."""
        cos, sin = self.cos[positions], self.sin[positions]  # once per step, shared by all layers
        x = F.embedding(tokens, self.embed)
        delta = None
        for i, layer in enumerate(self.layers):
            h = self._norm(x, delta, layer.input_norm, layer.qkv)
            h = self._norm(x, layer.o(attention(i, layer, h, cos, sin)), layer.post_norm, layer.gate_up)
            delta = self._mlp(layer, h)
        return x.add_(delta) if delta is not None else x

    def forward(self, batch: StepBatch, kv: KVCache) -> torch.Tensor:
        """Hidden states [T, hidden] of one step's flat tokens (prefill chunks and decode tokens of
        several sequences); writes their keys and values into the cache first."""
        s = self.args.shape

        def attention(i: int, layer: Layer, h: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor | Quantized:  # fmt: skip
            merged = self._fusable_qkv(layer)
            if merged is not None and batch.max_query_len == 1:
                # decode: the attention kernel rotates q and k and writes the cache itself (one launch fewer a layer)
                from engine.native.triton_attention import Rope
                from engine.native.triton_attention import paged_attention as fused_attention

                qkv = merged(h)
                rope = Rope(cos, sin, batch.slots, s.heads)
                return fused_attention(qkv, kv.k[i], kv.v[i], batch, self.scale,
                                       quantize_rows=layer.o.quantized_rows(qkv.shape[0]), rope=rope)  # fmt: skip
            if merged is not None:
                from engine.native.fused_ops import rope_kv_write

                q = rope_kv_write(merged(h), cos, sin, kv.k[i], kv.v[i], batch.slots, s.heads, s.kv_heads)
            else:
                q, k, v = self._qkv(layer, h, cos, sin)
                kv.write(i, k, v, batch.slots)
            return paged_attention(q, kv.k[i], kv.v[i], batch, self.scale, layer.o.quantized_rows(q.shape[0]))

        return self._forward(batch.tokens, batch.positions, attention)

    def _fusable_qkv(self, layer: Layer) -> Linear | None:
        """The merged q/k/v projection when CUDA can rotate q/k and write the cache in one kernel (the attention
        itself at decode, rope_kv_write otherwise): nothing between projection and rotation (no q/k norm), head_dim
        a power of two."""
        d = self.args.shape.head_dim
        if self.fused and layer.q_norm is None and d & (d - 1) == 0:
            return layer.qkv.merged
        return None
