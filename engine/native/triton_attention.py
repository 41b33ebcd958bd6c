"""Paged attention in Triton: one kernel for prefill chunks and decode tokens in the same step.

A program takes BLOCK_Q query rows of one sequence and one KV head, with the GROUP query heads
that share that head stacked as rows (grouped-query attention reads each key tile once for all
of them), and walks the sequence's keys up to its last row's position through the block table,
in tiles of BLOCK_N positions, with an online softmax in fp32.

Decode runs a program per sequence (or, with ``split_kv``, several, each walking whole tiles of its positions, their
partial softmaxes merged by _merge_splits). A decode step takes the merged q/k/v projection unrotated (Rope): each
program rotates its heads' queries, and the one whose walk ends at the new token rotates that token's key and writes
it and its value into the cache before it reads them, so the rotary kernel (fused_ops.rope_kv_write, which prompt
steps keep) is not launched. On an H100, llama3-8b's graphed decode step, alternating runs on one machine: 3.425 ->
3.394 ms at batch 1, 3.80 -> 3.74 at 16, 4.614 -> 4.557 at 64 (bench/results/gpu_h100_decode_rope_s43.json).

A step with prompt rows runs T // BLOCK_Q + S programs per KV
head for T rows of S sequences: sequence s owns the programs from query_start[s] // BLOCK_Q + s on
(at least the ceil(rows / BLOCK_Q) it needs), and each program finds its sequence by comparing its
index with those starts. Programs past a sequence's rows return at once, so the grid may be an upper
bound: a CUDA graph captures it for the largest step of its size and replays it for any mix of
sequences. (A grid of S x ceil(T / BLOCK_Q) programs, one row of query blocks per sequence, is
S times larger: 131,072 programs a layer for a 2,048-token graph of 128 sequences, nearly all of
them returning at once.)

A step with prompt rows whose sequences all hold the same blocks for their first positions (a system prompt that
prefix caching shares; ``StepBatch.shared_prefix`` says how many positions, 0 for none) walks those positions once for
a tile of rows of several sequences (_shared_prefix_rows: the prompt rows BLOCK_Q tokens at a time whatever their
sequences, the decode rows DECODE_GROUP sequences at a time), then each of the tile's sequences' own positions for
that sequence's rows. Per sequence, a decode row's GROUP heads take a tile of BLOCK_Q * GROUP rows of their own and a
50-row question four 16-row blocks, every one of them walking the whole prefix. A decode launch over a shared prefix
does the same with its rows, DECODE_GROUP sequences a program (its other programs return), rotating their queries and
writing their keys as its walk a sequence does; split over programs (a few sequences), it walks each sequence.

Metadata as engine/native/attention.py's StepBatch describes it; the torch version there is the reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.native.attention import StepBatch
from engine.native.fused_ops import (
    FP8_MAX,
    GROUP,
    SMALL_ROWS,
    Quantized,
    group_codes,
    pdl_enabled,
    pdl_enter,
    quantized_like,
    rotated,
    sm_count,
    store_groups,
)
from engine.native.kv_cache import KV_FP8

MIN_ROWS = 16  # tl.dot needs at least 16 rows
DECODE_GROUP = 4  # decode rows a program of a step with a shared prefix takes together (_shared_prefix_rows)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["seqs", "out_rows"])
def _paged_attention(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, shared_ptr, cos_ptr, sin_ptr, slot_ptr,
    out_scale_ptr, scale, seqs, out_rows, stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
    stride_table,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, SEQS_P2: tl.constexpr, DECODE_GROUP: tl.constexpr,
    USE_PDL: tl.constexpr, SPLITS: tl.constexpr = 1, ROPE_HEADS: tl.constexpr = 0, QUANTIZE: tl.constexpr = False,
    OUT_DTYPE: tl.constexpr = tl.bfloat16, FP8_MAX: tl.constexpr = 448.0, SHARED_WALK: tl.constexpr = True,
):  # fmt: skip
    kv_head = tl.program_id(1)
    qk_scale = scale * 1.4426950408889634  # exp2 below
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    dims = tl.arange(0, D_P2)
    dim_ok = dims < D
    m_i = tl.full([BLOCK_Q * GROUP_P2], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P2, D_P2], dtype=tl.float32)
    if SEQS_P2 != 0:
        pdl_enter(USE_PDL)
    # Whole tiles of the positions every sequence's rows see in the same blocks (engine/native/attention.py,
    # StepBatch.shared_prefix): walked once for a tile of rows of several sequences, where the launch has that walk
    # (shared_walk).
    if SHARED_WALK:
        bulk = tl.load(shared_ptr) // BLOCK_N * BLOCK_N
        if bulk > 0:
            if SEQS_P2 == 0:
                pdl_enter(USE_PDL)
                _shared_prefix_decode(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, cos_ptr,
                                      sin_ptr, slot_ptr, bulk, seqs, stride_qt, stride_qh, stride_ks, stride_kh,
                                      stride_ot, stride_oh, stride_table, qk_scale, m_i, l_i, acc, GROUP, GROUP_P2,
                                      BLOCK_Q, BLOCK_N, PAGE, D, D_P2, DECODE_GROUP, ROPE_HEADS, OUT_DTYPE)  # fmt: skip
            else:
                _shared_prefix_rows(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, bulk,
                                    seqs, stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                                    stride_table, qk_scale, m_i, l_i, acc, GROUP, GROUP_P2, BLOCK_Q, BLOCK_N, PAGE, D,
                                    D_P2, SEQS_P2, DECODE_GROUP)  # fmt: skip
            return
    if SEQS_P2 != 0:
        seq, q_block = _find_query_block(query_start_ptr, seqs, tl.program_id(0), BLOCK_Q, SEQS_P2)
    else:  # decode: program i is sequence i's one row
        seq = tl.program_id(0)
        q_block = 0
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # positions before this step's tokens
    q_index = q_block * BLOCK_Q + rows // GROUP_P2  # which of the sequence's query rows
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (q_index < q_len) & (rows % GROUP_P2 < GROUP)
    if ROPE_HEADS > 0:  # decode from the unrotated projection: the row's angles and slot (the step's inputs) first
        half = dims % (D // 2)
        c = tl.load(cos_ptr + q_begin * (D // 2) + half)
        s = tl.load(sin_ptr + q_begin * (D // 2) + half)
        slot = tl.load(slot_ptr + q_begin).to(tl.int64)
    if SEQS_P2 == 0:  # decode: the step's lengths above (its inputs) read before the wait; the queries after it
        pdl_enter(USE_PDL)
    q_mask = row_ok[:, None] & dim_ok[None, :]
    if ROPE_HEADS > 0:
        q = _rotated_heads(
            q_ptr + (q_begin + q_index)[:, None] * stride_qt + (head * D)[:, None], dims[None, :], q_mask, c, s, D
        ).to(OUT_DTYPE)
    else:
        q = tl.load(q_ptr + (q_begin + q_index)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                    mask=q_mask, other=0.0)  # fmt: skip
    q = _dot_operand(q, k_ptr)
    q_pos = context + q_index
    table = tables_ptr + seq * stride_table
    end = tl.minimum(seq_len, context + (q_block + 1) * BLOCK_Q)  # past the block's last row: invisible
    unmasked = 0
    if SEQS_P2 != 0:
        # Whole tiles of keys at or before the block's first row are visible to every row: in a step with prompt rows
        # they are walked without masks (a cached prefix's thousands of positions; a chunk's earlier context), the
        # arithmetic of the loop below where every mask would hold. On the H200, 32 layers: 20 chunks of 50 rows over
        # 2,000 cached positions 6.81 -> 5.20 ms, a fresh 1,024-token prompt 1.93 -> 1.64. Decode launches keep the
        # one loop: a second one cost them 14-27% at 300 positions (bench/results/gpu_attention_unmasked_bulk.json).
        unmasked = (context + q_block * BLOCK_Q + 1) // BLOCK_N * BLOCK_N
    for start in range(0, unmasked, BLOCK_N):
        m_i, l_i, acc = _attend(q, q_pos, row_ok, m_i, l_i, acc, k_ptr, v_ptr, table, start, end, kv_head,
                                stride_ks, stride_kh, qk_scale, BLOCK_N, PAGE, D, D_P2, False, False)  # fmt: skip
    lo, hi = unmasked, end
    if SPLITS > 1:  # decode split over SPLITS programs: this one's whole tiles of the positions (none past the end)
        chunk = tl.cdiv(tl.cdiv(end, SPLITS), BLOCK_N) * BLOCK_N
        lo = tl.minimum(tl.program_id(2) * chunk, end)
        hi = tl.minimum(lo + chunk, end)
    if ROPE_HEADS > 0:  # noqa: SIM102 (a constexpr branch around a runtime one)
        if (hi == end) & (lo < hi):  # the program whose walk ends at the new token writes its key and value first
            token = q_ptr + q_begin * stride_qt
            k = _rotated_heads(token + (ROPE_HEADS + kv_head) * D, dims, dims < D, c, s, D)
            cache = slot * stride_ks + kv_head * stride_kh + dims
            tl.store(k_ptr + cache, k.to(k_ptr.dtype.element_ty))
            # (the store rounds the value to the cache's type: an fp8 cache's too, to nearest even, saturating)
            tl.store(v_ptr + cache, tl.load(token + (ROPE_HEADS + tl.num_programs(1) + kv_head) * D + dims))
            tl.debug_barrier()  # every thread of the program sees the stores before its loads below
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend(q, q_pos, row_ok, m_i, l_i, acc, k_ptr, v_ptr, table, start, hi, kv_head,
                                stride_ks, stride_kh, qk_scale, BLOCK_N, PAGE, D, D_P2, True, False)  # fmt: skip
    if QUANTIZE:  # one walk a decode row (D = GROUP): its heads quantized for o_proj here, as _merge_splits does
        out = (acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(OUT_DTYPE).to(tl.float32)
        codes, out_scale = group_codes(out, FP8_MAX)
        t = q_begin + q_index
        tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 codes.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])  # fmt: skip
        tl.store(out_scale_ptr + head * out_rows + t, out_scale, mask=row_ok)  # Quantized's strides (1, rows)
    elif SPLITS == 1:
        _store(out_ptr, acc, l_i, q_begin + q_index, head, row_ok, dims, dim_ok, stride_ot, stride_oh)
    else:  # the split's unnormalized sum and softmax state, [D sums, max, total] at out_ptr's row: _merge_splits
        part = out_ptr + (q_begin + q_index) * stride_ot + head * stride_oh + tl.program_id(2) * (D + 2)
        tl.store(part[:, None] + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(part + D, m_i, mask=row_ok)
        tl.store(part + D + 1, l_i, mask=row_ok)


@triton.jit
def _rotated_heads(ptrs, dims, mask, c, s, D: tl.constexpr):
    """Heads of D values at ``ptrs`` (a head a row, or one head), rotate-half rotated by angles ``c`` and ``s`` (per
    dim, each half's angles repeated), in fp32: the arithmetic of fused_ops' rotary kernels."""
    x = tl.load(ptrs + dims, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptrs + (dims + D // 2) % D, mask=mask, other=0.0).to(tl.float32)
    return rotated(x, tl.where(dims < D // 2, -partner, partner), c, s)


@triton.jit
def _merge_splits(part_ptr, out_ptr, scale_ptr, stride_pt, stride_ph, stride_ot, stride_oh, SPLITS: tl.constexpr,
                  SPLITS_P2: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, OUT_DTYPE: tl.constexpr,
                  QUANTIZE: tl.constexpr, FP8_MAX: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """A decode row's head from its SPLITS partial walks (in split order: deterministic), as one walk's online softmax
    would have ended: each split's sum weighted by exp2(its max - the overall max), over the weighted totals. Rounded
    to OUT_DTYPE; QUANTIZE (D = 128): stored as one group of a block-FP8 GEMM's activations instead (fp8 at out_ptr,
    the group's scale at scale_ptr), as quantize_groups would quantize the rounded values."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    head = tl.program_id(1)
    split = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, D_P2)
    live = split < SPLITS
    part = part_ptr + t * stride_pt + head * stride_ph + split * (D + 2)
    m = tl.load(part + D, mask=live, other=float("-inf"))
    top = tl.max(m, 0)
    weight = tl.math.exp2(m - tl.where(top == float("-inf"), 0.0, top))  # splits that saw no key (or no row): 0
    total = tl.sum(tl.load(part + D + 1, mask=live, other=0.0) * weight, 0)
    sums = tl.load(part[:, None] + dims[None, :], mask=live[:, None] & (dims < D)[None, :], other=0.0)
    out = (tl.sum(sums * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)).to(OUT_DTYPE)
    if QUANTIZE:  # the row's group `head`: columns head * D .. head * D + D - 1 of o_proj's input
        store_groups(out_ptr, scale_ptr, t, tl.num_programs(0), tl.num_programs(1) * D, head * D, out.to(tl.float32),
                     D, D, FP8_MAX)  # fmt: skip
    else:
        tl.store(out_ptr + t * stride_ot + head * stride_oh + dims, out, mask=dims < D)


@triton.jit
def _shared_prefix_rows(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, bulk, seqs,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_table, qk_scale, m_i, l_i, acc,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    D: tl.constexpr, D_P2: tl.constexpr, SEQS_P2: tl.constexpr, DECODE_GROUP: tl.constexpr,
):  # fmt: skip
    """A program of a step whose sequences share their first ``bulk`` positions (whole tiles): it walks them once for
    a tile of rows of several sequences, then each of those sequences' own positions for its rows. The first
    ceil(seqs / DECODE_GROUP) programs take the decode rows of DECODE_GROUP sequences each; the others take the
    prompt rows among the step's rows (program - those) * BLOCK_Q.. . A tile of decode rows of BLOCK_Q sequences
    would walk BLOCK_Q sequences' own positions one after the other (on the H200, 44 decode rows beside 20 chunks:
    7.56 ms for 32 layers against 6.94 a sequence at a time)."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    slot = rows // GROUP_P2  # the row's token in the tile
    head = kv_head * GROUP + rows % GROUP_P2
    head_ok = rows % GROUP_P2 < GROUP
    total = tl.load(query_start_ptr + seqs)  # the step's rows
    groups = tl.cdiv(seqs, DECODE_GROUP)
    if program < groups:
        t, row_seq, row_ok = _decode_rows(query_start_ptr, seqs, program, slot, head_ok, DECODE_GROUP)
    else:
        t = (program - groups) * BLOCK_Q + slot
        index = tl.arange(0, SEQS_P2)
        ends = tl.load(query_start_ptr + 1 + index, mask=index < seqs, other=total)
        row_seq = tl.sum((ends[None, :] <= t[:, None]).to(tl.int32), 1)  # sequences ending at or before the row
        row_ok = head_ok & (t < total)
        row_seq = tl.where(row_ok, row_seq, 0)
        row_ok = row_ok & (tl.load(query_start_ptr + row_seq + 1) - tl.load(query_start_ptr + row_seq) > 1)
    if tl.max(row_ok.to(tl.int32), 0) == 0:
        return
    row_seq = tl.where(row_ok, row_seq, 0)
    q_pos = tl.load(seq_lens_ptr + row_seq) - tl.load(query_start_ptr + row_seq + 1) + t  # the row's position
    dims = tl.arange(0, D_P2)
    dim_ok = dims < D
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
    q = _dot_operand(q, k_ptr)
    for start in range(0, bulk, BLOCK_N):  # the first sequence's table: every one holds the same blocks there
        m_i, l_i, acc = _attend(q, q_pos, row_ok, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr, start, bulk, kv_head,
                                stride_ks, stride_kh, qk_scale, BLOCK_N, PAGE, D, D_P2, False, False)  # fmt: skip
    # Then each sequence of the tile from there on, for its rows only (the others' are left exactly as they are).
    for s in range(tl.min(tl.where(row_ok, row_seq, seqs), 0), tl.max(row_seq, 0) + 1):
        mine = row_ok & (row_seq == s)
        end = tl.max(tl.where(mine, q_pos + 1, 0), 0)  # past its last row here (none: 0, nothing to walk)
        for start in range(bulk, end, BLOCK_N):
            m_i, l_i, acc = _attend(q, q_pos, mine, m_i, l_i, acc, k_ptr, v_ptr, tables_ptr + s * stride_table,
                                    start, end, kv_head, stride_ks, stride_kh, qk_scale, BLOCK_N, PAGE, D, D_P2, True,
                                    True)  # fmt: skip
    _store(out_ptr, acc, l_i, t, head, row_ok, dims, dim_ok, stride_ot, stride_oh)


@triton.jit
def _shared_prefix_decode(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr, cos_ptr, sin_ptr, slot_ptr, bulk, seqs,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_table, qk_scale, m_i, l_i, acc,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, D: tl.constexpr, D_P2: tl.constexpr, DECODE_GROUP: tl.constexpr, ROPE_HEADS: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):  # fmt: skip
    """A program of a decode launch whose sequences share their first ``bulk`` positions (whole tiles): the decode
    rows of DECODE_GROUP sequences (its grid has a program a sequence: those past the groups return), the prefix
    walked once for all of them, then each one's own positions for its rows, with the decode walk's other work:
    ROPE_HEADS, the rows' queries rotated here and each sequence's new key and value written before the walk reads
    them (Rope). Its output stays in OUT_DTYPE (paged_attention: quantized by quantize_groups).

    One loop of masked tiles: the prefix's, then the sequences' own in turn (a row sees its own sequence's only; one
    whose sequence has no tile there sees nothing), so each row meets its keys in the order a walk of its own would,
    and its output is the same to the bit. A loop for the prefix and another for the sequences' own positions (as
    _shared_prefix_rows walks them) compiled, beside the walk a sequence, to 189-194 registers a thread on sm_90; this
    one loop to ~150 (SHARED_DECODE_FILL)."""
    program = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_Q * GROUP_P2)
    slot = rows // GROUP_P2  # the row's sequence in the group
    head = kv_head * GROUP + rows % GROUP_P2
    t, row_seq, row_ok = _decode_rows(query_start_ptr, seqs, program, slot, rows % GROUP_P2 < GROUP, DECODE_GROUP)
    if tl.max(row_ok.to(tl.int32), 0) == 0:
        return
    row_seq = tl.where(row_ok, row_seq, 0)
    q_pos = tl.load(seq_lens_ptr + row_seq) - 1  # the row's position: its sequence's last
    dims = tl.arange(0, D_P2)
    dim_ok = dims < D
    q_mask = row_ok[:, None] & dim_ok[None, :]
    if ROPE_HEADS > 0:  # from the unrotated projection (D a power of two): each row at its token's angles
        half = dims % (D // 2)
        c = tl.load(cos_ptr + t[:, None] * (D // 2) + half[None, :], mask=row_ok[:, None], other=0.0)
        s = tl.load(sin_ptr + t[:, None] * (D // 2) + half[None, :], mask=row_ok[:, None], other=0.0)
        # each sequence's new key and value into the cache first (its rows' first head carries them once), as the
        # decode walk's program whose walk ends at the token writes them
        writes = row_ok & (rows % GROUP_P2 == 0)
        token = q_ptr + t[:, None] * stride_qt
        k = _rotated_heads(token + (ROPE_HEADS + kv_head) * D, dims[None, :], writes[:, None], c, s, D)
        cache = tl.load(slot_ptr + t, mask=writes, other=0).to(tl.int64)[:, None] * stride_ks + kv_head * stride_kh
        tl.store(k_ptr + cache + dims[None, :], k.to(k_ptr.dtype.element_ty), mask=writes[:, None])
        value = tl.load(token + (ROPE_HEADS + tl.num_programs(1) + kv_head) * D + dims[None, :], mask=writes[:, None])
        tl.store(v_ptr + cache + dims[None, :], value, mask=writes[:, None])
        tl.debug_barrier()  # every thread of the program sees the stores before its loads below
        q = _rotated_heads(q_ptr + t[:, None] * stride_qt + (head * D)[:, None], dims[None, :], q_mask, c, s, D)
        q = q.to(OUT_DTYPE)
    else:
        q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :], mask=q_mask, other=0.0)
    q = _dot_operand(q, k_ptr)
    first = program * DECODE_GROUP
    prefix_tiles = bulk // BLOCK_N
    own_tiles = tl.cdiv(tl.max(tl.where(row_ok, q_pos + 1, 0), 0) - bulk, BLOCK_N)  # the group's longest
    for i in range(0, prefix_tiles + own_tiles * DECODE_GROUP):
        own = i - prefix_tiles  # past the prefix: tile own // DECODE_GROUP of sequence own % DECODE_GROUP's own
        shared = own < 0
        seq = first + tl.where(shared, 0, own % DECODE_GROUP)
        start = tl.where(shared, i * BLOCK_N, bulk + own // DECODE_GROUP * BLOCK_N)
        end = tl.where(shared, bulk, tl.load(seq_lens_ptr + seq, mask=seq < seqs, other=0))
        m_i, l_i, acc = _attend(q, q_pos, row_ok & (shared | (row_seq == seq)), m_i, l_i, acc, k_ptr, v_ptr,
                                tables_ptr + seq * stride_table, start, end, kv_head, stride_ks, stride_kh, qk_scale,
                                BLOCK_N, PAGE, D, D_P2, True, True)  # fmt: skip
    _store(out_ptr, acc, l_i, t, head, row_ok, dims, dim_ok, stride_ot, stride_oh)


@triton.jit
def _decode_rows(query_start_ptr, seqs, program, slot, head_ok, DECODE_GROUP: tl.constexpr):
    """The decode rows a shared walk's ``program`` takes, DECODE_GROUP sequences' (``slot``: the row's sequence in the
    group): each row's token, sequence and whether it is one (a sequence of the group with exactly one row)."""
    row_seq = program * DECODE_GROUP + slot
    row_ok = head_ok & (slot < DECODE_GROUP) & (row_seq < seqs)
    t = tl.load(query_start_ptr + row_seq, mask=row_ok, other=0).to(tl.int32)
    row_ok = row_ok & (tl.load(query_start_ptr + row_seq + 1, mask=row_ok, other=0) - t == 1)
    return t, row_seq, row_ok


@triton.jit
def _dot_operand(q, k_ptr):
    """q as the walk's dots take it: a bf16 q over an fp8 cache in fp16, else q as it is. The dots take keys and
    values in q's dtype, and sm_90 converts e4m3 codes to fp16 in one instruction a pair of values, to bf16 only
    through fp16 with a second instruction a value: three conversions a pair instead of one (on an H100 the decode
    walk at 64 rows took 609 us a step with bf16 dots, 557-565 with these; bf16's cache 715). A bf16 q is exact in
    fp16 within its range (clamped to it), and so is every e4m3 value: the scores' products are those of bf16, and
    only the probabilities for the values' dot keep more bits."""
    if k_ptr.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:  # (constexpr: one return, one type)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q


@triton.jit
def _attend(
    q,
    q_pos,
    rows_in,
    m_i,
    l_i,
    acc,
    k_ptr,
    v_ptr,
    table,
    start,
    end,
    kv_head,
    stride_ks,
    stride_kh,
    qk_scale,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    MASKED: tl.constexpr,
    SELECT: tl.constexpr,
):
    """The tile of keys from ``start`` (of the sequence whose block table is ``table``) folded into the rows' online
    softmax. MASKED: only keys before ``end`` that a row sees (at or before its position ``q_pos``), and with SELECT
    for the rows of ``rows_in`` only (the others are left exactly as they were). Unmasked: every key of the tile, for
    every row."""
    k_pos = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, D_P2)
    if MASKED:
        k_ok = k_pos < end
        block = tl.load(table + k_pos // PAGE, mask=k_ok, other=0)
        kv_mask = k_ok[:, None] & (dims < D)[None, :]
    else:
        block = tl.load(table + k_pos // PAGE)
        kv_mask = (dims < D)[None, :]
    offsets = (block.to(tl.int64) * PAGE + k_pos % PAGE)[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
    if D == D_P2 and not MASKED:  # noqa: SIM108 (a constexpr branch: the other load is not compiled)
        k = tl.load(k_ptr + offsets)
    else:
        k = tl.load(k_ptr + offsets, mask=kv_mask, other=0.0)
    k = k.to(q.dtype)  # an fp8 cache's codes (scale 1) to fp16 (_dot_operand); nothing for a cache in q's dtype
    scores = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if SELECT:
            visible = visible & rows_in[:, None]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet (padding)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = m_new
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if D == D_P2 and not MASKED:  # noqa: SIM108
        v = tl.load(v_ptr + offsets)
    else:
        v = tl.load(v_ptr + offsets, mask=kv_mask, other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _store(out_ptr, acc, l_i, t, head, row_ok, dims, dim_ok, stride_ot, stride_oh):
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])  # fmt: skip


@triton.jit
def _find_query_block(query_start_ptr, seqs, program, BLOCK_Q: tl.constexpr, SEQS_P2: tl.constexpr):
    """The sequence whose programs include ``program``, and which of its query blocks that program takes: sequence s's
    first program is query_start[s] // BLOCK_Q + s (increasing in s), read for every sequence in one load."""
    index = tl.arange(0, SEQS_P2)
    live = index < seqs
    first = tl.load(query_start_ptr + index, mask=live, other=0) // BLOCK_Q + index
    owned = live & (first <= program)  # sequences 0..seq
    seq = tl.sum(owned.to(tl.int32), 0) - 1
    return seq, program - tl.max(tl.where(owned, first, 0), 0)


class Launch(NamedTuple):
    block_q: int  # query rows per program
    block_n: int  # key positions per tile
    num_warps: int
    num_stages: int
    splits: int = 1  # programs a decode row's sequence and KV head walks its positions with (merged: _merge_splits)


MAX_SPLITS = 16
# A decode walk over an fp8 cache converts each tile of keys and values for its dots (to fp16: _dot_operand), which
# takes 183-242 registers a thread on sm_90 (bench/kernel_resources.py --kv-cache-dtype fp8): 2 programs an SM where
# a bf16 cache's walk (102-111 registers) fits 4. Where the grid has more programs than SMs hold at 2, it is held to
# FP8_DECODE_REGISTERS (4 an SM, 72 bytes spilled); otherwise it keeps its registers. H100, graphed decode step ms held
# to 128 / not held (the fifty-first session): batch 1 (128 programs) 3.356 / 3.319, 16 (512) 3.632 / 3.698, 32 (256)
# 3.928 / 3.910, 64 (512) 4.265 / 4.425, 128 (1,024) 5.161 / 5.347.
FP8_DECODE_REGISTERS = 128
FP8_DECODE_PROGRAMS_PER_SM = 2  # at the walk's own registers


def fp8_decode_registers(programs: int, sms: int) -> int | None:
    """The registers a thread that an fp8 cache's decode walk of ``programs`` programs is held to: FP8_DECODE_REGISTERS
    where the SMs would not hold them all at once at its own registers, else None (not held)."""
    return FP8_DECODE_REGISTERS if programs > FP8_DECODE_PROGRAMS_PER_SM * sms else None


# A decode launch over a shared prefix (StepBatch.shared_prefix) walks it once for DECODE_GROUP sequences a program
# (_shared_prefix_decode) where the runner asks it to: a launch compiled with that walk beside the walk a sequence
# takes ~150 registers a thread on sm_90 where the walk alone takes ~110, 3 programs an SM instead of 4 (held to 128:
# 80-88 bytes spilled, slower still), so decode steps without a shared prefix keep a launch without it (a graph of
# each: engine/native/model_runner.py) and compile to main's instructions. On an H100, llama3-8b's heads over 32 layers,
# the shared walk against a walk a sequence (bench/attention_ab.py, bench/results/gpu_h100_s54_attention_*.json): 44
# sequences at 2,100 positions, 2,000 of them shared, 2,332-2,339 against 2,791-2,813 us; 64: 2,346 against 2,813;
# 128: 2,609-2,626 against 5,548; 128 at 612, 512 shared: 1,298-1,301 against 1,942. It loses where its groups leave
# SMs idle (24 and 32 sequences at 2,100: 2,311-2,330 against 1,941-2,015) or where the sequences' own positions
# outweigh what it saves (64 at 2,300: 3,144-3,160 against 3,205-3,216; 64 at 456, 256 shared: 1,400 against 1,036).
# The runner keeps a step on the walk a sequence where its sequences' own positions are long (SHARED_DECODE_OWN).
SHARED_DECODE_FILL = 2 / 3  # groups x KV heads at least this many SMs' worth of programs


def shared_decode_pays(seqs: int, kv_heads: int, sms: int, kv_dtype: torch.dtype) -> bool:
    """Whether a decode launch of ``seqs`` sequences (padding ones included) may take the shared walk: over a bf16
    cache, not split over programs (launch_shape), with enough groups of DECODE_GROUP sequences to fill
    SHARED_DECODE_FILL of the SMs. Over an fp8 cache it is not measured yet: compiled for sm_90 it takes 243-247
    registers a thread without spilling (2 programs an SM), and fp8_decode_registers, which holds a decode launch of
    more programs than that to 128, would have to leave it alone."""
    programs = seqs * kv_heads
    return (kv_dtype != KV_FP8 and launch_shape(1, 1, programs, sms).splits == 1
            and seqs // DECODE_GROUP * kv_heads >= SHARED_DECODE_FILL * sms)  # fmt: skip


def shared_walk(batch: StepBatch, splits: int, kv_dtype: torch.dtype) -> bool:
    """Whether a launch is compiled with the shared prefix's walk: every launch of a step with prompt rows; a decode
    launch where the runner asks it (StepBatch.decode_walks_shared), over a bf16 cache and not split."""
    return batch.max_query_len > 1 or (batch.decode_walks_shared and splits == 1 and kv_dtype != KV_FP8)


def launch_shape(group: int, max_query_len: int, programs: int, sms: int) -> Launch:
    """Single rows for decode, 64-row tiles for prefill; 64-wide key tiles with 4 warps. Decode with fewer programs
    (sequences x KV heads) than SMs splits each sequence's positions over up to MAX_SPLITS programs, about four
    programs an SM in all, their partial softmaxes merged by a second kernel. On the H200, for llama3-8b's heads over
    32 layers, against the unsplit walk this replaced (256-wide tiles with 8 warps; bench/attention_ab.py --splits,
    bench/results/gpu_attention_split_kv.json): batch 1 (16 splits) 173 against 296 us a step at 300 positions, 275
    against 1,017 at 2,000, 650 against 3,855 at 8,000; batch 4 at 4,000 (16 splits) 772 against 2,059; batch 16 (4
    splits) 361 against 394 at 300. At batch 64 (512 programs) splitting in two cost 744 -> 942 us at 300 positions:
    decode with as many programs as SMs is not split."""
    group_p2 = triton.next_power_of_2(group)
    if max_query_len > 1:
        return Launch(max(1, 64 // group_p2), 64, 4, 2)
    rows = max(1, MIN_ROWS // group_p2)
    if programs < sms:
        per_program = 4 * sms // programs  # splits that make about four programs an SM; a power of two at most that
        return Launch(rows, 64, 4, 3, min(MAX_SPLITS, 1 << (per_program.bit_length() - 1)))
    return Launch(rows, 64, 4, 3)


class Rope(NamedTuple):
    """A decode step's queries left unrotated (paged_attention's ``rope``): q is then the merged q/k/v projection
    [T, (heads + 2 * kv_heads) * d], and each program rotates its heads' queries by the row's angles ``cos``/``sin``
    [T, d / 2], and the one whose walk ends at the new token writes that token's rotated key and its value into cache
    slot ``slots[t]`` before it reads them: fused_ops.rope_kv_write's work, without its launch."""

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    heads: int


@functools.cache
def _none_shared(device: torch.device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: StepBatch, scale: float,
                    block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                    block_q: int | None = None, decode_group: int = DECODE_GROUP, maxnreg: int | None = None,
                    split_kv: int | None = None, quantize_rows: int = 0,
                    rope: Rope | None = None) -> torch.Tensor | Quantized:  # fmt: skip
    """q [T, heads, d] against one layer's cache [slots, kv_heads, d] -> [T, heads * d]. ``block_n``, ``num_warps``,
    ``num_stages``, ``block_q``, ``decode_group``, ``maxnreg`` (registers a thread at most): launch choices other
    than launch_shape's and DECODE_GROUP (bench/attention_decode.py and bench/attention_ab.py try them).
    ``split_kv``: a decode step's positions walked by that many programs a sequence and KV head (launch_shape's
    choice unless given), whole tiles each, their partial softmaxes merged by a second kernel (_merge_splits): a few
    sequences would otherwise run a program per sequence and KV head on a GPU of 132 SMs.
    ``quantize_rows`` (= T): in a decode step where d is a quantization group (128), the output comes quantized for
    o_proj's block-FP8 GEMM (engine/native/fused_ops.py's Quantized: the same codes and scales as quantize_groups of
    the bf16 output), from the merge or, walked once in more than SMALL_ROWS rows, from the walk's own store: one
    launch fewer; otherwise [T, heads * d] in q's dtype, as always.
    ``rope`` (decode steps, d a power of two): q is the unrotated q/k/v projection, rotated and its keys and values
    written to the cache by this kernel (Rope)."""
    kv_heads, d = k_cache.shape[1:]
    if rope is None:
        t, heads, _ = q.shape
        stride_qt, stride_qh = q.stride(0), q.stride(1)
    else:
        if batch.max_query_len != 1 or d & (d - 1):
            raise ValueError("attention rotates its own queries in decode steps of a power-of-two head size only")
        t, heads, stride_qt, stride_qh = q.shape[0], rope.heads, q.stride(0), d
    group = heads // kv_heads
    seqs = batch.seq_lens.shape[0]
    launch = launch_shape(group, batch.max_query_len, seqs * kv_heads, sm_count(q.device))
    block_q, block_n = block_q or launch.block_q, block_n or launch.block_n
    out = torch.empty(t, heads, d, dtype=q.dtype, device=q.device)
    splits = (split_kv or launch.splits) if batch.max_query_len == 1 else 1
    # Decode hands o_proj its input quantized where asked: from the merge, or above SMALL_ROWS rows (launches without
    # PDL, where a launch fewer shows) from the one walk's own store. On an H100 at 128 rows 6.231 -> 6.179 ms a step;
    # at 64, where quantize_groups starts early, 4.681 -> 4.699 (bench/results/gpu_h100_decode_quant_planes_s43.json).
    # The shared walk's own store does not: at 128 rows on an H100 it cost that walk ~530 us a step against ~48 for
    # quantize_groups (bench/results/gpu_h100_s54_attention_engine_parts.json).
    walks_shared = shared_walk(batch, splits, k_cache.dtype)
    quantized = quantized_like(out.view(t, heads * d), t) if (
        quantize_rows == t and d == GROUP and batch.max_query_len == 1
        and (splits > 1 or (t > SMALL_ROWS and not walks_shared))
    ) else None  # fmt: skip
    # split: each program's partial sums and softmax state, [T, heads, splits, d + 2] (fp32), then merged into out
    if splits > 1:
        dest = torch.empty(t, heads, splits, d + 2, dtype=torch.float32, device=q.device)
    else:
        dest = quantized.q.view(t, heads, d) if quantized else out
    grid: tuple[int, ...]
    if batch.max_query_len == 1:
        grid, seqs_p2 = (seqs, kv_heads, splits), 0
    else:
        grid, seqs_p2 = (t // block_q + seqs, kv_heads), triton.next_power_of_2(seqs)
    pdl = pdl_enabled(q.device) and t <= SMALL_ROWS
    if maxnreg is None and k_cache.dtype == KV_FP8 and batch.max_query_len == 1:
        maxnreg = fp8_decode_registers(seqs * kv_heads * splits, sm_count(q.device))
    _paged_attention[grid](
        q, k_cache, v_cache, dest, batch.block_tables, batch.seq_lens, batch.query_start,
        _none_shared(q.device) if batch.shared_prefix is None else batch.shared_prefix,
        *((rope.cos, rope.sin, rope.slots) if rope else (out, out, out)),
        quantized.scale if quantized and splits == 1 else out, scale, seqs, t,
        stride_qt, stride_qh, k_cache.stride(0), k_cache.stride(1), dest.stride(0), dest.stride(1),
        batch.block_tables.stride(0), GROUP=group, GROUP_P2=triton.next_power_of_2(group), BLOCK_Q=block_q,
        BLOCK_N=block_n, PAGE=batch.block_size, D=d, D_P2=triton.next_power_of_2(d), SEQS_P2=seqs_p2,
        DECODE_GROUP=min(decode_group, block_q), USE_PDL=pdl, SPLITS=splits, ROPE_HEADS=rope.heads if rope else 0,
        QUANTIZE=quantized is not None and splits == 1, OUT_DTYPE=_TL_DTYPES[q.dtype], FP8_MAX=FP8_MAX,
        SHARED_WALK=walks_shared,
        num_warps=num_warps or launch.num_warps, num_stages=num_stages or launch.num_stages, launch_pdl=pdl,
        **({"maxnreg": maxnreg} if maxnreg else {}),
    )  # fmt: skip
    if splits == 1:
        return quantized or out.view(t, heads * d)
    merged = quantized.q if quantized else out
    _merge_splits[(t, heads)](
        dest, merged, quantized.scale if quantized else merged, dest.stride(0), dest.stride(1), merged.stride(0),
        d, SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), D=d, D_P2=triton.next_power_of_2(d),
        OUT_DTYPE=_TL_DTYPES[q.dtype], QUANTIZE=quantized is not None, FP8_MAX=FP8_MAX, USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    return quantized or out.view(t, heads * d)
