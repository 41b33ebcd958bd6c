"""Slot-based KV cache: one fixed row of max_model_len positions per running sequence.

Running sequences always occupy slots 0..B-1 (the scheduler moves the last one into a
freed slot), so decode attention reads a plain strided view of the first B slots
instead of gathering them.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from cache.checkpoint.architecture import ModelShape

MIN_SPAN = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def span_bucket(longest: int, max_len: int) -> int:
    """How many cache positions decode attention reads: a power of two >= ``longest`` (few distinct shapes)."""
    return min(max_len, max(MIN_SPAN, next_pow2(longest)))


@dataclass(frozen=True)
class KVCacheSpec:
    slots: int
    max_len: int
    bytes_per_token: int

    @property
    def total_bytes(self) -> int:
        return self.slots * self.max_len * self.bytes_per_token

    @classmethod
    def plan(cls, shape: ModelShape, dtype: torch.dtype, max_seqs: int, max_len: int,
             budget: int | None) -> KVCacheSpec:  # fmt: skip
        """As many slots as ``max_seqs``, fewer if ``budget`` bytes cannot hold them; at least one."""
        per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * torch.finfo(dtype).bits // 8
        slots = max_seqs if budget is None else min(max_seqs, budget // (per_token * max_len))
        if slots < 1:
            need = per_token * max_len
            raise ValueError(f"kv_cache_bytes={budget} cannot hold one sequence of {max_len} tokens ({need} bytes)")
        return cls(slots, max_len, per_token)


class KVCache:
    def __init__(self, shape: ModelShape, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        dims = (shape.layers, spec.slots, shape.kv_heads, spec.max_len, shape.head_dim)
        self.k = _zeros(dims, dtype, device)
        self.v = _zeros(dims, dtype, device)

    def write_prompt(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim] at positions 0..T-1 of ``slot``."""
        n = k.shape[0]
        self.k[layer, slot, :, :n] = k.transpose(0, 1)
        self.v[layer, slot, :, :n] = v.transpose(0, 1)

    def write_tokens(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v [B, kv_heads, head_dim]: row b goes to slot b at positions[b]."""
        if k.is_cuda and k.shape[-1] & (k.shape[-1] - 1) == 0:  # the fused kernel wants a power-of-two head_dim
            from engine.fused_ops import kv_write

            kv_write(self.k[layer], self.v[layer], k, v, positions)
            return
        slots = torch.arange(k.shape[0], device=k.device)
        self.k[layer, slots, :, positions] = k
        self.v[layer, slots, :, positions] = v

    def view(self, layer: int, batch: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots 0..batch-1, positions 0..span-1: [B, kv_heads, span, head_dim] (no copy)."""
        return self.k[layer, :batch, :, :span], self.v[layer, :batch, :, :span]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's first ``length`` positions from slot ``src`` to slot ``dst`` (compaction)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros without touching them: on CPU, anonymous mmap pages are zero until first written.

    torch.zeros would write every byte up front (6.7 s for the demo's 3 GB default cache here),
    which a restart would pay every time. Unused positions must read as zeros, not garbage:
    masked attention multiplies them by 0, and 0 * NaN is NaN.
    """
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * torch.finfo(dtype).bits // 8
    buffer = mmap.mmap(-1, nbytes)  # private, anonymous: zero-filled by the kernel, committed lazily
    return torch.frombuffer(buffer, dtype=dtype).view(dims)
