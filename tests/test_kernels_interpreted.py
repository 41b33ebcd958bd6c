"""The engine's Triton kernels on the CPU, through Triton's interpreter: their logic against the torch reference.

The GPU runs the compiled kernels (tests/test_gpu.py); here CI checks the same code paths the GPU
takes for paged attention (decode, prompts, later chunks, graph-shaped launches) and the fused
rotary + KV write, in float32. Each test runs in a fresh interpreter process: kernels are bound to
the interpreter when their module is imported. Every launch a test's code makes is then compiled for
sm_90 in another process (Triton's compiler and ptxas need no GPU): the interpreter runs code that
the compiler refuses, and the H200 is lent for minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from processes import REPO

pytest.importorskip("triton")


def _interpreted(code: str, execute: bool = True) -> int:
    """Run ``code`` with the kernels in Triton's interpreter, then compile each kernel launch it made for sm_90 (the
    interpreter runs code that the compiler refuses: tests/triton_interpreter.py); how many. ``execute=False``: the
    launches are recorded, not run (for shapes the interpreter need not compute)."""
    with tempfile.TemporaryDirectory() as tmp:
        launches = str(Path(tmp) / "launches.jsonl")
        prelude = ("import sys; sys.path[:0] = ['tests', '.']\nimport triton_interpreter; triton_interpreter.enable(); "
                   f"triton_interpreter.record_launches({launches!r}, execute={execute})\n")  # fmt: skip
        run = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=REPO, capture_output=True,
                             text=True, timeout=600)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        compile_code = f"import triton_interpreter; print(len(triton_interpreter.compile_launches({launches!r})))"
        compiled = subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = ['tests', '.']\n" + compile_code],
                                  cwd=REPO, capture_output=True, text=True, timeout=600)  # fmt: skip
        assert compiled.returncode == 0, compiled.stderr[-3000:]
        count = int(compiled.stdout.split()[-1])
        assert count > 0, "no kernel launch recorded"
        return count


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (8, 8, 32), (12, 2, 48)])
def test_paged_attention_kernel_matches_reference(heads: int, kv_heads: int, dim: int) -> None:
    _interpreted(f"""
        import torch
        from attention_cases import check_paged_attention
        check_paged_attention(torch.device("cpu"), torch.float32, {heads}, {kv_heads}, {dim}, tolerance=1e-4)
    """)


def test_paged_attention_kernel_reads_an_fp8_cache_as_the_reference_does() -> None:
    """kv_cache_dtype = "fp8": keys and values kept as float8 e4m3 (scale 1), read as their values."""
    _interpreted("""
        import torch
        from attention_cases import check_paged_attention
        check_paged_attention(torch.device("cpu"), torch.float32, 9, 3, 64, tolerance=1e-4,
                              kv_dtype=torch.float8_e4m3fn)
        # a bf16 q, as on a GPU: the dots in fp16 (_dot_operand)
        check_paged_attention(torch.device("cpu"), torch.bfloat16, 9, 3, 64, tolerance=2e-2,
                              kv_dtype=torch.float8_e4m3fn)
    """)


def test_split_decode_hands_o_proj_its_input_quantized() -> None:
    """engine/native/triton_attention.py: a split decode step's merge quantizes o_proj's input (head dim 128, bf16)
    to the codes and scales quantize_groups gives its unquantized output; one walk, or other rows, stay bf16."""
    _interpreted("""
        import torch
        from attention_cases import check_split_decode_quantized_for_the_gemm
        check_split_decode_quantized_for_the_gemm(torch.device("cpu"), torch.bfloat16)
    """)


def test_paged_attention_compiles_for_hopper_in_every_launch_shape() -> None:
    """The attention kernel as the H200 launches it (bf16, head dim 128, each of launch_shape's choices for prompt
    rows and decode; 96 for a head size not a power of two; specialized as the JIT does there) compiles for sm_90:
    the interpreted tests compile their own launches, in float32 and smaller shapes. Decode with fewer programs than
    SMs is two launches, the split walk and its merge."""
    code = """
        import torch
        from attention_cases import make_batch
        from engine.native.triton_attention import paged_attention
        gen, blocks = torch.Generator().manual_seed(0), 1300
        # prompt rows; decode with fewer programs (sequences x KV heads) than SMs and with more; a head dim of 96
        for heads, kv_heads, dim, specs in [(32, 8, 128, [(100, 64)]), (32, 8, 128, [(300, 1)]),
                                            (32, 8, 128, [(300, 1)] * 64), (16, 8, 96, [(100, 64)])]:
            k, v = (torch.empty(blocks * 16, kv_heads, dim, dtype=torch.bfloat16) for _ in range(2))
            q = torch.empty(sum(n for _, n in specs), heads, dim, dtype=torch.bfloat16)
            paged_attention(q, k, v, make_batch(specs, blocks, torch.device("cpu"), gen), dim**-0.5)
    """
    assert _interpreted(code, execute=False) == 5


def test_decode_of_fewer_programs_than_sms_is_split_to_about_four_programs_an_sm() -> None:
    """launch_shape splits a decode step's positions only where its programs (sequences x KV heads) leave SMs idle:
    a power of two of splits, at most MAX_SPLITS, as many as keep the programs at or under four an SM; never a step
    with prompt rows."""
    from engine.native.triton_attention import MAX_SPLITS, launch_shape

    for sms in (132, 78, 16):
        for programs in range(1, 3 * sms):
            splits = launch_shape(4, 1, programs, sms).splits
            assert launch_shape(4, 2, programs, sms).splits == 1
            if programs >= sms:
                assert splits == 1, (sms, programs)
                continue
            assert 1 < splits <= MAX_SPLITS and splits & (splits - 1) == 0, (sms, programs, splits)
            assert programs * splits <= 4 * sms, (sms, programs, splits)
            assert splits == MAX_SPLITS or programs * splits * 2 > 4 * sms, (sms, programs, splits)


def test_an_fp8_caches_decode_walk_is_held_to_fewer_registers_only_where_its_grid_would_not_fit_the_sms() -> None:
    """Over an fp8 cache a decode walk keeps its own registers (2 programs an SM) where the grid fits the SMs at that,
    and is held to FP8_DECODE_REGISTERS (4 an SM) where it would not: llama3-8b's grids (sequences x 8 KV heads x
    launch_shape's splits) on 132 SMs, as measured on an H100 (engine/native/triton_attention.py)."""
    from engine.native.triton_attention import FP8_DECODE_REGISTERS, fp8_decode_registers, launch_shape

    def held(seqs: int) -> bool:
        programs = seqs * 8
        registers = fp8_decode_registers(programs * launch_shape(4, 1, programs, 132).splits, 132)
        assert registers in (None, FP8_DECODE_REGISTERS)
        return registers is not None

    assert {seqs: held(seqs) for seqs in (1, 2, 4, 16, 32, 33, 34, 64, 128)} == {
        1: False, 2: False, 4: True, 16: True, 32: False, 33: False, 34: True, 64: True, 128: True}  # fmt: skip


def test_a_decode_step_walks_its_shared_prefix_once_only_where_that_pays() -> None:
    """shared_decode_pays: llama3-8b's 8 KV heads on 132 SMs take the shared walk from 44 sequences (11 groups of four
    x 8 heads: 2/3 of the SMs), none over an fp8 cache (not measured); so the runner captures its graphs at the
    decode buckets 48 and up. And a step takes it only over a prefix at least eight times its sequences' own
    positions (SHARED_DECODE_OWN), at those batch sizes."""
    import torch

    from engine.native.model_runner import ModelRunner, decode_buckets
    from engine.native.triton_attention import shared_decode_pays

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert [b for b in decode_buckets(128) if shared_decode_pays(b, 8, 132, bf16)] == [48, 64, 96, 128]
    assert [b for b in decode_buckets(256) if shared_decode_pays(b, 8, 132, bf16)] == [48, 64, 96, 128, 192, 256]
    assert shared_decode_pays(44, 8, 132, bf16) and not shared_decode_pays(43, 8, 132, bf16)
    assert not any(shared_decode_pays(b, 8, 132, fp8) for b in decode_buckets(256))

    class Staged:  # what _decode_walks_shared reads of a runner that has staged a step
        def __init__(self, shared: int, own: int) -> None:
            self.shared, self.own = shared, own
            self._shared_decode_pays = lambda seqs: shared_decode_pays(seqs, 8, 132, bf16)

    def walks(shared: int, own: int, seqs: int) -> bool:
        return ModelRunner._decode_walks_shared(Staged(shared, own), seqs)  # type: ignore[arg-type]

    assert walks(2000, 100, 64) and walks(2000, 250, 64) and walks(512, 64, 128)
    assert not walks(2000, 251, 64) and not walks(2000, 100, 32) and not walks(0, 0, 64) and not walks(512, 100, 128)


def test_split_k_makes_enough_programs_and_keeps_its_planes_within_a_quarter_of_the_weight() -> None:
    """k_splits: the fewest splits dividing the K blocks (at most MAX_SPLIT) that make 2.5 programs an SM, of those
    whose split-K planes (splits x m x N x 4 bytes) stay within a quarter of the weight's N x K bytes and whose
    programs each walk at least MIN_WALK K blocks, else the most of those; llama3-8b's layer GEMMs at 1 and 64 rows
    as the decode step launches them (64-column tiles, 132 SMs), and a small model's short K, never split."""
    from engine.native.triton_fp8 import BLOCK_K, MAX_SPLIT, MIN_WALK, k_splits

    gemms = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    chosen = {(name, m): k_splits(m, k, n // 64, 132) for name, (n, k) in gemms.items() for m in (1, 64)}
    assert chosen == {("qkv", 1): 4, ("qkv", 64): 4, ("o", 1): 4, ("o", 64): 4, ("gate_up", 1): 1,
                      ("gate_up", 64): 1, ("down", 1): 7, ("down", 64): 7}  # fmt: skip
    assert k_splits(1, 640, 9, 132) == 1  # SmolLM2-135M's hidden 576, padded: five K blocks
    for m in range(1, 129):
        for n, k in [*gemms.values(), (1536, 640), (576, 1536)]:
            for tiles in (n // 64, 2 * n // 64):
                split = k_splits(m, k, tiles, 132)
                fits = {s: s == 1 or (s * m * n * 4 <= n * k / 4 and k // BLOCK_K // s >= MIN_WALK)
                        for s in range(1, MAX_SPLIT + 1)}  # fmt: skip
                allowed = [s for s, ok in fits.items() if ok and (k // BLOCK_K) % s == 0]
                assert split in allowed, (m, n, k, split)
                assert all(tiles * s < 330 for s in allowed if s < split), (m, n, k, split)  # no fewer would do
                assert tiles * split >= 330 or split == max(allowed), (m, n, k, split)  # else as many as allowed


def test_decode_attention_rotates_its_queries_and_writes_its_token() -> None:
    _interpreted("""
        import torch
        from attention_cases import check_decode_attention_rotates_and_writes_its_token
        check_decode_attention_rotates_and_writes_its_token(torch.device("cpu"), torch.float32)
        check_decode_attention_rotates_and_writes_its_token(torch.device("cpu"), torch.float32, torch.float8_e4m3fn)
    """)


@pytest.mark.parametrize("t", [21, 75])
def test_rope_kv_write_writes_each_token_to_its_slot(t: int) -> None:
    """Eight tokens a program at decode sizes, 32 past them; the last program's block partly empty."""
    _interpreted(f"""
        import torch
        from engine.native.fused_ops import rope_kv_write
        from engine.native.model import apply_rope
        heads, kv_heads, dim, t = 4, 2, 32, {t}
        gen = torch.Generator().manual_seed(0)
        qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen)
        angles = torch.rand(t, dim // 2, generator=gen) * 6
        k_cache, v_cache = torch.zeros(128, kv_heads, dim), torch.zeros(128, kv_heads, dim)
        slots = torch.randperm(128, generator=gen)[:t]
        cos, sin = angles.cos(), angles.sin()
        q = rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
        torch.testing.assert_close(q, apply_rope(qkv[:, : heads * dim].view(t, heads, dim), cos, sin))
        k_ref = apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim), cos, sin)
        torch.testing.assert_close(k_cache[slots], k_ref)
        assert torch.equal(v_cache[slots], qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim))
        assert int((k_cache != 0).any(dim=-1).sum()) == t * kv_heads
        # an fp8 cache (kv_cache_dtype = "fp8"): each key and value rounded once to float8 e4m3
        fp8 = torch.float8_e4m3fn
        k8, v8 = torch.zeros(128, kv_heads, dim, dtype=fp8), torch.zeros(128, kv_heads, dim, dtype=fp8)
        torch.testing.assert_close(rope_kv_write(qkv, cos, sin, k8, v8, slots, heads, kv_heads), q, rtol=0, atol=0)
        torch.testing.assert_close(k8[slots].float(), k_ref.to(fp8).float(), rtol=0.07, atol=2**-9)
        assert torch.equal(v8[slots].view(torch.uint8), qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
                           .to(fp8).view(torch.uint8))  # fmt: skip
    """)


def test_fused_group_quantization_matches_torch() -> None:
    _interpreted("""
        import torch
        from engine.native.kernels import quantize_per_token_group
        from engine.native.triton_fp8 import quantize_groups
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(7, 384, generator=gen) * torch.tensor([1e-3, 1.0, 300.0]).repeat_interleave(128)
        q, s = quantize_groups(x, 8)  # one padding row, as cuBLAS needs multiples of 4
        assert q.shape == (8, 384) and s.shape == (8, 3) and s.stride() == (1, 8)
        ref_q, ref_s = quantize_per_token_group(x)
        torch.testing.assert_close(s[:7], ref_s, rtol=1e-6, atol=0)
        # The interpreter's e4m3 cast does not carry a mantissa rounded up into the exponent (128 comes
        # out as 64); those elements aside, the codes are torch's. tests/test_gpu.py checks them exactly.
        same = q[:7].float() == ref_q.float()
        assert same.float().mean() > 0.95
        assert bool((q[:7].float()[~same] * 2 == ref_q.float()[~same]).all())
        assert torch.count_nonzero(q[7].float()) == 0
    """)


def test_block_fp8_gemm_matches_its_dequantized_operands_for_every_row_tile_and_split() -> None:
    """engine/native/triton_fp8.py: the activations quantized once (quantize_groups), then each program's FP8 dot
    per 128x128 block with both scales, K split across programs and the planes summed by a second kernel; against the
    same quantized operands dequantized and multiplied in float32. Rows from one to two row tiles (five of 16 rows)."""
    _interpreted("""
        import torch
        from engine.native.triton_fp8 import fp8_block_gemm, quantize_groups
        gen = torch.Generator().manual_seed(0)
        n, k = 256, 512
        w = (torch.randn(n, k, generator=gen) / 4).to(torch.float8_e4m3fn)
        ws = torch.rand(n // 128, k // 128, generator=gen) + 0.5
        w_ref = w.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)
        for m in (1, 5, 20, 70):
            x = torch.randn(m, k, generator=gen)
            q, s = quantize_groups(x, m)
            ref = (q.float() * s.repeat_interleave(128, 1)) @ w_ref.T
            for block_n, split, swap, tma, block_m in ((64, 1, False, False, None), (64, 2, True, False, None),
                                                       (64, 4, False, True, None), (128, 2, False, False, None),
                                                       (128, 1, True, True, None), (64, 2, True, False, 16)):
                out = fp8_block_gemm(x, w, ws, block_n=block_n, split_k=split, swap_ab=swap, tma=tma, block_m=block_m)
                assert out.shape == (m, n) and out.dtype == x.dtype
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    """)


def test_norm_and_activation_quantize_for_the_gemm_as_quantize_groups_does() -> None:
    """engine/native/fused_ops.py: RMSNorm (with the residual added) and SiLU-and-multiply hand a block-FP8 GEMM its
    operands quantized: the same fp8 codes and scales as quantize_groups of their unquantized output, the same
    residual stream, and the GEMM's output the same as from the unquantized activations. Widths past one kernel
    block (the activation's 1,024 columns) and not a power of two; rows padded with zeros, as cuBLAS' GEMM takes
    them."""
    _interpreted("""
        import torch
        from quantize_cases import check_quantized_for_gemm
        check_quantized_for_gemm(torch.device("cpu"), [(1, 1, 256, 256), (5, 5, 384, 384), (3, 3, 1152, 1152),
                                                       (5, 8, 384, 1152)], split_k=1)
    """)


def test_fused_top_logprobs_match_log_softmax_and_topk() -> None:
    """engine/native/triton_logprobs.py: rows split into parts, a row whose allowed tokens sit in three parts (a
    grammar's), a part all forbidden, widths not a multiple of the part."""
    _interpreted("""
        import torch
        from engine.native.triton_logprobs import top_logprobs
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 20000, generator=gen) * 4
        x[1, :] = -float("inf")
        x[1, [5, 17000, 9000]] = torch.tensor([1.0, 3.0, 2.0])
        x[2, 8192:16384] = -float("inf")
        for k in (1, 5):
            out = top_logprobs(x, k, -9999.0)
            values, ids = torch.log_softmax(x, -1).clamp_min(-9999.0).topk(k, -1)
            torch.testing.assert_close(out[:, :k], values, rtol=0, atol=1e-5)
            assert torch.equal(out[0, k:].long(), ids[0]) and torch.equal(out[2, k:].long(), ids[2])
            assert out[1, k:].long().tolist()[:3] == [17000, 9000, 5][:k]
            assert out[1, :k].tolist()[3:] == [-9999.0] * (k - 3)  # fewer allowed tokens than asked: floored
    """)


def test_split_argmax_is_the_first_index_of_each_rows_max() -> None:
    """engine/native/triton_logprobs.py's argmax: parts of a row side by side, then merged; ties inside a part and
    across parts (the first wins, as in torch), a row all -inf, the max in the short last part."""
    _interpreted("""
        import torch
        from engine.native.triton_logprobs import argmax
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(5, 20000, generator=gen)
        x[1] = -float("inf")
        x[2, [3, 17000]] = 50.0
        x[3, [9000, 9001]] = 60.0
        x[4, 19999] = 70.0
        assert argmax(x).tolist() == x.argmax(-1).tolist() == [x[0].argmax().item(), 0, 3, 9000, 19999]
    """)


def test_engine_kernels_of_llama3_8b_steps_spill_no_registers_and_pipeline_their_loads(tmp_path: Path) -> None:
    """Every Triton launch of a llama3-8b fp8-block step (decode at 1-128 sequences, split over programs at 1 and 16;
    questions over a cached prefix beside decode rows; a fresh prompt: bench/kernel_resources.py, the engine's own
    wrappers with the step's shapes), compiled for sm_90 as the JIT specializes it, keeps its values in registers (a
    spill goes to local memory, a cliff the interpreter cannot show), and the attention and GEMM kernels' loops copy
    their tiles to shared memory asynchronously (the pipeliner gave up on none of their loads: without it every tile
    waits for its load). Each decode GEMM launch prefetches the first bytes of its weight rows before its PDL wait,
    as many as triton_fp8.prefetch_bytes gives its load path, within its K split."""
    from engine.native.triton_fp8 import prefetch_bytes

    out = tmp_path / "resources.json"
    run = subprocess.run([sys.executable, "bench/kernel_resources.py", "--out", str(out)], cwd=REPO,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert len(steps) == 7
    for step, launches in steps.items():
        kernels = {launch["kernel"] for launch in launches}
        assert {"_paged_attention", "_add_rms_norm", "_silu_mul", "_argmax_parts"} <= kernels, (step, kernels)
        for launch in launches:
            assert launch["spilled"] == 0, (step, launch)
            if launch["kernel"] in ("_paged_attention", "_fp8_block_gemm"):
                assert launch["async_copies"] > 0, (step, launch)
            if launch["kernel"] == "_fp8_block_gemm":
                choices = launch["choices"]
                assert choices["PREFETCH"] == prefetch_bytes(choices["TMA"]) > 0, (step, choices)
                assert choices["PREFETCH"] <= choices["K_PER_SPLIT"], (step, choices)
                assert launch["prefetches_before_wait"] > 0, (step, launch)  # issued while the kernel ahead runs
