"""Paged-attention cases shared by the CPU (Triton interpreter) and GPU tests: kernel against torch reference; what an
engine's runner tells the kernel of a step's shared prefix."""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.native.attention import StepBatch, attention_reference
from engine.native.kv_cache import slots_of

PAGE = 16


def make_batch(specs: list[tuple[int, int]], blocks: int, device: torch.device, gen: torch.Generator,
               max_query_len: int | None = None, pad_seqs: int = 0, shared: int = 0) -> StepBatch:  # fmt: skip
    """Sequences given as (context length after the step, query rows this step), blocks scattered at random;
    ``shared``: the first positions of every sequence in the same blocks (told to the kernel, a decode step's walked
    once for several sequences), a multiple of PAGE."""
    order = (torch.randperm(blocks - 1, generator=gen) + 1).tolist()  # block 0 is the null block
    common, used = order[: shared // PAGE], shared // PAGE
    tables = []
    for length, _ in specs:
        n = math.ceil(length / PAGE) - len(common)
        tables.append(common + order[used : used + n])
        used += n
    assert used < blocks
    starts = [0]
    for _, n in specs:
        starts.append(starts[-1] + n)
    starts += [starts[-1]] * pad_seqs  # padding sequences: no rows
    width = max(len(t) for t in tables)
    table = torch.zeros(len(specs) + pad_seqs, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    lengths = [length for length, _ in specs] + [0] * pad_seqs
    return StepBatch(
        tokens=torch.empty(0), positions=torch.empty(0), slots=torch.empty(0),
        query_start=torch.tensor(starts, device=device), seq_lens=torch.tensor(lengths, device=device),
        block_tables=table.to(device), logits_indices=torch.empty(0),
        max_query_len=max_query_len or max(n for _, n in specs), block_size=PAGE,
        shared_prefix=torch.tensor([shared], device=device), decode_walks_shared=shared > 0,
        context_slots=[torch.from_numpy(slots_of(t, 0, length, PAGE)).to(device)
                       for t, (length, _) in zip(tables, specs, strict=True)]
        + [torch.empty(0, dtype=torch.long, device=device)] * pad_seqs,
        query_lens=[n for _, n in specs] + [0] * pad_seqs,
    )  # fmt: skip


def check_paged_attention(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                          tolerance: float, kv_dtype: torch.dtype | None = None) -> None:  # fmt: skip
    """``kv_dtype``: the cache's element type where it is not ``dtype`` (fp8: the reference reads its values)."""
    from engine.native.triton_attention import paged_attention

    gen = torch.Generator().manual_seed(heads * dim)
    blocks = 320
    k = torch.randn(blocks * PAGE, kv_heads, dim, generator=gen).to(device, kv_dtype or dtype)
    v = torch.randn(blocks * PAGE, kv_heads, dim, generator=gen).to(device, kv_dtype or dtype)
    # (context after the step, rows) per sequence, the batch's max_query_len, padding sequences, padding token rows,
    # the first positions every sequence holds in the same blocks
    shared = [(200 + 50, 50), (200 + 9, 9), (200 + 31, 1), (200 + 40, 1), (200 + 3, 3), (200 + 70, 1), (200 + 18, 18)]
    cases = {
        "decode only": ([(37, 1), (1, 1), (16, 1), (17, 1), (200, 1)], None, 0, 0),
        "mixed": ([(37, 1), (20, 20), (150, 70), (5, 5), (64, 1), (90, 33)], None, 0, 0),
        "graph-shaped (upper-bound grid, padding sequences and rows)": ([(33, 1), (40, 17)], 128, 3, 110),
        # query blocks straddling sequences at every offset: short chunks over cached contexts, as a cached prefix's
        # questions are, beside one long prompt
        "short chunks over cached contexts": ([(60 + 7 * i, 1 + i % 7) for i in range(24)] + [(100, 100)], None, 0, 5),
        # a shared prefix walked for all rows at once: 192 positions in 12 blocks, three whole 64-position tiles (the
        # rest of each sequence's 200 earlier positions its own); decode rows and chunks of several sequences share
        # 16-row blocks
        "shared prefix": (shared, None, 0, 0, 192),
        "shared prefix, graph-shaped": (shared[::-1], 512, 2, 37, 192),
        "shared prefix under a tile (per sequence)": ([(40 + 20, 20), (40 + 5, 1)], None, 0, 0, 32),
    }
    # decode split over other numbers of programs than launch_shape's (split_kv; 1: one a sequence and KV head),
    # 16-position tiles so that most sequences' positions span several splits: some splits empty (a 1-token
    # sequence: all but the first), a split count not a power of two
    decode = [(37, 1), (1, 1), (16, 1), (17, 1), (200, 1)]
    splits = {f"decode split {n}": (decode, None, 0, 0, 0, n) for n in (1, 2, 3, 8)}
    splits["decode split 4, graph-shaped (padding sequences and rows)"] = ([(33, 1), (140, 1)], None, 3, 2, 0, 4)
    # decode rows over a shared prefix, walked once for DECODE_GROUP sequences (unsplit; split: a sequence a walk)
    over_prefix = [(200 + 31, 1), (200 + 1, 1), (200 + 40, 1), (200 + 70, 1), (200 + 18, 1), (200 + 3, 1)]
    splits["decode over a shared prefix"] = (over_prefix, None, 0, 0, 192, 1)
    splits["decode over a shared prefix, graph-shaped"] = (over_prefix[::-1], None, 3, 2, 192, 1)
    splits["decode over a shared prefix, split 3"] = (over_prefix, None, 0, 0, 192, 3)
    for name, (specs, max_query_len, pad, pad_rows, *more) in {**cases, **splits}.items():
        common, split_kv = more[0] if more else 0, more[1] if len(more) > 1 else None
        batch = make_batch(specs, blocks, device, gen, max_query_len, pad, common)
        rows = sum(n for _, n in specs)
        q = torch.randn(rows + pad_rows, heads, dim, generator=gen).to(device, dtype)
        scale = dim**-0.5
        expected = attention_reference(q[:rows].float(), k.float(), v.float(), batch, scale)
        launch = {} if split_kv is None else {"split_kv": split_kv, "block_n": 16}
        got = paged_attention(q, k, v, batch, scale, **launch)[:rows].float()
        error = float((got - expected).abs().max() / expected.abs().max())
        assert error < tolerance, (name, error)


def check_split_decode_quantized_for_the_gemm(device: torch.device, dtype: torch.dtype) -> None:
    """A decode step hands o_proj its input quantized where asked (quantize_rows = T, head dim 128: a head is one
    group of 128): split over programs from its merge, walked once in more than SMALL_ROWS rows from the walk's own
    store, the same fp8 codes and scales as quantize_groups of the bf16 output it would have returned; walked once
    in fewer rows, or rows other than T, unquantized."""
    from engine.native.fused_ops import SMALL_ROWS, Quantized
    from engine.native.triton_attention import paged_attention
    from engine.native.triton_fp8 import quantize_groups

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, blocks = 8, 2, 128, 40
    k = torch.randn(blocks * PAGE, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(blocks * PAGE, kv_heads, dim, generator=gen).to(device, dtype)
    batch = make_batch([(37, 1), (1, 1), (200, 1)], blocks, device, gen, None, 0, 0)
    q = torch.randn(3, heads, dim, generator=gen).to(device, dtype)
    launch = {"split_kv": 3, "block_n": 16}
    plain = paged_attention(q, k, v, batch, dim**-0.5, **launch)
    made = paged_attention(q, k, v, batch, dim**-0.5, quantize_rows=3, **launch)
    assert isinstance(made, Quantized) and made.rows == 3 and made.dtype == dtype, made
    ref_q, ref_s = quantize_groups(plain, 3)
    assert torch.equal(made.q.view(torch.uint8), ref_q.view(torch.uint8))
    assert made.scale.stride() == ref_s.stride() == (1, 3) and torch.equal(made.scale, ref_s)
    one_walk = {"split_kv": 1, "block_n": 16}
    walked_once = paged_attention(q, k, v, batch, dim**-0.5, **one_walk)
    cases = (({**one_walk, "quantize_rows": 3}, walked_once), ({**one_walk, "quantize_rows": 4}, walked_once),
             ({**launch, "quantize_rows": 4}, plain))  # fmt: skip
    for other, unquantized in cases:
        out = paged_attention(q, k, v, batch, dim**-0.5, **other)  # type: ignore[arg-type]
        assert isinstance(out, torch.Tensor) and torch.equal(out, unquantized), other
    many = SMALL_ROWS + 2  # a step of more rows than PDL takes: walked once, quantized by the walk's own store
    batch = make_batch([(1 + 7 * i % 90, 1) for i in range(many)], blocks * 8, device, gen, None, 0, 0)
    q = torch.randn(many, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(blocks * 8 * PAGE, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(blocks * 8 * PAGE, kv_heads, dim, generator=gen).to(device, dtype)
    walked_once = paged_attention(q, k, v, batch, dim**-0.5, block_n=16)
    made_once = paged_attention(q, k, v, batch, dim**-0.5, quantize_rows=many, block_n=16)
    assert isinstance(walked_once, torch.Tensor) and isinstance(made_once, Quantized) and made_once.rows == many
    ref_q, ref_s = quantize_groups(walked_once, many)
    assert torch.equal(made_once.q.view(torch.uint8), ref_q.view(torch.uint8))
    assert made_once.scale.stride() == (1, many) and torch.equal(made_once.scale, ref_s)


def check_decode_attention_rotates_and_writes_its_token(device: torch.device, dtype: torch.dtype,
                                                        kv_dtype: torch.dtype | None = None) -> None:  # fmt: skip
    """A decode step given the unrotated q/k/v projection (triton_attention.Rope) against rope_kv_write and then the
    same attention: the same keys and values in the cache, the same output (the rotation is one shared FMA), also
    quantized for o_proj, for every way of splitting the walk (the new token in a split of
    its own, in a split with others; splits left empty), and in a graph-shaped launch (padding sequences and rows,
    which write nothing); walked once over a shared prefix (StepBatch.shared_prefix: the rows of several sequences
    a program, each sequence's token written by the program of its group), which leaves its output unquantized.
    ``kv_dtype``: the cache's element type where it is not ``dtype`` (fp8: both round the rotated keys from fp32 and
    the values from the projection once)."""
    from engine.native.fused_ops import SMALL_ROWS, Quantized, rope_kv_write
    from engine.native.triton_attention import Rope, paged_attention
    from engine.native.triton_fp8 import quantize_groups

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, blocks = 8, 2, 128, 240
    decode = [(37, 1), (1, 1), (16, 1), (17, 1), (200, 1), (65, 1)]
    # (context after the step, rows) per sequence, padding sequences, padding rows, splits, the shared prefix
    cases = {f"split {n}": (decode, 0, 0, n, 0) for n in (None, 1, 3, 8)}
    cases["graph-shaped, split 4"] = ([(33, 1), (140, 1)], 3, 2, 4, 0)
    over_prefix = [(64 + 1, 1), (64 + 40, 1), (64 + 16, 1), (64 + 70, 1), (64 + 17, 1)]
    cases["one walk over a shared prefix, graph-shaped"] = (over_prefix, 2, 3, 1, 64)
    cases["split over a shared prefix (a walk a split)"] = (over_prefix, 0, 0, 3, 64)
    many = [(32 + 1 + 7 * i % 40, 1) for i in range(SMALL_ROWS + 3)]  # past SMALL_ROWS: not quantized by the walk
    cases["one walk over a shared prefix, past SMALL_ROWS"] = (many, 1, 1, 1, 32)
    for name, (specs, pad, pad_rows, split_kv, shared) in cases.items():
        batch = make_batch(specs, blocks, device, gen, 1, pad, shared)
        rows = len(specs)
        tables = batch.block_tables.cpu().tolist()
        new = [int(slots_of(tables[i], length - 1, length, PAGE)[0]) for i, (length, _) in enumerate(specs)]
        slots = torch.tensor(new + [0] * pad_rows, device=device)  # padding rows: the null block's slot 0
        qkv = torch.randn(rows + pad_rows, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
        angles = torch.rand(rows + pad_rows, dim // 2, generator=gen).to(device) * 6
        cos, sin = angles.cos(), angles.sin()
        k = torch.randn(blocks * PAGE, kv_heads, dim, generator=gen).to(device, kv_dtype or dtype)
        v = torch.randn(blocks * PAGE, kv_heads, dim, generator=gen).to(device, kv_dtype or dtype)
        k_ref, v_ref = k.clone(), v.clone()
        launch = {"block_n": 16, "split_kv": split_kv} if split_kv else {}
        q = rope_kv_write(qkv, cos, sin, k_ref, v_ref, slots, heads, kv_heads)
        expected = paged_attention(q, k_ref, v_ref, batch, dim**-0.5, **launch)
        got = paged_attention(qkv, k, v, batch, dim**-0.5, rope=Rope(cos, sin, slots, heads), **launch)
        assert not isinstance(got, Quantized) and not isinstance(expected, Quantized)
        real = slice(PAGE, None)  # rope_kv_write also wrote the padding rows into the null block
        assert torch.equal(bits(k[real]), bits(k_ref[real])) and torch.equal(bits(v[real]), bits(v_ref[real])), name
        assert bits(k[new]).any(), name
        torch.testing.assert_close(got[:rows], expected[:rows], rtol=0, atol=0, msg=name)
        # and quantized for o_proj (as the model asks: quantize_rows = T), from the merge or the one walk's store
        k2, v2 = k_ref.clone(), v_ref.clone()
        made = paged_attention(qkv, k2, v2, batch, dim**-0.5, rope=Rope(cos, sin, slots, heads),
                               quantize_rows=rows + pad_rows, **launch)  # fmt: skip
        # from the merge, or from the one walk's store past SMALL_ROWS rows (not the shared walk's, bf16 caches only:
        # quantize_groups quantizes its output)
        by_walk = rows + pad_rows > SMALL_ROWS and not (shared > 0 and kv_dtype != torch.float8_e4m3fn)
        assert isinstance(made, Quantized) == (split_kv != 1 or by_walk), name
        if not isinstance(made, Quantized):
            continue
        assert torch.equal(bits(k2[real]), bits(k_ref[real])) and torch.equal(bits(v2[real]), bits(v_ref[real])), name
        ref_q, ref_s = quantize_groups(expected, rows + pad_rows)
        assert torch.equal(made.q[:rows].view(torch.uint8), ref_q[:rows].view(torch.uint8)), name
        assert torch.equal(made.scale[:rows], ref_s[:rows]), name


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, compared for equality in any dtype (float8 ones too)."""
    return t.contiguous().view(torch.uint8)


def record_shared_prefixes(engine: Any) -> list[tuple[int, int, int]]:
    """From now on, (sequences, rows, the shared prefix staged for the kernel) of each step the engine's runner runs
    (engine/native/model_runner.py, ``_shared_prefix``), read from the staged host buffer once the step is launched."""
    runner, told = engine.runner, []
    run = runner.run

    def recording_run(step, every_token=frozenset(), drawn=None):  # type: ignore[no-untyped-def]
        out = run(step, every_token, drawn)
        told.append((len(step), sum(w.count for w in step), int(runner.host_np[runner.offsets["shared"]])))
        return out

    runner.run = recording_run
    return told
