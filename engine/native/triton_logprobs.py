"""A greedy batch's logprobs in one read of its logits: each row's log-sum-exp and its top k, in Triton; and each
row's argmax, split the same way.

``torch.topk`` and ``torch.logsumexp`` over [64, 128,256] float32 logits took 153 and 107 µs on the H200
(bench/topk_check.py), where reading the 33 MB once takes about 10. Here the first kernel splits each row into
CHUNK-wide parts: each program reads its part once, keeps it in registers, and leaves the part's max, its sum of
exponentials (relative to that max) and its top k; the second merges a row's parts: the row's log-sum-exp and
its top k among the parts' candidates, normalized and packed as ``sampler._pack`` packs them.

Not used by the engine yet: its speed on the H200 is not measured (``python3 bench/topk_check.py`` and
``tests/test_gpu.py::test_fused_top_logprobs_match_torch`` there); ``sampler._logprobs`` takes it once they
say it is faster. Its logic is checked in Triton's interpreter (tests/test_kernels_interpreted.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 8192  # one program's part of a row (8 warps: 32 values a thread)
MAX_K = 20  # OpenAI's limit on alternatives


@triton.jit
def _parts(x_ptr, stride, width, vals_ptr, ids_ptr, max_ptr, sum_ptr, K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    local = tl.arange(0, CHUNK)
    offs = part * CHUNK + local
    x = tl.load(x_ptr + row * stride + offs, mask=offs < width, other=-float("inf"))
    top = tl.max(x, axis=0)
    # A part every value of which a grammar forbade (all -inf) sums to 0, not NaN.
    total = tl.sum(tl.exp(tl.where(x > -float("inf"), x - top, -float("inf"))), axis=0)
    here = row * parts + part
    tl.store(max_ptr + here, top)
    tl.store(sum_ptr + here, total)
    for t in tl.static_range(K):
        best = tl.max(x, axis=0)
        at = tl.argmax(x, axis=0)
        tl.store(vals_ptr + here * K + t, best)
        tl.store(ids_ptr + here * K + t, part * CHUNK + at)
        x = tl.where(local == at, -float("inf"), x)


@triton.jit
def _merge(
    vals_ptr,
    ids_ptr,
    max_ptr,
    sum_ptr,
    out_ptr,
    parts,
    floor,
    K: tl.constexpr,
    PARTS: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    row = tl.program_id(0)
    p = tl.arange(0, PARTS)
    maxes = tl.load(max_ptr + row * parts + p, mask=p < parts, other=-float("inf"))
    sums = tl.load(sum_ptr + row * parts + p, mask=p < parts, other=0.0)
    top = tl.max(maxes, axis=0)
    lse = top + tl.log(tl.sum(sums * tl.exp(maxes - top), axis=0))  # a part that is all -inf adds 0
    c = tl.arange(0, CANDIDATES)
    vals = tl.load(vals_ptr + row * parts * K + c, mask=c < parts * K, other=-float("inf"))
    ids = tl.load(ids_ptr + row * parts * K + c, mask=c < parts * K, other=0)
    for t in tl.static_range(K):
        best = tl.max(vals, axis=0)
        at = tl.argmax(vals, axis=0)
        token = tl.sum(tl.where(c == at, ids, 0), axis=0)
        tl.store(out_ptr + row * 2 * K + t, tl.maximum(best - lse, floor))
        tl.store(out_ptr + row * 2 * K + K + t, token.to(tl.float32))
        vals = tl.where(c == at, -float("inf"), vals)


def top_logprobs(scores: torch.Tensor, k: int, floor: float) -> torch.Tensor:
    """[rows, 2k] float32: each row's k best log-probabilities (its log-softmax, floored at ``floor``), best first,
    then their ids, of float32 logits ``scores`` [rows, width] (contiguous rows)."""
    assert scores.dtype == torch.float32 and scores.stride(1) == 1 and 1 <= k <= MAX_K
    rows, width = scores.shape
    parts = triton.cdiv(width, CHUNK)
    vals = torch.empty(rows, parts, k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(rows, parts, k, dtype=torch.int32, device=scores.device)
    maxes = torch.empty(rows, parts, dtype=torch.float32, device=scores.device)
    sums = torch.empty(rows, parts, dtype=torch.float32, device=scores.device)
    out = torch.empty(rows, 2 * k, dtype=torch.float32, device=scores.device)
    _parts[(rows, parts)](scores, scores.stride(0), width, vals, ids, maxes, sums, K=k, CHUNK=CHUNK, num_warps=8)
    _merge[(rows,)](
        vals,
        ids,
        maxes,
        sums,
        out,
        parts,
        floor,
        K=k,
        PARTS=triton.next_power_of_2(parts),
        CANDIDATES=triton.next_power_of_2(parts * k),
    )
    return out


@triton.jit
def _argmax_parts(x_ptr, stride, width, max_ptr, ids_ptr, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    offs = part * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride + offs, mask=offs < width, other=-float("inf"))
    top, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(max_ptr + row * parts + part, top)
    tl.store(ids_ptr + row * parts + part, part * CHUNK + at)


@triton.jit
def _argmax_merge(max_ptr, ids_ptr, out_ptr, parts, PARTS: tl.constexpr):
    row = tl.program_id(0)
    p = tl.arange(0, PARTS)
    maxes = tl.load(max_ptr + row * parts + p, mask=p < parts, other=-float("inf"))
    ids = tl.load(ids_ptr + row * parts + p, mask=p < parts, other=0)
    best = tl.argmax(maxes, axis=0, tie_break_left=True)  # the first part holding the row's max: its first index
    tl.store(out_ptr + row, tl.sum(tl.where(p == best, ids, 0), axis=0).to(tl.int64))


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """[rows] int64: each row's argmax of float32 ``scores`` [rows, width] (contiguous rows), the first index of the
    max as torch.argmax gives it. torch's kernel reduces a row in one block of threads: 28 µs for one row of 128,256
    on the H200, 39 for 64; here CHUNK-wide parts of a row run side by side, then one small program per row merges
    them: the decode graphs 21 µs shorter at batch 1, 25 at 64 (docs/benchmarks.md, twenty-fifth session)."""
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    rows, width = scores.shape
    parts = triton.cdiv(width, CHUNK)
    maxes = torch.empty(rows, parts, dtype=torch.float32, device=scores.device)
    ids = torch.empty(rows, parts, dtype=torch.int32, device=scores.device)
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    _argmax_parts[(rows, parts)](scores, scores.stride(0), width, maxes, ids, CHUNK=CHUNK, num_warps=8)
    _argmax_merge[(rows,)](maxes, ids, out, parts, PARTS=triton.next_power_of_2(parts))
    return out
