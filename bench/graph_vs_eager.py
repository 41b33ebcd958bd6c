"""A prefill step through its CUDA graph against the same step run eagerly, on the same inputs (GPU only).

    python3 bench/graph_vs_eager.py --model /tmp/wg/llama3-8b-fp8-block --out $OUT/graph_vs_eager.json

For each step (prompts of --prompt-len tokens filling --tokens): its GPU time from CUDA events over repeated
launches, through the mixed graph that serving would pick and eagerly, and the kernels of one launch of each under
the profiler (kernels launched by a graph are traced too), so that a difference between the two shows where it is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_engine import timed
from bench.gpu_step_profile import clear, prompt
from engine.config import EngineConfig
from engine.native.llm_engine import LLMEngine
from engine.native.scheduler import Sequence
from engine.sampling_params import SamplingParams


def kernels(fn) -> list[tuple[str, int, float]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return [(e.key[:90], e.count, round(e.device_time_total, 1)) for e in events[:16]]


def step_both_ways(engine: LLMEngine, gen: torch.Generator, tokens: int, prompt_len: int,
                   repeats: int) -> dict[str, object]:  # fmt: skip
    """One prefill step of ``tokens`` (prompts of ``prompt_len``) through its graph and eagerly."""
    runner = engine.runner
    for i in range(tokens // prompt_len):
        engine.scheduler.add(Sequence(f"p{i}", prompt(gen, prompt_len), SamplingParams(max_tokens=1),
                                      lambda event: None))  # fmt: skip
    plan = engine.scheduler.schedule()
    row: dict[str, object] = {"tokens": sum(w.count for w in plan), "sequences": len(plan)}
    for label, graphs in (("graph", True), ("eager", False)):
        runner.use_graphs = graphs
        try:
            row[f"{label}_ms"] = round(1e3 * timed(lambda: runner.run(plan), repeats), 3)
            row[f"{label}_kernels"] = kernels(lambda: runner.run(plan))
        finally:
            runner.use_graphs = True
    print({k: v for k, v in row.items() if not k.endswith("kernels")}, flush=True)
    for label in ("graph", "eager"):
        for k in row[f"{label}_kernels"]:  # type: ignore[attr-defined]
            print(label, k, flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens")
    parser.add_argument("--tokens", default="512,1024")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, device="cuda", max_num_seqs=128, max_model_len=2048,
                                    max_num_batched_tokens=args.budget, kv_cache_bytes=20 * 10**9))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():  # as the engine's steps run
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows.append(step_both_ways(engine, gen, tokens, args.prompt_len, args.repeats))
            clear(engine)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
