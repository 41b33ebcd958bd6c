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

from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Sequence  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    args = parser.parse_args()
    t = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", max_num_seqs=args.max_num_seqs,
                                    max_model_len=2048, max_num_batched_tokens=args.budget,
                                    kv_cache_bytes=20 * 10**9))  # fmt: skip
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "startup": {**engine.startup_phases, "total": time.perf_counter() - t},
                                 "decode": [], "mixed": [], "prefill": {}}  # fmt: skip
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
    result["prefill"] = {"prompts": n_prompts, "tokens": 160 * n_prompts, "steps": steps,
                         "tok_s": 160 * n_prompts / wall, "step_ms": wall / steps * 1e3,
                         "graph_ms": replay_ms(engine, ("mixed", args.budget))}  # fmt: skip
    print(result["prefill"], flush=True)

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
