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


def test_cuda_vmm_arena_maps_read_only_in_a_fresh_process(tmp_path: Path) -> None:
    """The CUDA transport: fill a VMM arena, pass its fd to another process, read the same bytes there."""
    import json
    import os
    import subprocess
    import sys

    from cache.arena import create_arena, plan_layout, tensor_views

    dev = torch.device("cuda", torch.cuda.current_device())
    tensors = {"w": torch.randn(1000, 300, device=dev).to(torch.float8_e4m3fn), "b": torch.randn(77, device=dev)}
    entries, size = plan_layout(tensors)
    arena = create_arena(size, dev)
    arena.fill(entries, tensors)
    arena.seal()
    views = tensor_views(arena.buffer(), entries)
    assert torch.equal(views["b"], tensors["b"]) and torch.equal(
        views["w"].view(torch.uint8), tensors["w"].view(torch.uint8)
    )
    fd = arena.export_fd()
    child = f"""
import json, torch
from cache.arena import attach_arena
dev = torch.device("cuda", {dev.index})
torch.zeros(1, device=dev)
a = attach_arena("cuda-vmm", {fd}, {arena.size}, dev)
buf = a.buffer()
out = {{"sum": int(buf.to(torch.int64).sum())}}
try:
    buf[0] = 7
    torch.cuda.synchronize()
    out["write"] = "allowed"
except Exception as exc:
    out["write"] = "refused"
print(json.dumps(out))
"""
    try:
        run = subprocess.run([sys.executable, "-c", child], pass_fds=[fd], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    finally:
        os.close(fd)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["sum"] == int(arena.buffer().to(torch.int64).sum())
    assert result["write"] == "refused"


def test_cuda_attach_gives_the_disk_outputs_without_copying_weights(tmp_path: Path) -> None:
    """A cache process on the GPU; engines attach (ipc), fall back (ipc-or-disk, no cache) and load (disk)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cache.client import CacheClient, CacheUnavailable
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    sock = tmp_path / "run" / "cache.sock"
    base = {"model": path, "device": "cuda", "max_num_seqs": 2, "max_model_len": 128, "cache_socket": sock}
    prompts, params = [[5, 6, 7] * 9, [11, 12] * 4], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    disk = LLMEngine(EngineConfig(**base)).generate(prompts, params)
    fallback = LLMEngine(EngineConfig(**base, weights="ipc-or-disk"))
    assert fallback.weight_source == "disk" and fallback.generate(prompts, params) == disk
    del fallback
    cmd = [sys.executable, "-m", "app.cli", "cache", "--model", str(path), "--socket", str(sock), "--device", "cuda"]
    cache = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                CacheClient(sock).close()
                break
            except CacheUnavailable:
                assert cache.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        engine = LLMEngine(EngineConfig(**base, weights="ipc"))
        growth = torch.cuda.memory_allocated() - before
        manifest = engine.weights.attachment.manifest
        # KV cache, rotary tables and graph pools are the engine's own; a weight copy would be +100%.
        assert growth - engine.kv.spec.total_bytes < 0.25 * manifest.nbytes, (growth, manifest.nbytes)
        assert engine.generate(prompts, params) == disk
        qkv = manifest.layers["model.layers.0.self_attn.qkv_proj"]
        assert qkv["kernel"] == FP8_BLOCK_SCALED_MM and qkv["block_size"] == [128, 128] and qkv["weight_layout"] == "NK"
        w = engine.model.layers[0].qkv.merged.tensors["weight"]
        assert w.dtype == torch.float8_e4m3fn and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0
        base_ptr = engine.weights.attachment.arenas[0].buffer().data_ptr()
        assert base_ptr <= w.data_ptr() < base_ptr + manifest.nbytes, "weights must be views of the cache arena"
    finally:
        cache.send_signal(signal.SIGTERM)
        assert cache.wait(timeout=60) == 0
        assert not os.path.exists(sock)
