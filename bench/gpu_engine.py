"""GPU check and benchmark of the native engine (run on the H200 through the device tool).

1. Block-FP8 kernels against a dequantized float reference (relative error), incl. partial blocks.
2. Per-GEMM timings at decode and prefill sizes: Triton small-M kernel, cuBLAS blockwise
   scaled_mm, bf16 F.linear.
3. Synthetic llama3-8b fp8-block through the engine: start-up phases, decode tokens/s at
   batch 1/16/64, prefill tokens/s, next to the HBM floor for batch-1 decode.
4. Hugging Face transformers' generate with the bf16 version of that shape on the same GPU.

    python bench/gpu_engine.py --out $OUT    # writes gpu_engine.json and gpu_engine.md
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_timing import decode_step_seconds
from cache.checkpoint.fp8 import dequantize_weight, quantize_weight
from cache.checkpoint.schemes import Activations, LinearScheme, WeightKind
from cache.processors.native import FP8_BLOCK_SCALED_MM, process_linear

HBM_BYTES_PER_S = 4.8e12
BLOCK = LinearScheme(WeightKind.FP8_BLOCK, Activations.DYNAMIC_GROUP)
RESULTS: dict[str, Any] = {}


def save(out: Path) -> None:
    (out / "gpu_engine.json").write_text(json.dumps(RESULTS, indent=2) + "\n")


def timed(fn, iters: int = 50) -> float:
    """Mean seconds per call, CUDA-event timed after warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def kernel_checks() -> None:
    from torch.nn.functional import ScalingType, scaled_mm

    from engine.native.kernels import fp8_block_scaled_mm, quantize_per_token_group
    from engine.native.triton_fp8 import fp8_block_gemm

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for n, k in [(576, 1536), (1536, 576), (4096, 4096), (14336, 4096), (4096, 14336)]:
        w = (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)
        q, s = quantize_weight(w, WeightKind.FP8_BLOCK)
        tensors, recipe = process_linear(BLOCK, FP8_BLOCK_SCALED_MM, {"weight": q, "weight_scale": s},
                                         torch.bfloat16, dev)  # fmt: skip
        w_deq = dequantize_weight(q, s, WeightKind.FP8_BLOCK, torch.float32)
        for m in (1, 16, 64, 256, 2048):
            row: dict[str, Any] = {"M": m, "N": n, "K": k}
            try:
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                # The W8A8 reference: activations and weights both dequantized from their FP8 form.
                xp = torch.nn.functional.pad(x, (0, recipe.padded_in - k))
                xq, xs = quantize_per_token_group(xp)
                x_deq = (xq.float().view(m, -1, 128) * xs.unsqueeze(-1)).view(m, -1)[:, :k]
                ref = x_deq @ w_deq.t()
                got = fp8_block_scaled_mm(x, tensors, recipe).float()
                row["rel_err_vs_dequantized"] = float((got - ref).norm() / ref.norm())
                full = x.float() @ w.float().t()
                row["rel_err_vs_bf16_weights"] = float((got - full).norm() / full.norm())
                row["ms_engine"] = timed(lambda: fp8_block_scaled_mm(x, tensors, recipe)) * 1e3
                row["ms_triton"] = timed(lambda: fp8_block_gemm(xp, tensors["weight"], tensors["weight_scale"])) * 1e3
                if n % 512 == 0 and k % 512 == 0:
                    row["ms_cublas_scaled_mm"] = timed(lambda: scaled_mm(
                        xq, tensors["weight"].t(), xs, ScalingType.BlockWise1x128, tensors["weight_scale"].t(),
                        ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)) * 1e3  # fmt: skip
                row["ms_bf16"] = timed(lambda: torch.nn.functional.linear(x, w)) * 1e3
                row["fp8_weight_GBps_engine"] = n * k / (row["ms_engine"] / 1e3) / 1e9
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(row, flush=True)
    RESULTS["kernels"] = rows


def triton_sweep() -> None:
    """Kernel-only times (CUDA-graph replay) of the Triton kernel's launch choices at decode sizes."""
    from triton.testing import do_bench_cudagraph

    from engine.native.triton_fp8 import fp8_block_gemm

    dev = torch.device("cuda")
    rows = []
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        w = torch.randint(-100, 100, (n, k), dtype=torch.int8, device=dev).view(torch.float8_e4m3fn)
        s = torch.rand(n // 128, k // 128, device=dev) + 0.5
        for m in (1, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            for block_n in (64, 128):
                for split in (None, 2, 4, 8):
                    for warps, stages in ((4, 4), (4, 6), (8, 4), (2, 4)):
                        kw = dict(block_n=block_n, split_k=split, num_warps=warps, num_stages=stages)
                        try:
                            ms = do_bench_cudagraph(lambda kw=kw: fp8_block_gemm(x, w, s, **kw))
                            rows.append({"M": m, "N": n, "K": k, **kw, "split_k": split or "auto",
                                         "us": ms * 1e3, "GBps": n * k / (ms / 1e3) / 1e9})  # fmt: skip
                        except Exception as exc:
                            rows.append({"M": m, "N": n, "K": k, **kw, "error": str(exc)[:200]})
    best = {}
    for r in rows:
        key = (r["M"], r["N"], r["K"])
        if "us" in r and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
        if (
            r.get("split_k") == "auto"
            and r.get("num_warps") == 4
            and r.get("num_stages") == 4
            and r.get("block_n") == (128 if r["M"] <= 16 else 64)
        ):
            print("current", key, round(r.get("us", -1), 1), flush=True)
    for key, r in best.items():
        print(
            "best",
            key,
            {k: r[k] for k in ("block_n", "split_k", "num_warps", "num_stages")},
            round(r["us"], 1),
            round(r["GBps"]),
            flush=True,
        )
    RESULTS["triton_sweep"] = rows


def profile_decode(ckpt: Path) -> None:
    """Where a decode step's GPU time goes (eager, so kernels are visible), at batch 1 and 64: the engine's own
    step, as bench/gpu_step_profile.py profiles it (sequences admitted and prefilled, then one decode step of all of
    them under the profiler; the step's argmax and sampling included)."""
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_step_profile import clear, fill
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=ckpt, device="cuda", max_num_seqs=64, max_model_len=1024,
                                    cuda_graphs=False))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    out = {}
    for b in (1, 64):
        fill(engine, b, gen, length=200)  # every sequence decoding, at about position 200
        with torch.inference_mode():
            for _ in range(3):
                engine._step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine._step()
                torch.cuda.synchronize()
        clear(engine)
        events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        out[str(b)] = {"gpu_us_total": total, "kernels": len(events),
                       "top": [(e.key[:80], e.count, round(e.device_time_total)) for e in events[:15]]}  # fmt: skip
        print(b, out[str(b)], flush=True)
    RESULTS["decode_profile"] = out
    del engine
    torch.cuda.empty_cache()


def host_profile(ckpt: Path) -> None:
    """Host-side cost of graphed batch-1 decode steps: CPU ops by self time over 32 steps."""
    from torch.profiler import ProfilerActivity, profile

    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.native.scheduler import Sequence
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=ckpt, device="cuda", max_num_seqs=1, max_model_len=1024))
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    engine.generate([[5] * 100], params)
    engine.scheduler.add(Sequence("p", [5] * 100, params, lambda event: None))
    for _ in range(4):
        engine._step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(32):
            engine._step()
        wall = (time.perf_counter() - t) / 32
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    top = [(e.key[:60], e.count // 32, round(e.self_cpu_time_total / 32, 1)) for e in events[:20]]
    RESULTS["host_profile"] = {"step_ms_under_profiler": wall * 1e3, "top_self_cpu_us_per_step": top}
    print(RESULTS["host_profile"], flush=True)
    del engine
    torch.cuda.empty_cache()


def engine_variants(ckpt: Path, new_tokens: int) -> None:
    """Decode with cuBLAS' blockwise scaled_mm for every M > 1, instead of the Triton kernel up to SMALL_M rows."""
    import engine.native.kernels as kernels

    small_m = kernels.SMALL_M
    kernels.SMALL_M = 1
    saved = dict(RESULTS)
    try:
        engine_bench(ckpt, [1, 16, 64], new_tokens)
    finally:
        kernels.SMALL_M = small_m
    RESULTS["engine_decode_cublas_small_m"] = RESULTS["engine_decode"]
    for key in ("engine_decode", "engine_prefill", "engine_startup", "hbm_floor"):
        if key in saved:
            RESULTS[key] = saved[key]


def engine_bench(ckpt: Path, batches: list[int], new_tokens: int) -> None:
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=ckpt, device="cuda", max_num_seqs=max(batches), max_model_len=2048, max_num_batched_tokens=8192
        )
    )
    RESULTS["engine_startup"] = {**engine.startup_phases, "total": time.perf_counter() - t0}
    weight_bytes = sum(t.numel() * t.element_size() for name, t in engine_tensors(engine).items() if name != "embed")
    floor_s = weight_bytes / HBM_BYTES_PER_S
    RESULTS["hbm_floor"] = {"weight_bytes_read_per_step": weight_bytes, "seconds_per_token": floor_s,
                            "tokens_per_s": 1 / floor_s}  # fmt: skip
    print(RESULTS["engine_startup"], RESULTS["hbm_floor"], flush=True)
    gen = torch.Generator().manual_seed(0)
    decode = []
    for b in batches:
        prompts = [torch.randint(100, 30000, (128,), generator=gen).tolist() for _ in range(b)]
        many = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        engine.generate(prompts, many)  # capture this batch's graphs
        steps = [decode_step_seconds(engine, prompts, many) for _ in range(3)]
        step = min(steps)  # the first run after a pause meets a GPU still ramping its clocks
        row = {"batch": b, "decode_step_ms": step * 1e3, "decode_tokens_per_s": b / step,
               "x_hbm_floor": step / floor_s, "runs_ms": [round(x * 1e3, 3) for x in steps],
               "graph_replay_ms": graph_replay_ms(engine, b)}  # fmt: skip
        decode.append(row)
        print(row, flush=True)
    RESULTS["engine_decode"] = decode
    prompts = [torch.randint(100, 30000, (1024,), generator=gen).tolist() for _ in range(8)]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.generate(prompts, one)
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, one)
        torch.cuda.synchronize()
        runs.append(8 * 1024 / (time.perf_counter() - t))
    RESULTS["engine_prefill"] = {"prompts": 8, "prompt_tokens": 1024, "tokens_per_s": max(runs),
                                 "runs_tokens_per_s": [round(r) for r in runs]}  # fmt: skip
    print(RESULTS["engine_prefill"], flush=True)
    del engine
    torch.cuda.empty_cache()


def graph_replay_ms(engine, batch: int) -> float | None:
    """GPU time of the captured decode graph alone (back-to-back replays): the step minus host work."""
    runner = engine.runner
    size = next((b for b in runner.decode_sizes if b >= batch), None)
    if not runner.use_graphs or size is None:
        return None
    graph = runner.graphs[("decode", size)][0]
    return timed(graph.replay, iters=50) * 1e3


def engine_tensors(engine) -> dict[str, torch.Tensor]:
    model = engine.model
    out = {"embed": model.embed, "norm": model.norm}
    if not model.args.shape.tied_embeddings:
        out.update({f"lm_head.{k}": v for k, v in model.lm_head.tensors.items()})
    for i, layer in enumerate(model.layers):
        linears = [layer.o, layer.down]
        for proj in (layer.qkv, layer.gate_up):
            linears += [proj.merged] if proj.merged is not None else proj.separate
        for j, linear in enumerate(linears):
            out.update({f"{i}.{j}.{k}": v for k, v in linear.tensors.items()})
    return out


def cuda_graph_consistency(ckpt: Path) -> None:
    """Greedy tokens with CUDA graphs equal eager decode on the same engine weights."""
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    prompts = [[1, 2, 3, 4, 5] * 6, [7, 8, 9] * 3]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    graphed = LLMEngine(EngineConfig(model=ckpt, device="cuda", max_num_seqs=4, max_model_len=256))
    a = graphed.generate(prompts, params)
    del graphed
    eager = LLMEngine(EngineConfig(model=ckpt, device="cuda", max_num_seqs=4, max_model_len=256, cuda_graphs=False))
    b = eager.generate(prompts, params)
    RESULTS["cuda_graphs_equal_eager"] = a == b
    print("graphs == eager:", a == b, flush=True)


def hf_bench(config_path: Path, batches: list[int], new_tokens: int) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_path)
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    torch.set_default_device("cuda")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    torch.set_default_device("cpu")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        ids = torch.randint(100, 30000, (b, 128), generator=gen).cuda()
        kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
        model.generate(ids, max_new_tokens=4, **kwargs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kwargs)
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kwargs)
        torch.cuda.synchronize()
        step = (time.perf_counter() - t - t_prefill) / (new_tokens - 1)
        row = {"batch": b, "decode_step_ms": step * 1e3, "decode_tokens_per_s": b / step}
        rows.append(row)
        print("hf", row, flush=True)
    RESULTS["hf_bf16_decode"] = rows


def markdown() -> str:
    lines = [f"device: {RESULTS.get('device')}, torch {RESULTS.get('torch')}", ""]
    floor = RESULTS.get("hbm_floor")
    if floor:
        gb, ms, tps = floor["weight_bytes_read_per_step"] / 1e9, floor["seconds_per_token"] * 1e3, floor["tokens_per_s"]
        lines.append(f"HBM floor, batch-1 decode: {gb:.2f} GB/step -> {ms:.2f} ms/token ({tps:.0f} tok/s)")
    hf = {r["batch"]: r for r in RESULTS.get("hf_bf16_decode", [])}
    lines += ["", "| batch | warmgate ms/step | warmgate tok/s | x HBM floor | HF bf16 ms/step | HF tok/s |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for r in RESULTS.get("engine_decode", []):
        h = hf.get(r["batch"], {})
        lines.append(f"| {r['batch']} | {r['decode_step_ms']:.2f} | {r['decode_tokens_per_s']:.0f} | "
                     f"{r['x_hbm_floor']:.2f} | {h.get('decode_step_ms', float('nan')):.2f} | "
                     f"{h.get('decode_tokens_per_s', float('nan')):.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/warmgate-bench"))
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--skip", nargs="*", default=[])
    parser.add_argument("--no-pdl", action="store_true", help="launch decode kernels without PDL (to compare)")
    args = parser.parse_args()
    if args.no_pdl:
        import engine.native.fused_ops

        engine.native.fused_ops.PDL = False
    args.out.mkdir(parents=True, exist_ok=True)
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__)
    batches = [1, 16, 64]
    steps = [
        ("kernels", kernel_checks),
        ("synth", lambda: synth(args.work)),
        ("graphs", lambda: cuda_graph_consistency(args.work / "qwen3-0.6b-fp8-block")),
        ("engine", lambda: engine_bench(args.work / "llama3-8b-fp8-block", batches, args.new_tokens)),
        ("hf", lambda: hf_bench(args.work / "llama3-8b-fp8-block", batches, args.new_tokens)),
        ("sweep", triton_sweep),
        ("profile", lambda: profile_decode(args.work / "llama3-8b-fp8-block")),
        ("host", lambda: host_profile(args.work / "llama3-8b-fp8-block")),
        ("variants", lambda: engine_variants(args.work / "llama3-8b-fp8-block", args.new_tokens)),
    ]
    for name, step in steps:
        if name in args.skip:
            continue
        t = time.perf_counter()
        try:
            step()
        except Exception as exc:  # keep what the other steps measured
            RESULTS[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            print(f"step {name} failed: {exc!r}", flush=True)
            import traceback

            traceback.print_exc()
        RESULTS.setdefault("step_seconds", {})[name] = time.perf_counter() - t
        save(args.out)
    (args.out / "gpu_engine.md").write_text(markdown())
    print(markdown())


def synth(work: Path) -> None:
    from cache.checkpoint.synth import synth_checkpoint

    path = work / "llama3-8b-fp8-block"
    if path.exists():
        shutil.rmtree(path)
    t = time.perf_counter()
    synth_checkpoint(path, "llama3-8b", "fp8-block", device="cuda", progress=False)
    RESULTS["synth_llama3_8b_seconds"] = time.perf_counter() - t
    small = work / "qwen3-0.6b-fp8-block"
    if small.exists():
        shutil.rmtree(small)
    synth_checkpoint(small, "qwen3-0.6b", "fp8-block", num_layers=4, device="cuda", progress=False)


if __name__ == "__main__":
    main()
