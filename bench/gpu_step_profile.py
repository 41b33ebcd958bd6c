"""Where a serving step's time goes on the GPU: decode, mixed (decode + a new prompt) and prefill steps.

    python3 bench/gpu_step_profile.py --model /tmp/wg/llama3-8b-fp8-block --out $OUT   # writes gpu_step_profile.json

For each kind of step: the wall time of the engine's own step (scheduling, staging, graph replay,
sampling, events), the captured graph replayed alone (GPU time), and the top kernels of the same
step run eagerly under the profiler.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.config import EngineConfig
from engine.native.llm_engine import LLMEngine
from engine.native.scheduler import Sequence
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True)


def prompt(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(100, 30000, (n,), generator=gen).tolist()


def fill(engine: LLMEngine, batch: int, gen: torch.Generator, length: int = 160) -> list[Sequence]:
    """``batch`` sequences admitted and prefilled, each now decoding."""
    seqs = [Sequence(f"s{i}", prompt(gen, length), PARAMS, lambda event: None) for i in range(batch)]
    for seq in seqs:
        engine.scheduler.add(seq)
    while engine.scheduler.waiting or any(s.computed < s.length - 1 for s in seqs):
        engine._step()
    return seqs


def clear(engine: LLMEngine) -> None:
    for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
        engine.scheduler.finish(seq)


def timed_steps(engine: LLMEngine, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        engine._step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def replay_ms(engine: LLMEngine, key: tuple[str, int], n: int = 30) -> float:
    graph = engine.runner.graphs[key][0]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def top_kernels(engine: LLMEngine, make_step) -> list[tuple[str, int, float]]:
    """The step's kernels run eagerly (no graph) under the profiler: (name, calls, total us)."""
    from torch.profiler import ProfilerActivity, profile

    runner = engine.runner
    runner.use_graphs = False
    try:
        make_step()  # warm
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            make_step()
            torch.cuda.synchronize()
    finally:
        runner.use_graphs = True
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:90], e.count, round(e.device_time_total, 1)) for e in events[:14]]


GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graphed_us(fn, calls: int = 20) -> float:
    """GPU time of one call, from a CUDA graph of ``calls`` calls (decode runs in graphs: no launch gaps)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * calls)


def gemm_table() -> list[dict[str, object]]:
    """The llama3-8b layer GEMMs per row count: the Triton kernel against cuBLAS' blockwise scaled_mm
    (rows padded to 4, activations quantized by quantize_groups): microseconds for the four of a layer."""
    from torch.nn.functional import ScalingType, scaled_mm

    from engine.native.triton_fp8 import fp8_block_gemm, quantize_groups

    rows = []
    for m in (1, 4, 8, 16, 24, 32, 48, 64, 96, 128):
        row: dict[str, object] = {"m": m, "triton_us": 0.0, "cublas_us": 0.0}
        for n, k in GEMMS.values():
            w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
            s = torch.rand(n // 128, k // 128, device="cuda") + 0.5
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mp = -(-m // 4) * 4

            def cublas(x=x, w=w, s=s, mp=mp) -> None:
                xq, xs = quantize_groups(x, mp)
                scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, s.t(), ScalingType.BlockWise128x128,
                          output_dtype=torch.bfloat16)  # fmt: skip

            row["triton_us"] += graphed_us(lambda x=x, w=w, s=s: fp8_block_gemm(x, w, s))  # type: ignore[operator]
            row["cublas_us"] += graphed_us(cublas)  # type: ignore[operator]
        rows.append(row)
        print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--skip-gemms", action="store_true")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="the engine setting")
    args = parser.parse_args()
    gemms = [] if args.skip_gemms else gemm_table()
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", max_num_seqs=args.max_num_seqs,
                                    max_model_len=2048, max_num_batched_tokens=args.budget,
                                    kv_cache_bytes=20 * 10**9, kv_cache_dtype=args.kv_cache_dtype))  # fmt: skip
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "kv_cache_dtype": engine.memory["kv_cache_dtype"],
                                 "startup": {**engine.startup_phases, "total": time.perf_counter() - t},
                                 "decode": [], "mixed": [], "prefill": {}, "gemms": gemms}  # fmt: skip
    print(result["startup"], flush=True)
    gen = torch.Generator().manual_seed(0)
    runner = engine.runner
    for batch in (1, 16, 32, 64, 128):
        if batch > args.max_num_seqs:
            continue
        fill(engine, batch, gen)
        step = timed_steps(engine, 20)
        bucket = next(b for b in runner.decode_sizes if b >= batch)
        row = {"batch": batch, "step_ms": step * 1e3, "tok_s": batch / step,
               "graph_ms": replay_ms(engine, ("decode", bucket))}  # fmt: skip
        if batch in (1, 64):

            def decode_step() -> None:
                engine._step()

            row["kernels"] = top_kernels(engine, decode_step)
        result["decode"].append(row)  # type: ignore[attr-defined]
        print({k: v for k, v in row.items() if k != "kernels"}, flush=True)
        # One new 160-token prompt joins this batch: the mixed step that admits it.
        if batch in (16, 64, 128):
            new = Sequence("new", prompt(gen, 160), PARAMS, lambda event: None)
            engine.scheduler.add(new)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine._step()
            torch.cuda.synchronize()
            mixed = {"batch": batch, "prompt": 160, "step_ms": (time.perf_counter() - t0) * 1e3,
                     "graph_ms": replay_ms(engine, ("mixed", next(m for m in runner.mixed_sizes
                                                                  if m >= batch + 160)))}  # fmt: skip
            result["mixed"].append(mixed)  # type: ignore[attr-defined]
            print(mixed, flush=True)
        clear(engine)
    # Prefill: prompts of 160 tokens filling whole budget-sized steps.
    n_prompts = 4 * args.budget // 160
    seqs = [Sequence(f"p{i}", prompt(gen, 160), SamplingParams(max_tokens=1), lambda event: None)
            for i in range(n_prompts)]  # fmt: skip
    for seq in seqs:
        engine.scheduler.add(seq)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while not engine.scheduler.idle:
        engine._step()
        steps += 1
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    runner._dummy_inputs(("mixed", args.budget))  # the last step's inputs may not fit the graph (fewer rows)
    result["prefill"] = {"prompts": n_prompts, "tokens": 160 * n_prompts, "steps": steps,
                         "tok_s": 160 * n_prompts / wall, "step_ms": wall / steps * 1e3,
                         "graph_ms": replay_ms(engine, ("mixed", args.budget))}  # fmt: skip
    print(result["prefill"], flush=True)
    # Every mixed graph's replay on its capture's inputs (each row a query of a one-token context, so nearly all of it
    # the GEMMs): what a step pays for the rows its graph pads to. A graph replayed on a larger step's inputs would
    # read past its rows.
    result["mixed_graphs_ms"] = {}
    for n in runner.mixed_sizes:
        runner._dummy_inputs(("mixed", n))
        result["mixed_graphs_ms"][str(n)] = replay_ms(engine, ("mixed", n))  # type: ignore[index]
    print("mixed graphs ms", result["mixed_graphs_ms"], flush=True)

    # Host side of a 2048-token step: staging its inputs.
    batch_seqs = [Sequence(f"h{i}", prompt(gen, 160), SamplingParams(max_tokens=1), lambda e: None)
                  for i in range(args.budget // 160)]  # fmt: skip
    for seq in batch_seqs:
        engine.scheduler.add(seq)
    t0 = time.perf_counter()
    plan = engine.scheduler.schedule()
    t1 = time.perf_counter()
    runner._stage(plan, args.budget, runner.max_seqs)
    t2 = time.perf_counter()
    runner.run(plan)
    torch.cuda.synchronize()  # run launches; the step's time is the device's
    t3 = time.perf_counter()
    result["prefill"]["host_ms"] = {"schedule": (t1 - t0) * 1e3, "stage": (t2 - t1) * 1e3,  # type: ignore[index]
                                    "run": (t3 - t2) * 1e3}  # fmt: skip
    print(result["prefill"]["host_ms"], flush=True)  # type: ignore[index]
    clear(engine)

    def prefill_step() -> None:
        batch = [Sequence(f"q{i}", prompt(gen, 160), SamplingParams(max_tokens=1), lambda e: None)
                 for i in range(args.budget // 160)]  # fmt: skip
        for seq in batch:
            engine.scheduler.add(seq)
        engine._step()
        clear(engine)

    result["prefill"]["kernels"] = top_kernels(engine, prefill_step)  # type: ignore[index]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_step_profile.json").write_text(json.dumps(result, indent=1))
    for row in result["decode"]:  # type: ignore[attr-defined]
        for k in row.get("kernels", []):
            print(row["batch"], k)
    for k in result["prefill"]["kernels"]:  # type: ignore[index]
        print("prefill", k)


if __name__ == "__main__":
    main()
