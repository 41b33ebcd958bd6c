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

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cache.checkpoint.architecture import ModelShape
from engine.native.kv_memory import KVGeometry, KVMemory

NULL_BLOCK = 0  # reserved: padding writes land here, no sequence reads it


KV_FP8 = torch.float8_e4m3fn
KV_FP8_MAX = torch.finfo(KV_FP8).max  # 448: what a key or value beyond it is stored as (the CUDA kernels saturate)


def kv_cache_dtype(compute: torch.dtype, setting: str) -> torch.dtype:
    """The cache's element type for the engine setting ``kv_cache_dtype`` (common/settings.py)."""
    return KV_FP8 if setting == "fp8" else compute


def kv_bytes_per_token(shape: ModelShape, dtype: torch.dtype) -> int:
    """Keys and values of one position, every layer."""
    return shape.layers * 2 * shape.kv_heads * shape.head_dim * torch.finfo(dtype).bits // 8


def kv_block_bytes(shape: ModelShape, dtype: torch.dtype, block_size: int) -> int:
    """One block of one layer's keys (or values): the unit engine/native/kv_memory.py maps."""
    return block_size * kv_bytes_per_token(shape, dtype) // (2 * shape.layers)


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
             block_size: int, multiple: int = 1) -> KVCacheSpec:  # fmt: skip
        """Blocks for ``max_seqs`` full-length sequences, or as many as ``budget`` bytes hold; in all (the null
        block counted) a multiple of ``multiple`` (a reserved cache's mappings: engine/native/kv_memory.py), more
        for sequences, fewer within a budget.

        Refused when the cache cannot hold one sequence of ``max_len`` tokens: such a request could never finish.
        """
        per_token = kv_bytes_per_token(shape, dtype)
        per_seq = math.ceil(max_len / block_size)
        if budget is None:
            blocks = -(-(max_seqs * per_seq + 1) // multiple) * multiple - 1
        else:
            blocks = budget // (per_token * block_size) // multiple * multiple - 1
        if blocks < per_seq:
            need = per_token * (per_seq + 1) * block_size
            raise ValueError(f"kv_cache_bytes={budget} cannot hold one sequence of {max_len} tokens ({need} bytes)")
        return cls(blocks + 1, block_size, per_token)


class KVCache:
    """Keys and values of every layer: k, v [layers, slots, kv_heads, head_dim], in one piece of memory.

    ``reserve``: on CUDA the memory is only reserved until it is committed, stripe by stripe of ``multiple``
    blocks (the one the spec was planned with; engine/native/kv_memory.py)."""

    def __init__(self, shape: ModelShape, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device,
                 reserve: bool = False, multiple: int = 1, headroom: int = 0) -> None:  # fmt: skip
        self.spec = spec
        self.block_size = spec.block_size
        dims = (shape.layers, spec.slots, shape.kv_heads, shape.head_dim)
        geometry = KVGeometry(shape.layers, spec.blocks, kv_block_bytes(shape, dtype, spec.block_size))
        self.memory = KVMemory(geometry, device, reserve, multiple, headroom)
        half = self.memory.geometry.half
        self.k = self.memory.buffer[:half].view(dtype).view(dims)
        self.v = self.memory.buffer[half:].view(dtype).view(dims)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """k, v [T, kv_heads, head_dim]: row t goes to cache slot slots[t], in the cache's element type."""
        for cache, rows in ((self.k[layer], k), (self.v[layer], v)):
            if cache.dtype == KV_FP8:  # saturating, as the CUDA kernels' conversion (torch's makes NaN past 448);
                cache = cache.view(torch.uint8)  # as bytes: index_copy_ has no float8 kernel on the CPU
                rows = rows.clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8).view(torch.uint8)
            cache.index_copy_(0, slots, rows)


class BlockAllocator:
    """The cache's blocks: a sequence's table grows one block at a time and is released whole; with prefix caching,
    a full block is also known by the hash of its tokens and every token before them, so another sequence with
    the same prefix takes it instead of computing it again.

    Blocks hold a count of the tables they are in. A released block that holds a cached prefix stays cached while
    it waits, unused, to be handed out again: blocks that never held one go first, then cached ones, least
    recently released first (a sequence's tail before its head, which more prompts share).
    """

    def __init__(self, spec: KVCacheSpec, prefix_caching: bool = False) -> None:
        self.block_size = spec.block_size
        self.prefix_caching = prefix_caching
        self.plain: list[int] = list(range(spec.blocks - 1, NULL_BLOCK, -1))  # pop() hands out low ids first
        self.cached_free: dict[int, None] = {}  # unused blocks still holding a cached prefix, oldest first
        self.refs = [0] * spec.blocks
        self.hash_of: dict[int, bytes] = {}  # block -> the prefix hash it holds
        self.block_of: dict[bytes, int] = {}  # prefix hash -> the block holding it
        self.queried_tokens = self.hit_tokens = 0  # vLLM's prefix_cache_queries / prefix_cache_hits
        # Whether more blocks are on their way (a reserved cache's stripes being committed, engine/native/kv_memory.py):
        # a sequence short of blocks then waits for them rather than evicting another.
        self.incoming: Callable[[], bool] = lambda: False

    @property
    def free(self) -> int:
        """Blocks that can be handed out (cached ones included: they are taken over when plain ones run out)."""
        return len(self.plain) + len(self.cached_free)

    def needed(self, table: list[int], tokens: int) -> int:
        """Blocks to add so that ``table`` holds ``tokens`` positions."""
        return max(0, -(-tokens // self.block_size) - len(table))

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend ``table`` in place to hold ``tokens`` positions; False (nothing taken) if blocks are short."""
        if tokens <= len(table) * self.block_size:  # most steps of a decoding sequence
            return True
        n = self.needed(table, tokens)
        if n > self.free:
            return False
        for _ in range(n):
            if self.plain:
                block = self.plain.pop()
            else:  # the least recently released cached block forgets its prefix
                block = next(iter(self.cached_free))
                del self.cached_free[block]
                del self.block_of[self.hash_of.pop(block)]
            self.refs[block] = 1
            table.append(block)
        return True

    def release(self, table: list[int]) -> None:
        for block in reversed(table):  # the tail first: it goes before the head when blocks run short
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.hash_of:
                    self.cached_free[block] = None
                else:
                    self.plain.append(block)
        table.clear()

    def limit(self, blocks: int) -> None:
        """Hand out only blocks below ``blocks`` (the rest of a reserved cache is not committed yet: ``add`` them
        as they are). Only while no table holds a block."""
        assert not any(self.refs), "blocks are in use"
        self.plain = list(range(blocks - 1, NULL_BLOCK, -1))

    def add(self, first: int, end: int) -> None:
        """Blocks first..end-1 can be handed out now (after every block below them)."""
        self.plain[:0] = range(end - 1, max(first, NULL_BLOCK + 1) - 1, -1)

    def forget_cached(self) -> None:
        """Forget every cached prefix (what the blocks held is gone: the cache's memory was replaced). Only while no
        table holds a block."""
        assert not any(self.refs), "blocks are in use"
        self.plain.extend(sorted(self.cached_free, reverse=True))
        self.cached_free.clear()
        self.hash_of.clear()
        self.block_of.clear()

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """The blocks that hold the longest cached prefix of ``hashes`` (a sequence's block hashes, in order)."""
        blocks = []
        for h in hashes:
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Put cached ``blocks`` (from cached_prefix) in an empty ``table``: counted, no longer free."""
        for block in blocks:
            if self.refs[block] == 0:
                del self.cached_free[block]
            self.refs[block] += 1
            table.append(block)

    def remember(self, block: int, prefix_hash: bytes) -> None:
        """``block`` is full and holds the prefix ``prefix_hash``; the first block to hold a prefix keeps it."""
        if prefix_hash not in self.block_of and block not in self.hash_of:
            self.block_of[prefix_hash] = block
            self.hash_of[block] = prefix_hash


def block_hashes(parent: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The hashes of consecutive full blocks of ``tokens``, each of its tokens and, through the hash before it
    (``parent`` for the first: the previous block's, b"" at a sequence's start), every token before them. 128 bits
    of BLAKE2b: a collision would hand a sequence another's keys and values. The tokens are made bytes once (a
    2,000-token prompt's 125 blocks in ~0.1 ms: they are hashed on the step loop's thread)."""
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    size = block_size * 8
    hashes = []
    for start in range(0, len(data) - size + 1, size):
        parent = hashlib.blake2b(parent + data[start : start + size], digest_size=16).digest()
        hashes.append(parent)
    return hashes


def slots_of(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    """Cache slots of positions start..end-1 of the sequence with this block table (int64)."""
    positions = np.arange(start, end)
    return np.asarray(table, dtype=np.int64)[positions // block_size] * block_size + positions % block_size
