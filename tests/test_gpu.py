"""CUDA-only checks (run on the GPU machine): FP8 block kernels, fused ops, CUDA-graph decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.checkpoint.fp8 import dequantize_weight, quantize_weight
from cache.checkpoint.schemes import Activations, LinearScheme, WeightKind
from cache.checkpoint.synth import synth_checkpoint
from cache.processing import FP8_BLOCK_SCALED_MM, process_linear, select_kernel

pytestmark = pytest.mark.gpu
BLOCK = LinearScheme(WeightKind.FP8_BLOCK, Activations.DYNAMIC_GROUP)


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(576, 1536), (192, 576), (1024, 2048)])
def test_block_fp8_kernel_matches_dequantized_reference(m: int, n: int, k: int) -> None:
    from engine.kernels import fp8_block_scaled_mm, quantize_per_token_group

    dev = torch.device("cuda")
    assert select_kernel(BLOCK, dev) == FP8_BLOCK_SCALED_MM
    gen = torch.Generator(device=dev).manual_seed(m + n + k)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_weight(w, WeightKind.FP8_BLOCK)
    tensors, recipe = process_linear(BLOCK, FP8_BLOCK_SCALED_MM, {"weight": q, "weight_scale": s}, torch.bfloat16, dev)
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    xq, xs = quantize_per_token_group(torch.nn.functional.pad(x, (0, recipe.padded_in - k)))
    x_deq = (xq.float().view(m, -1, 128) * xs.unsqueeze(-1)).view(m, -1)[:, :k]
    ref = x_deq @ dequantize_weight(q, s, WeightKind.FP8_BLOCK, torch.float32).t()
    got = fp8_block_scaled_mm(x, tensors, recipe).float()
    assert got.shape == (m, n)
    assert float((got - ref).norm() / ref.norm()) < 1e-2


def test_fused_norm_and_rope_match_torch() -> None:
    from engine.fused_ops import add_rms_norm, rope
    from engine.model import apply_rope, rms_norm

    dev = torch.device("cuda")
    x = torch.randn(5, 576, device=dev, dtype=torch.bfloat16)
    r = torch.randn(5, 576, device=dev, dtype=torch.bfloat16)
    w = torch.randn(576, device=dev, dtype=torch.bfloat16)
    expected_x = x + r
    expected = rms_norm(expected_x, w, 1e-5)
    got = add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(x, expected_x)
    assert float((got.float() - expected.float()).abs().max()) <= 2e-2 * float(expected.float().abs().max())
    q = torch.randn(5, 9, 64, device=dev, dtype=torch.bfloat16)
    angles = torch.rand(5, 32, device=dev) * 6
    torch.testing.assert_close(rope(q, angles.cos(), angles.sin()), apply_rope(q, angles.cos(), angles.sin()))


def test_cuda_graph_decode_equals_eager(tmp_path: Path) -> None:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    prompts = [[5, 6, 7] * 9, [11, 12] * 4, [3] * 40]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    graphed = LLMEngine(EngineConfig(model=path, device="cuda", max_num_seqs=4, max_model_len=256))
    assert graphed.graphs is not None
    a = graphed.generate(prompts, params)
    eager = LLMEngine(EngineConfig(model=path, device="cuda", max_num_seqs=4, max_model_len=256, cuda_graphs=False))
    assert a == eager.generate(prompts, params)


def test_fused_silu_mul_strided_rope_and_kv_write() -> None:
    from engine.fused_ops import kv_write, rope, silu_mul
    from engine.model import apply_rope

    dev = torch.device("cuda")
    gate_up = torch.randn(3, 2 * 1536, device=dev, dtype=torch.bfloat16)
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]  # views into one merged projection, as the model passes
    torch.testing.assert_close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up)

    qkv = torch.randn(4, 9 * 64 + 2 * 3 * 64, device=dev, dtype=torch.bfloat16)
    q = qkv[:, : 9 * 64].view(4, 9, 64)
    angles = torch.rand(4, 32, device=dev) * 6
    torch.testing.assert_close(rope(q, angles.cos(), angles.sin()), apply_rope(q, angles.cos(), angles.sin()))

    cache_k = torch.zeros(6, 3, 32, 64, device=dev, dtype=torch.bfloat16)
    cache_v = torch.zeros_like(cache_k)
    k = torch.randn(4, 3, 64, device=dev, dtype=torch.bfloat16)
    v = qkv[:, 9 * 64 + 3 * 64 :].view(4, 3, 64)
    positions = torch.tensor([0, 5, 31, 7], device=dev)
    kv_write(cache_k, cache_v, k, v, positions)
    for b in range(4):
        assert torch.equal(cache_k[b, :, positions[b]], k[b]) and torch.equal(cache_v[b, :, positions[b]], v[b])
    assert int((cache_k != 0).any(dim=-1).sum()) == 4 * 3, "nothing else written"


@pytest.mark.parametrize("kind", [WeightKind.FP8_CHANNEL, WeightKind.FP8_TENSOR])
@pytest.mark.parametrize("m", [1, 16, 300])
def test_rowwise_fp8_kernel_matches_dequantized_reference(kind: WeightKind, m: int) -> None:
    from cache.processing import FP8_ROWWISE_SCALED_MM
    from engine.kernels import fp8_rowwise_scaled_mm, quantize_per_token

    dev = torch.device("cuda")
    scheme = LinearScheme(kind, Activations.DYNAMIC_TOKEN)
    assert select_kernel(scheme, dev) == FP8_ROWWISE_SCALED_MM
    gen = torch.Generator(device=dev).manual_seed(m)
    n, k = 1536, 576
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_weight(w, kind)
    tensors, recipe = process_linear(scheme, FP8_ROWWISE_SCALED_MM, {"weight": q, "weight_scale": s},
                                     torch.bfloat16, dev)  # fmt: skip
    x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
    xq, xs = quantize_per_token(x)
    ref = (xq.float() * xs) @ dequantize_weight(q, s, kind, torch.float32).t()
    got = fp8_rowwise_scaled_mm(x, tensors, recipe).float()
    assert got.shape == (m, n)
    assert float((got - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize(("n", "k", "split_k"), [(4096, 4096, 8), (6144, 4096, 4), (4096, 14336, 8), (1024, 2048, 2)])
def test_split_k_in_kernel_reduction_is_exact_and_repeatable(n: int, k: int, split_k: int) -> None:
    """The last-arriving program sums the split planes: same result as one program over all of K
    (up to fp32 summation order), identical across calls, and the counters re-arm themselves."""
    from engine.triton_fp8 import _tile_counters, fp8_block_gemm

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + k)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_weight(w, WeightKind.FP8_BLOCK)
    for m in (1, 5, 16, 64):
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        whole = fp8_block_gemm(x, q, s, split_k=1).float()
        runs = [fp8_block_gemm(x, q, s, split_k=split_k) for _ in range(20)]
        assert all(torch.equal(runs[0], r) for r in runs), "split-K result changed between calls"
        assert float((runs[0].float() - whole).norm() / whole.norm()) < 1e-2
        assert int(_tile_counters(dev, 1).abs().sum()) == 0, "a tile counter was left armed"
    with pytest.raises(ValueError, match="does not divide"):
        fp8_block_gemm(x, q, s, split_k=k // 128 + 1)


def test_fused_rope_kv_write_matches_separate_ops() -> None:
    from engine.fused_ops import rope_kv_write
    from engine.model import apply_rope

    dev = torch.device("cuda")
    heads, kv_heads, dim, b = 8, 2, 128, 3
    qkv = torch.randn(b, (heads + 2 * kv_heads) * dim, device=dev, dtype=torch.bfloat16)
    angles = torch.rand(b, dim // 2, device=dev) * 6
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.zeros(4, kv_heads, 64, dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    positions = torch.tensor([0, 63, 9], device=dev)
    q = rope_kv_write(qkv, cos, sin, k_cache, v_cache, positions, heads, kv_heads)
    q_ref = apply_rope(qkv[:, : heads * dim].view(b, heads, dim), cos, sin)
    k_ref = apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(b, kv_heads, dim), cos, sin)
    v_ref = qkv[:, (heads + kv_heads) * dim :].view(b, kv_heads, dim)
    torch.testing.assert_close(q, q_ref)
    for i in range(b):
        torch.testing.assert_close(k_cache[i, :, positions[i]], k_ref[i])
        assert torch.equal(v_cache[i, :, positions[i]], v_ref[i])
    assert int((k_cache != 0).any(dim=-1).sum()) == b * kv_heads, "nothing else written"
