"""Paged KV cache: fixed-size blocks of token positions, handed to sequences as they grow.

A sequence owns a list of block ids (its block table); position p of the sequence lives in
cache slot ``table[p // block_size] * block_size + p % block_size``. Concurrency is bounded
by the tokens in use, not by max_model_len per sequence. Block 0 is never handed out: padded
rows of a CUDA-graph step write their keys there.

Layout per layer: keys and values [slots, kv_heads, head_dim], slots = blocks * block_size,
so one token's keys for all heads are contiguous (one write per token) and a kernel reads a
page of one head as ``block_size`` rows of head_dim.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from cache.checkpoint.architecture import ModelShape

NULL_BLOCK = 0  # reserved: padding writes land here, no sequence reads it


@dataclass(frozen=True)
class KVCacheSpec:
    blocks: int  # including the reserved null block
    block_size: int
    bytes_per_token: int

    @property
    def slots(self) -> int:
        return self.blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.slots * self.bytes_per_token

    @property
    def usable_tokens(self) -> int:
        return (self.blocks - 1) * self.block_size

    @classmethod
    def plan(cls, shape: ModelShape, dtype: torch.dtype, max_seqs: int, max_len: int, budget: int | None,
             block_size: int) -> KVCacheSpec:  # fmt: skip
        """Blocks for ``max_seqs`` full-length sequences, or as many as ``budget`` bytes hold.

        Refused when the cache cannot hold one sequence of ``max_len`` tokens: such a request could never finish.
        """
        per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * torch.finfo(dtype).bits // 8
        per_seq = math.ceil(max_len / block_size)
        blocks = max_seqs * per_seq if budget is None else budget // (per_token * block_size) - 1
        if blocks < per_seq:
            need = per_token * (per_seq + 1) * block_size
            raise ValueError(f"kv_cache_bytes={budget} cannot hold one sequence of {max_len} tokens ({need} bytes)")
        return cls(blocks + 1, block_size, per_token)


class KVCache:
    """Keys and values of every layer: k, v [layers, slots, kv_heads, head_dim]."""

    def __init__(self, shape: ModelShape, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        dims = (shape.layers, spec.slots, shape.kv_heads, shape.head_dim)
        self.k = _zeros(dims, dtype, device)
        self.v = _zeros(dims, dtype, device)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim]: row t goes to cache slot slots[t]."""
        self.k[layer].index_copy_(0, slots, k)
        self.v[layer].index_copy_(0, slots, v)


class BlockAllocator:
    """Free block ids; a sequence's table grows one block at a time and is freed whole."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.block_size = spec.block_size
        self.free: list[int] = list(range(spec.blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first

    def needed(self, table: list[int], tokens: int) -> int:
        """Blocks to add so that ``table`` holds ``tokens`` positions."""
        return max(0, -(-tokens // self.block_size) - len(table))

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend ``table`` in place to hold ``tokens`` positions; False (nothing taken) if blocks are short."""
        n = self.needed(table, tokens)
        if n > len(self.free):
            return False
        for _ in range(n):
            table.append(self.free.pop())
        return True

    def release(self, table: list[int]) -> None:
        self.free.extend(reversed(table))
        table.clear()


def slots_of(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots of positions start..end-1 of the sequence with this block table (int64)."""
    positions = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size


def _zeros(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros without touching them: on CPU, anonymous mmap pages are zero until first written.

    torch.zeros would write every byte up front (6.7 s for the demo's 3 GB default cache here),
    which a restart would pay every time. Unused positions must read as zeros, not garbage:
    a masked score times a NaN value would still be NaN.
    """
    if device.type != "cpu":
        return torch.zeros(dims, dtype=dtype, device=device)
    nbytes = math.prod(dims) * torch.finfo(dtype).bits // 8
    buffer = mmap.mmap(-1, nbytes)  # private, anonymous: zero-filled by the kernel, committed lazily
    return torch.frombuffer(buffer, dtype=dtype).view(dims)
