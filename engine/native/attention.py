"""Attention over the paged KV cache for one flat step: prefill chunks and decode tokens together.

A step is T tokens from S sequences, sequence s owning query rows query_start[s]..query_start[s+1]-1.
Its context is seq_lens[s] tokens (this step's included, already written to the cache); the i-th
of its n query rows sits at position seq_lens[s] - n + i and sees keys 0..that position. Decode is
the case n = 1; a fresh prompt is n = seq_lens[s]; a later chunk of a long prompt is in between.

CUDA runs one Triton kernel for every case (engine/native/triton_attention.py); the CPU path below is
plain torch, one SDPA call per sequence, and is the reference the kernel is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.native.fused_ops import Quantized


@dataclass
class StepBatch:
    """One forward's inputs, on the model's device. Rows past the real tokens/sequences are padding."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T] position of each token in its sequence
    slots: torch.Tensor  # [T] cache slot each token's keys and values are written to
    query_start: torch.Tensor  # [S + 1] first query row of each sequence (last entry: T of the real rows)
    seq_lens: torch.Tensor  # [S] context length of each sequence after this step
    block_tables: torch.Tensor  # [S, W] int32 block ids (unused entries: 0)
    logits_indices: torch.Tensor  # [S] the row of each sequence's last token
    max_query_len: int  # an upper bound of query_start[s+1] - query_start[s]: sizes the kernel grid
    block_size: int  # positions per cache block
    # [1] int64: the first positions of every sequence that all of them hold in the same blocks and every query row
    # sees (prefix caching's shared prefix; 0 or None: none). CUDA: the kernel walks them for all rows at once.
    shared_prefix: torch.Tensor | None = None
    # A decode step's launch compiled to walk the shared prefix once for several sequences (CUDA, where the runner
    # finds it pays: engine/native/triton_attention.py, shared_decode_pays); steps with prompt rows always are.
    decode_walks_shared: bool = False
    context_slots: list[torch.Tensor] | None = None  # CPU only: slots of each sequence's whole context
    query_lens: list[int] | None = None  # CPU only: the same counts, on the host


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
                    scale: float, quantize_rows: int = 0) -> torch.Tensor | Quantized:  # fmt: skip
    """q [T, heads, d] against one layer's cache [slots, kv_heads, d] -> [T, heads * d]; on CUDA, for
    ``quantize_rows`` = T, possibly quantized for the block-FP8 GEMM it goes to (engine/native/triton_attention.py)."""
    if q.is_cuda:
        from engine.native.triton_attention import paged_attention as triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, batch, scale, quantize_rows=quantize_rows)
    return attention_reference(q, k_cache, v_cache, batch, scale)


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch,
                        scale: float) -> torch.Tensor:  # fmt: skip
    """The same attention in plain torch, a sequence at a time (CPU path and test reference)."""
    assert batch.context_slots is not None and batch.query_lens is not None, "the CPU path needs host metadata"
    t, heads, d = q.shape
    out = torch.zeros(t, heads, d, dtype=q.dtype, device=q.device)
    gqa = heads != k_cache.shape[1]
    start = 0
    for slots, n in zip(batch.context_slots, batch.query_lens, strict=True):
        if n == 0:
            continue
        length = slots.shape[0]
        # [1, kv_heads, L, d] in q's dtype (an fp8 cache's codes are the values: its scale is 1)
        keys = k_cache.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, slots).to(q.dtype).transpose(0, 1).unsqueeze(0)
        query = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
        mask = None
        if 1 < n < length:  # a later chunk: row i sees keys 0..length-n+i
            rows = torch.arange(length - n, length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= rows[:, None]
        o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, is_causal=n == length > 1,
                                           scale=scale, enable_gqa=gqa)  # fmt: skip
        out[start : start + n] = o[0].transpose(0, 1)
        start += n
    return out.view(t, heads * d)
