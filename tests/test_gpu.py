"""CUDA-only checks (run on the GPU machine): FP8 block kernels, fused ops, CUDA-graph decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cache.checkpoint.fp8 import dequantize_weight, quantize_weight
from cache.checkpoint.schemes import Activations, LinearScheme, WeightKind
from cache.checkpoint.synth import synth_checkpoint
from cache.processors.native import FP8_BLOCK_SCALED_MM, process_linear, select_kernel

pytestmark = pytest.mark.gpu
BLOCK = LinearScheme(WeightKind.FP8_BLOCK, Activations.DYNAMIC_GROUP)
# The engines of these tests share the device within one process: each gets a small KV cache, not the share of the
# device the memory plan would give it (engine/memory_plan.py), which the next test's engine would not find free.
KV_BYTES = 2 << 30


@pytest.mark.parametrize(("n", "k"), [(576, 1536), (192, 576), (1024, 2048), (4096, 4096)])
def test_block_fp8_kernel_matches_dequantized_reference_for_every_m(n: int, k: int) -> None:
    """Every row count 1-300 and a stride up to 4096: both the Triton (small M) and cuBLAS paths."""
    from engine.native.kernels import fp8_block_scaled_mm, quantize_per_token_group

    dev = torch.device("cuda")
    assert select_kernel(BLOCK, dev) == FP8_BLOCK_SCALED_MM
    gen = torch.Generator(device=dev).manual_seed(n + k)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_weight(w, WeightKind.FP8_BLOCK)
    tensors, recipe = process_linear(BLOCK, FP8_BLOCK_SCALED_MM, {"weight": q, "weight_scale": s}, torch.bfloat16, dev)
    w_deq = dequantize_weight(q, s, WeightKind.FP8_BLOCK, torch.float32)
    for m in [*range(1, 301), *range(317, 4097, 241), 4096]:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        xq, xs = quantize_per_token_group(torch.nn.functional.pad(x, (0, recipe.padded_in - k)))
        x_deq = (xq.float().view(m, -1, 128) * xs.unsqueeze(-1)).view(m, -1)[:, :k]
        ref = x_deq @ w_deq.t()
        got = fp8_block_scaled_mm(x, tensors, recipe).float()
        assert got.shape == (m, n)
        assert float((got - ref).norm() / ref.norm()) < 1e-2, m


def test_fused_group_quantization_is_torch_bit_for_bit() -> None:
    from engine.native.kernels import quantize_per_token_group
    from engine.native.triton_fp8 import quantize_groups

    x = torch.randn(301, 4096, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_groups(x, 304)
    ref_q, ref_s = quantize_per_token_group(x)
    assert s.stride() == (1, 304) and torch.equal(s[:301], ref_s)
    same = (q[:301].view(torch.uint8) == ref_q.view(torch.uint8)).float().mean()
    assert float(same) > 0.999, float(same)  # a division rounded differently may move a code by one step
    assert not bool(q[301:].float().any())


def test_fused_norm_and_rope_match_torch() -> None:
    from engine.native.fused_ops import add_rms_norm, rope
    from engine.native.model import apply_rope, rms_norm

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
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    prompts = [[5, 6, 7] * 9, [11, 12] * 4, [3] * 40]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    graphed = LLMEngine(EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, max_num_seqs=4,
                                     max_model_len=256, max_num_batched_tokens=64))  # fmt: skip
    runner = graphed.runner
    expected = {("decode", b) for b in runner.decode_sizes} | {("mixed", t) for t in runner.mixed_sizes}
    assert set(runner.graphs) == expected, "every graph is captured at start-up"
    a = graphed.generate(prompts, params)
    eager = LLMEngine(EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, max_num_seqs=4,
                                   max_model_len=256, cuda_graphs=False))  # fmt: skip
    assert a == eager.generate(prompts, params)


def test_mixed_steps_above_the_largest_graph_run_eagerly_and_equal_a_graphless_engine(tmp_path: Path) -> None:
    """Mixed steps of more than MAX_MIXED_GRAPH_TOKENS tokens have no graph: a 3,000-token prompt's step (budget
    4,096) runs eagerly beside graphed decode steps, with the same tokens as an engine without graphs."""
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.native.model_runner import MAX_MIXED_GRAPH_TOKENS
    from engine.sampling_params import SamplingParams

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    prompts = [[(7 * i) % 5000 + 3 for i in range(3000)], [11, 12] * 150, [3] * 40]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    configs = {"max_num_seqs": 4, "max_model_len": 4096, "max_num_batched_tokens": 4096}
    graphed = LLMEngine(EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, **configs))
    assert max(graphed.runner.mixed_sizes) == MAX_MIXED_GRAPH_TOKENS
    assert ("mixed", 4096) not in graphed.runner.graphs
    a = graphed.generate(prompts, params)
    eager = LLMEngine(EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, cuda_graphs=False, **configs))
    assert a == eager.generate(prompts, params)


def test_questions_over_a_shared_cached_prefix_get_the_tokens_of_attention_a_sequence_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefix caching's shared blocks walked for every row of a step at once (StepBatch.shared_prefix) give the same
    greedy tokens as the same steps walking each sequence's blocks (SHARED_MIN out of reach), graphed and eager: the
    questions' prompt rows, and their decode steps through the decode launch's shared walk (its graph for 24
    sequences replayed; SHARED_DECODE_FILL lowered so that qwen3-0.6b's 8 KV heads take it at 20 sequences)."""
    from attention_cases import record_shared_prefixes

    from engine.config import EngineConfig
    from engine.native import model_runner, triton_attention
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    monkeypatch.setattr(triton_attention, "SHARED_DECODE_FILL", 0.0)
    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    system = [(5 * i) % 3000 + 3 for i in range(700)]
    prompts = [system + [11 + i, 12, 13 + i] * (i % 6 + 1) for i in range(20)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    class Counted:  # a graph whose replays are counted
        def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
            self.graph, self.replays = graph, 0

        def replay(self) -> None:
            self.replays += 1
            self.graph.replay()

    def answers(graphs: bool) -> tuple[list[list[int]], list[int], int]:
        config = EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, max_num_seqs=24, max_model_len=1024,
                              max_num_batched_tokens=512, cuda_graphs=graphs)  # fmt: skip
        engine = LLMEngine(config)
        runner = engine.runner
        assert runner.shared_decode_sizes == [24], runner.shared_decode_sizes  # 16 sequences split their walks
        counted = None
        if graphs:
            graph, logits, argmax = runner.graphs[("shared", 24)]
            counted = Counted(graph)
            runner.graphs[("shared", 24)] = (counted, logits, argmax)  # type: ignore[assignment]
        engine.generate(prompts[:1], params)  # the prefix, cached
        told = record_shared_prefixes(engine)
        out = engine.generate(prompts, params)
        del engine, runner
        torch.cuda.empty_cache()
        return out, [shared for _, _, shared in told], counted.replays if counted else -1

    for graphs in (True, False):
        with monkeypatch.context() as patch:
            shared, told, replays = answers(graphs)
            assert told[0] == 688  # 43 whole blocks of the 700-token prefix
            assert told[-1] == 688  # and the last decode step's too
            assert replays == -1 or replays >= 10, replays  # the decode steps of all 20, through the shared walk
            patch.setattr(model_runner, "SHARED_MIN", 1 << 30)
            each, told, replays = answers(graphs)
            assert not any(told) and replays in (-1, 0)
        assert shared == each


def test_overlapped_cuda_steps_feed_each_sequence_its_own_last_token(tmp_path: Path) -> None:
    """tests/overlap_check.py on CUDA, graphed and eager (qwen3-0.6b shapes, 2 layers, FP8 block)."""
    from overlap_check import check_overlapped_steps

    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    for graphs in (True, False):
        engine = LLMEngine(EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, max_num_seqs=8,
                                        max_model_len=512, max_num_batched_tokens=256, cuda_graphs=graphs))  # fmt: skip
        check_overlapped_steps(engine)
        del engine
        torch.cuda.empty_cache()


def test_a_kv_commit_leaves_the_headroom_free_and_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit that would leave less than its headroom free waits (here: the whole device as headroom, so it never
    comes) and says so, holding no more than before; with the headroom the device has, it commits. The first
    stripe, made with the reservation (an engine's start, as its graphs), is committed either way."""
    import engine.native.kv_memory as kv_memory
    from engine.native.kv_memory import KVGeometry, KVMemory

    for name in ("FIRST_BYTES", "STRIPE_BYTES", "MAX_STRIPE_BYTES"):  # 64 blocks of 2 x 2 x 32 KiB: 8 MiB a stripe
        monkeypatch.setattr(kv_memory, name, 8 << 20)
    geometry = KVGeometry(layers=2, blocks=192, block_bytes=32 << 10)
    total = torch.cuda.mem_get_info()[1]
    starved = KVMemory(geometry, torch.device("cuda"), reserve=True, multiple=64, headroom=total)
    assert starved.committed_blocks == 64 and starved.commit_first(timeout=0.3) < 0.1  # nothing left to map
    held = starved.device_bytes
    with pytest.raises(RuntimeError, match="kept free besides"):
        starved.commit_next(timeout=0.3)
    assert starved.device_bytes == held and starved.committed_blocks == 64
    roomy = KVMemory(geometry, torch.device("cuda"), reserve=True, multiple=64, headroom=1 << 30)
    assert roomy.commit_next(timeout=5) == (64, 128) and roomy.committed_blocks == 128


def test_a_reserved_kv_cache_holds_no_memory_until_committed_and_its_graphs_replay_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A standby's KV cache (engine/native/kv_memory.py): reserved addresses with a placeholder under them while
    the engine captures its graphs and warms up; activated, its first stripe is committed and the others follow
    while it serves (small stripes here, so that the requests need them). Once committed, its greedy answers are an
    ordinary engine's, token for token, on the same schedule (its graphs replay on the committed memory). While the
    stripes land, its sequences share steps as the stripes allow, and the GPU GEMMs' rounding depends on a step's
    rows (and differs between the decode graphs' Triton kernel and the prefill's cuBLAS): tokens there are checked
    against the ordinary engine's 20 likeliest in the same context. On the H200, 431 of 432 served tokens were
    among its 3 likeliest, 248 of 288 its likeliest; KV memory read before its commit, or lost, would put tokens
    anywhere in the vocabulary."""
    import asyncio

    from processes import serve_activated, wait_for

    import engine.native.kv_memory as kv_memory
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    # No prefix caching: the committed engine's second run must schedule its steps as the ordinary engine's one.
    settings = {"model": path, "device": "cuda", "kv_cache_bytes": KV_BYTES, "max_num_seqs": 8, "max_model_len": 512,
                "enable_prefix_caching": False}  # fmt: skip
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(n)] for i, n in enumerate((1, 17, 100, 300, 250, 260))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ordinary = LLMEngine(EngineConfig(**settings))
    expected = ordinary.generate(prompts, params)
    # 64 blocks (the fewest whose bytes fill 2 MiB mappings) of 2 layers x keys and values x 32 KiB: 8 MiB a stripe.
    monkeypatch.setattr(kv_memory, "STRIPE_BYTES", 8 << 20)
    monkeypatch.setattr(kv_memory, "FIRST_BYTES", 8 << 20)
    monkeypatch.setattr(kv_memory, "MAX_STRIPE_BYTES", 8 << 20)
    free_before = torch.cuda.mem_get_info()[0]
    engine = LLMEngine(EngineConfig(**settings, reserve_kv=True))
    memory = engine.kv.memory
    assert not memory.committed and len(memory.stripes) > 100 and memory.nbytes > KV_BYTES // 2
    held = free_before - torch.cuda.mem_get_info()[0]  # weights, graphs, activations, the placeholder
    assert held < memory.nbytes // 2, (held, memory.nbytes)

    try:
        served = serve_activated(engine, prompts, params, activate_timeout=10.0)
        wait_for(lambda: memory.committed and engine.kv_blocks_free == engine.kv_blocks_total, 60,
                 "every stripe committed and handed to the scheduler, every block free")  # fmt: skip
    finally:
        engine.stop()
    assert memory.committed and memory.device_bytes == memory.nbytes
    assert free_before - torch.cuda.mem_get_info()[0] >= held + memory.nbytes - (32 << 20)
    assert [len(tokens) for tokens in served] == [24] * len(prompts)
    assert engine.generate(prompts, params) == expected  # committed: the same schedule gives the same tokens

    async def likeliest() -> list[list[tuple[int, ...]]]:
        """The ordinary engine's 20 likeliest tokens at each position of every served answer, in its context."""
        ordinary.start()
        scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=20)
        streams = [ordinary.submit(p + tokens, scoring) for p, tokens in zip(prompts, served, strict=True)]
        tops = []
        for p, stream in zip(prompts, streams, strict=True):
            events = [e async for e in stream]
            assert events[0].prompt_logprobs is not None
            tops.append([tuple(i for i, _ in lp.top) for lp in events[0].prompt_logprobs[len(p) :] if lp is not None])
        return tops

    try:
        tops = asyncio.run(likeliest())
    finally:
        ordinary.stop()
    pairs = [(t, top) for tokens, row in zip(served, tops, strict=True) for t, top in zip(tokens, row, strict=True)]
    assert all(token in top for token, top in pairs), [(t, top) for t, top in pairs if t not in top]


def test_fused_silu_mul_and_strided_rope() -> None:
    from engine.native.fused_ops import rope, silu_mul
    from engine.native.model import apply_rope

    dev = torch.device("cuda")
    gate_up = torch.randn(3, 2 * 1536, device=dev, dtype=torch.bfloat16)
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]  # views into one merged projection, as the model passes
    torch.testing.assert_close(silu_mul(gate, up), torch.nn.functional.silu(gate) * up)

    qkv = torch.randn(4, 9 * 64 + 2 * 3 * 64, device=dev, dtype=torch.bfloat16)
    q = qkv[:, : 9 * 64].view(4, 9, 64)
    angles = torch.rand(4, 32, device=dev) * 6
    torch.testing.assert_close(rope(q, angles.cos(), angles.sin()), apply_rope(q, angles.cos(), angles.sin()))


def test_norm_and_activation_quantized_for_the_gemm_equal_quantize_groups_bit_for_bit() -> None:
    """What the steps run (engine/native/fused_ops.py, quantize_rows) against quantize_groups of the same
    kernels' unquantized output: the same fp8 codes and scales, so the GEMM's output is the same as without fusion."""
    from quantize_cases import check_quantized_for_gemm

    check_quantized_for_gemm(torch.device("cuda"), [(1, 1, 4096, 14336), (7, 7, 4096, 14336), (64, 64, 4096, 14336),
                                                    (1001, 1004, 4096, 14336)], None)  # fmt: skip


@pytest.mark.parametrize(("n", "k"), [(4096, 14336), (1024, 2048), (640, 1536)])
def test_block_fp8_layer_gives_the_same_output_from_activations_the_activation_kernel_quantized(n: int, k: int) -> None:
    """engine/native/kernels.py's quantized_rows at every size the model asks: the Triton GEMM's rows as they are up
    to 32, above that padded to a multiple of 4 for cuBLAS and DeepGEMM (1,001 -> 1,004), and for weights whose
    scale blocks cuBLAS refuses (640 columns: 5 blocks) the Triton GEMM's at any size; SiLU-and-multiply quantizing
    for the layer gives the layer's output bit for bit as from its unquantized output."""
    from engine.native.fused_ops import silu_mul
    from engine.native.kernels import fp8_block_scaled_mm, quantized_rows

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + k)
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_weight(w, WeightKind.FP8_BLOCK)
    tensors, recipe = process_linear(BLOCK, FP8_BLOCK_SCALED_MM, {"weight": q, "weight_scale": s}, torch.bfloat16, dev)
    for m in (1, 64, 65, 301, 1001, 2048):
        rows = quantized_rows(recipe, m)
        assert rows == (m + -m % 4 if m > 32 and n % 512 == 0 else m)
        gate_up = torch.randn(m, 2 * k, device=dev, generator=gen).to(torch.bfloat16) * 3
        gate, up = gate_up[:, :k], gate_up[:, k:]
        got = fp8_block_scaled_mm(silu_mul(gate, up, quantize_rows=rows), tensors, recipe)  # type: ignore[arg-type]
        want = fp8_block_scaled_mm(silu_mul(gate, up), tensors, recipe)  # type: ignore[arg-type]
        assert got.shape == want.shape == (m, n) and torch.equal(got, want), m


@pytest.mark.parametrize("kind", [WeightKind.FP8_CHANNEL, WeightKind.FP8_TENSOR])
def test_rowwise_fp8_kernel_matches_dequantized_reference_for_every_m(kind: WeightKind) -> None:
    from cache.processors.native import FP8_ROWWISE_SCALED_MM
    from engine.native.kernels import fp8_rowwise_scaled_mm, quantize_per_token

    dev = torch.device("cuda")
    scheme = LinearScheme(kind, Activations.DYNAMIC_TOKEN)
    assert select_kernel(scheme, dev) == FP8_ROWWISE_SCALED_MM
    gen = torch.Generator(device=dev).manual_seed(7)
    n, k = 1536, 576
    w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
    q, s = quantize_weight(w, kind)
    tensors, recipe = process_linear(scheme, FP8_ROWWISE_SCALED_MM, {"weight": q, "weight_scale": s},
                                     torch.bfloat16, dev)  # fmt: skip
    w_deq = dequantize_weight(q, s, kind, torch.float32)
    for m in [*range(1, 301), *range(317, 4097, 241), 4096]:
        x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
        xq, xs = quantize_per_token(x)
        ref = (xq.float() * xs) @ w_deq.t()
        got = fp8_rowwise_scaled_mm(x, tensors, recipe).float()
        assert got.shape == (m, n)
        assert float((got - ref).norm() / ref.norm()) < 1e-2, m


def test_deep_gemm_gives_cublas_blockwise_bits_and_only_its_prepared_sizes() -> None:
    """Where DeepGEMM is installed (engine/native/deep_gemm.py), its kernel gives cuBLAS' blockwise GEMM's output
    bit for bit, at the rows an engine's steps pad to 4 and at others (compiled on the call). Only graphs being
    captured take it, at the sizes built (the engine calls cuBLAS elsewhere rather than compile on a step's path)."""
    from torch.nn.functional import ScalingType, scaled_mm

    from engine.native.deep_gemm import DeepGemm
    from engine.native.triton_fp8 import quantize_groups

    dev = torch.device("cuda")
    deep = DeepGemm.load(dev)
    if deep is None:
        pytest.skip("DeepGEMM is not installed here (or no nvcc): the engine uses cuBLAS alone")
    gen = torch.Generator(device=dev).manual_seed(3)
    weights = []
    for n, k in [(4096, 4096), (6144, 4096), (4096, 14336), (1536, 1024)]:
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        weights.append(quantize_weight(w, WeightKind.FP8_BLOCK))
    rows = [68, 96, 132, 256, 1024]
    assert deep.prepare(weights, rows) >= len(weights)
    assert not deep.ready(1024, *weights[0][0].shape), "eager calls take cuBLAS"
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert not deep.ready(1024, 2048, 1024), "a weight shape never prepared"
        assert all(deep.ready(m, *q.shape) for q, _ in weights for m in rows)
    for q, s in weights:
        for m in [*rows, 1000]:
            x = torch.randn(m - 3, q.shape[1], device=dev, generator=gen).to(torch.bfloat16)
            xq, xs = quantize_groups(x, m)  # the last 3 rows zeros, as the engine pads rows to 4
            want = scaled_mm(xq, q.t(), xs, ScalingType.BlockWise1x128, s.t(), ScalingType.BlockWise128x128,
                             output_dtype=torch.bfloat16)  # fmt: skip
            assert torch.equal(deep.gemm(xq, xs, q, s), want), (q.shape, m)


@pytest.mark.parametrize(("n", "k", "split_k"), [(4096, 4096, 8), (6144, 4096, 4), (4096, 14336, 8), (1024, 2048, 2)])
def test_split_k_sum_is_exact_and_repeatable(n: int, k: int, split_k: int) -> None:
    """_sum_planes adds the split planes: same result as one program over all of K (up to fp32 summation order),
    identical across calls."""
    from engine.native.triton_fp8 import fp8_block_gemm

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
    with pytest.raises(ValueError, match="does not divide"):
        fp8_block_gemm(x, q, s, split_k=k // 128 + 1)


def test_fused_rope_kv_write_matches_separate_ops() -> None:
    from engine.native.fused_ops import rope_kv_write
    from engine.native.model import apply_rope

    dev = torch.device("cuda")
    heads, kv_heads, dim, t = 8, 2, 128, 70
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, device=dev, dtype=torch.bfloat16)
    angles = torch.rand(t, dim // 2, device=dev) * 6
    cos, sin = angles.cos(), angles.sin()
    k_cache = torch.zeros(4 * 64, kv_heads, dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(4 * 64, device=dev)[:t]
    q = rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads)
    q_ref = apply_rope(qkv[:, : heads * dim].view(t, heads, dim), cos, sin)
    k_ref = apply_rope(qkv[:, heads * dim : (heads + kv_heads) * dim].view(t, kv_heads, dim), cos, sin)
    v_ref = qkv[:, (heads + kv_heads) * dim :].view(t, kv_heads, dim)
    torch.testing.assert_close(q, q_ref)
    torch.testing.assert_close(k_cache[slots], k_ref)
    assert torch.equal(v_cache[slots], v_ref)
    assert int((k_cache != 0).any(dim=-1).sum()) == t * kv_heads, "nothing else written"


def test_decode_attention_rotates_its_queries_and_writes_its_token() -> None:
    from attention_cases import check_decode_attention_rotates_and_writes_its_token

    check_decode_attention_rotates_and_writes_its_token(torch.device("cuda"), torch.bfloat16)
    check_decode_attention_rotates_and_writes_its_token(torch.device("cuda"), torch.bfloat16, torch.float8_e4m3fn)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (9, 3, 64), (16, 8, 128), (8, 4, 256)])
def test_paged_attention_kernel_matches_reference(heads: int, kv_heads: int, dim: int) -> None:
    """Decode rows, fresh prompts and later chunks of long prompts in one launch, in bf16."""
    from attention_cases import check_paged_attention

    check_paged_attention(torch.device("cuda"), torch.bfloat16, heads, kv_heads, dim, tolerance=2e-2)


def test_paged_attention_kernel_reads_an_fp8_cache_as_the_reference_does() -> None:
    """kv_cache_dtype = "fp8": the compiled kernel converts float8 e4m3 keys and values to bf16 as it reads them."""
    from attention_cases import check_paged_attention

    fp8 = torch.float8_e4m3fn
    check_paged_attention(torch.device("cuda"), torch.bfloat16, 32, 8, 128, tolerance=2e-2, kv_dtype=fp8)


def test_split_decode_hands_o_proj_its_input_quantized_as_quantize_groups_does() -> None:
    """The merge of a split decode step quantizes its output for o_proj bit for bit as quantize_groups would."""
    from attention_cases import check_split_decode_quantized_for_the_gemm

    check_split_decode_quantized_for_the_gemm(torch.device("cuda"), torch.bfloat16)


def _reference_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """Every position's logits from a plain-torch fp32 forward over dequantized weights (full causal SDPA),
    with each FP8 layer's input rounded as the W8A8 kernels round it (e4m3 per token and group of 128)."""
    from cache.checkpoint.reader import read_checkpoint
    from engine.native.kernels import quantize_per_token_group

    def linear(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_per_token_group(h)
        return (xq.float().view(h.shape[0], -1, 128) * xs.unsqueeze(-1)).view_as(h) @ weight.t()

    from engine.native.model import ModelArgs, apply_rope, rms_norm, rope_inv_freq

    ckpt = read_checkpoint(path)
    sd = ckpt.dequantized_state_dict(torch.float32)
    dev = torch.device("cuda")
    w = {k: v.to(dev) for k, v in sd.items()}
    args = ModelArgs.from_config(ckpt.config)
    s, eps = args.shape, args.rms_norm_eps
    ids = torch.tensor(tokens, device=dev)
    n = ids.shape[0]
    freqs = torch.outer(torch.arange(n, device=dev, dtype=torch.float32), rope_inv_freq(args).to(dev))
    cos, sin = freqs.cos(), freqs.sin()
    x = w["model.embed_tokens.weight"][ids]
    for i in range(s.layers):
        p = f"model.layers.{i}"
        h = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        q = linear(h, w[f"{p}.self_attn.q_proj.weight"]).view(n, s.heads, s.head_dim)
        k = linear(h, w[f"{p}.self_attn.k_proj.weight"]).view(n, s.kv_heads, s.head_dim)
        v = linear(h, w[f"{p}.self_attn.v_proj.weight"]).view(n, s.kv_heads, s.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1).reshape(n, -1)  # fmt: skip
        x = x + linear(attn, w[f"{p}.self_attn.o_proj.weight"])
        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate, up = linear(h, w[f"{p}.mlp.gate_proj.weight"]), linear(h, w[f"{p}.mlp.up_proj.weight"])
        x = x + linear(torch.nn.functional.silu(gate) * up, w[f"{p}.mlp.down_proj.weight"])
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return rms_norm(x, w["model.norm.weight"], eps) @ head.t()


def _engine_last_logits(engine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's last-position logits, scheduled together through the serving path (chunks, graphs)."""
    from engine.native.scheduler import Sequence
    from engine.sampling_params import SamplingParams

    seqs = [Sequence(f"p{i}", p, SamplingParams(max_tokens=1), lambda event: None) for i, p in enumerate(prompts)]
    for seq in seqs:
        engine.scheduler.add(seq)
    found: dict[str, torch.Tensor] = {}
    while len(found) < len(seqs):
        step = engine.scheduler.schedule()
        out = engine.runner.run(step)
        for row, work in enumerate(step):
            work.seq.computed = work.start + work.count
            if work.samples:
                found[work.seq.request_id] = out.logits[row].clone()
                engine.scheduler.finish(work.seq)
    return [found[s.request_id] for s in seqs]


TOLERANCE = 0.25


def test_every_prompt_length_through_the_engine_matches_the_dequantized_reference(tmp_path: Path) -> None:
    """llama3-8b shapes (cuBLAS above 64 rows), 2 layers: lengths 1-300, then a stride to 4096, alone
    and as one batch of mixed lengths; prompts longer than the step budget arrive in chunks."""
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine

    path = synth_checkpoint(tmp_path / "l", "llama3-8b", "fp8-block", num_layers=2, device="cuda", progress=False)
    engine = LLMEngine(EngineConfig(model=path, device="cuda", kv_cache_bytes=KV_BYTES, max_num_seqs=32,
                                    max_model_len=4200, max_num_batched_tokens=1024))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128000, (4096,), generator=gen).tolist()
    ref = _reference_logits(path, tokens)
    lengths = [*range(1, 301), *range(337, 4097, 239), 4096]
    errors = {}
    for length in lengths:
        (got,) = _engine_last_logits(engine, [tokens[:length]])
        assert bool(torch.isfinite(got).all()), length
        errors[length] = float((got - ref[length - 1]).norm() / ref[length - 1].norm())
    # This random-weight model amplifies rounding: on the CPU, the same reference in bf16 instead of fp32
    # differs by 11-12% (relative L2 of the logits), while attention that loses the prompt's earlier
    # chunks differs by 130-140%. A bound of 25% passes the first and fails the second.
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < TOLERANCE, (worst, errors[worst], sorted(errors.values())[len(errors) // 2])
    mixed = [7, 64, 65, 157, 158, 159, 160, 161, 300, 1, 999, 2500, 33, 129, 4000, 12]
    for length, got in zip(mixed, _engine_last_logits(engine, [tokens[:n] for n in mixed]), strict=True):
        error = float((got - ref[length - 1]).norm() / ref[length - 1].norm())
        assert error < TOLERANCE, (length, error)


def test_a_worker_forked_after_the_fork_servers_preload_uses_cuda() -> None:
    """The fork server's preload leaves its forks able to use CUDA, with DeepGEMM installed or not. When the preload
    imported DeepGEMM, torch's cpp_extension asked CUDA for its devices, and every engine forked after it failed at
    its first CUDA call ("Cannot re-initialize CUDA in forked subprocess"); the first gateway start on an H100 showed
    it. In a fresh process: this one holds a CUDA context."""
    import subprocess
    import sys

    child = """
import os, torch
from engine.fork_server import preload
preload()
pid = os.fork()
if pid == 0:
    try:
        os._exit(0 if float(torch.ones(4, device="cuda").sum()) == 4.0 else 3)
    except BaseException:
        os._exit(4)
print("worker exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    run = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "0", run.stdout[-500:]


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
except Exception as exc:  # what refused it, for the check below: the device, not a Python slip
    out["write"] = f"refused: {{type(exc).__name__}}: {{exc}}"
print(json.dumps(out))
"""
    try:
        run = subprocess.run([sys.executable, "-c", child], pass_fds=[fd], capture_output=True, text=True, timeout=120,
                             cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    finally:
        os.close(fd)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["sum"] == int(arena.buffer().to(torch.int64).sum())
    # Refused by the device (a CUDA error from the read-only mapping), not by some Python error on the way.
    assert result["write"].startswith("refused: ") and "CUDA" in result["write"], result["write"]


def test_cuda_attach_gives_the_disk_outputs_without_copying_weights(tmp_path: Path) -> None:
    """A cache process on the GPU; engines attach (ipc), fall back (ipc-or-disk, no cache) and load (disk)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cache.client import CacheClient, CacheUnavailable
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    path = synth_checkpoint(tmp_path / "q", "qwen3-0.6b", "fp8-block", num_layers=2, device="cuda", progress=False)
    sock = tmp_path / "run" / "cache.sock"
    base = {
        "model": path,
        "device": "cuda",
        "kv_cache_bytes": KV_BYTES,
        "max_num_seqs": 2,
        "max_model_len": 128,
        "cache_socket": sock,
    }
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
        before = _allocated_outside_graph_pools()
        engine = LLMEngine(EngineConfig(**base, weights="ipc"))
        growth = _allocated_outside_graph_pools() - before
        manifest = engine.weights.attachment.manifest
        # KV cache and rotary tables are the engine's own (graph pools are counted apart); a weight copy
        # would be +100%.
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


def _allocated_outside_graph_pools() -> int:
    """Bytes allocated on the device, less what CUDA graphs' private memory pools hold (their intermediates)."""
    segments = torch.cuda.memory._snapshot()["segments"]
    return sum(seg["allocated_size"] for seg in segments if tuple(seg.get("segment_pool_id", (0, 0))) == (0, 0))


def test_fused_top_logprobs_match_torch() -> None:
    """engine/native/triton_logprobs.py compiled for the device: the top k log-probabilities and their ids of
    llama3's vocabulary at batch 64 are torch's (log_softmax, topk), masked rows included. Its speed against
    torch is bench/topk_check.py's."""
    from engine.native.triton_logprobs import MAX_K, top_logprobs

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 128256, device="cuda", generator=gen) * 4
    x[1, :] = -float("inf")
    x[1, [5, 70000, 128255]] = torch.tensor([1.0, 3.0, 2.0], device="cuda")
    for k in (1, 5, MAX_K):
        out = top_logprobs(x, k, -9999.0)
        values, ids = torch.log_softmax(x, -1).clamp_min(-9999.0).topk(k, -1)
        torch.testing.assert_close(out[:, :k], values, rtol=0, atol=1e-4)
        rows = [r for r in range(64) if r != 1]
        assert torch.equal(out[rows, k:].long(), ids[rows])
        assert out[1, k:].long().tolist()[:3] == [70000, 128255, 5][:k]
    # The sampler takes it for greedy rows on CUDA: the same tokens and logprobs as its torch path on the CPU.
    from engine.native.sampler import draw
    from engine.sampling_params import LOGPROB_FLOOR, SamplingParams

    params = [SamplingParams(temperature=0, logprobs=k) for k in [5] * 32 + [0] * 16 + [20] * 16]
    on_cuda = draw(x, params, [[]] * 64, [None] * 64).read()
    on_cpu = draw(x.cpu(), params, [[]] * 64, [None] * 64).read()
    assert on_cuda.tokens == on_cpu.tokens
    for got, want in zip(on_cuda.logprobs, on_cpu.logprobs, strict=True):
        assert got is not None and want is not None
        assert abs(got.logprob - want.logprob) < 1e-4
        assert [t for t, v in got.top if v > LOGPROB_FLOOR] == [t for t, v in want.top if v > LOGPROB_FLOOR]


def test_split_argmax_is_torchs() -> None:
    """engine/native/triton_logprobs.py's argmax (the CUDA graphs' and the sampler's) compiled for the device: torch's
    first index of each row's max, at 1 and 64 rows of llama3's vocabulary, with ties inside a part and across
    parts, a row all -inf, and the max in the short last part."""
    from engine.native.triton_logprobs import argmax

    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in (1, 64):
        x = torch.randn(rows, 128256, device="cuda", generator=gen) * 4
        x[0, 100000] = 99.0
        if rows > 1:
            x[1, :] = -float("inf")
            x[2, [7, 9000, 128255]] = 50.0
            x[3, [8200, 8201]] = 60.0
            x[4, 128255] = 70.0
        assert torch.equal(argmax(x), x.argmax(dim=-1))
