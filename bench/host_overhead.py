"""The engine thread's host work per generated token, on the CPU: a full batch decoding through the engine's own
step (scheduler, input staging, sampling, bookkeeping, token events) with the model's forward and logits
replaced by tensors made once, so what a step costs is what the engine thread spends around a GPU step.

    python bench/host_overhead.py [--batch 64] [--steps 200] [--profile 25] [--out bench/results/host_overhead.json]

Reported: wall and thread CPU per step and per generated token, and the functions that take the most of it (a
second run under cProfile, whose own overhead inflates every figure: read them as shares).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache.checkpoint.synth import SHAPES, synth_checkpoint
from engine.config import EngineConfig
from engine.native.llm_engine import LLMEngine
from engine.native.scheduler import Sequence
from engine.request_stream import TokenEvent
from engine.sampling_params import SamplingParams

TINY = {**SHAPES["llama3-8b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096}  # fmt: skip


class NullModel:
    """Stands in for the model's forward and logits with tensors made once, as fast as a GPU's step would return
    to the host: what is left of a step is the engine thread's own work."""

    def __init__(self, engine: LLMEngine, batch: int) -> None:
        vocab = engine.args.shape.vocab
        self.hidden = torch.zeros(4096, engine.args.shape.hidden)
        self.logits_rows = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0))
        engine.model.forward = self.forward  # type: ignore[method-assign]
        engine.model.logits = self.logits  # type: ignore[method-assign]
        engine.runner._host_metadata = lambda batch, step: None  # type: ignore[method-assign]  # CPU attention's

    def forward(self, batch: object, kv: object) -> torch.Tensor:
        return self.hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits_rows[: len(hidden)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--profile", type=int, default=25, help="functions listed from the profile")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = synth_checkpoint(Path(tmp) / "tiny", TINY, "bf16", progress=False)
        engine = LLMEngine(EngineConfig(model=path, device="cpu", max_num_seqs=args.batch, max_model_len=1024,
                                        enable_prefix_caching=True))  # fmt: skip
    params = SamplingParams(max_tokens=2 * args.steps + 2, temperature=args.temperature, ignore_eos=True)
    events: list[TokenEvent] = []
    for i in range(args.batch):
        prompt = [(7 * i + j) % 4000 + 10 for j in range(40)]
        engine.scheduler.add(Sequence(f"s{i}", prompt, params, events.append))
    while engine.scheduler.waiting or any(len(s.output) == 0 for s in engine.scheduler.running):
        engine._step()  # the prefill
    assert len(engine.scheduler.running) == args.batch
    NullModel(engine, args.batch)
    profile = cProfile.Profile()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(args.steps):
        engine._step()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    profile.enable()
    for _ in range(args.steps // 2):
        engine._step()
    profile.disable()
    tokens = args.steps * args.batch
    stats = pstats.Stats(profile)
    profiled_tokens = args.steps // 2 * args.batch
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[: args.profile]  # type: ignore[attr-defined]
    top = [{"function": f"{Path(file).name}:{line} {name}", "calls_per_step": round(calls / (args.steps // 2), 1),
            "own_us_per_token": round(own / profiled_tokens * 1e6, 2),
            "cumulative_us_per_token": round(cum / profiled_tokens * 1e6, 2)}
           for (file, line, name), (_, calls, own, cum, _) in rows]  # fmt: skip
    result = {"batch": args.batch, "steps": args.steps, "temperature": args.temperature,
              "step_ms": round(wall / args.steps * 1e3, 3), "thread_cpu_ms_per_step": round(cpu / args.steps * 1e3, 3),
              "host_us_per_token": round(wall / tokens * 1e6, 2),
              "thread_cpu_us_per_token": round(cpu / tokens * 1e6, 2), "profile_top": top,
              "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__}  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "profile_top"}))
    for row in top:
        print(f"{row['own_us_per_token']:8.2f} us/tok own {row['cumulative_us_per_token']:8.2f} cum "
              f"{row['calls_per_step']:7.1f}/step  {row['function']}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
