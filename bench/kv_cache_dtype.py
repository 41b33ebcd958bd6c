"""What an fp8 KV cache costs in accuracy: the demo model through the native engine (CPU), its KV cache in the
compute dtype (fp32) and in fp8 (`kv_cache_dtype = "fp8"`), on the same text and prompts.

    python bench/kv_cache_dtype.py [--out bench/results/cpu_kv_cache_dtype.json]

Perplexity of bench/data/paragraph.txt from the engine's prompt logprobs (echo), the paragraph's tokens as one
prompt; and greedy answers of 32 tokens to short prompts: how many equal the fp32 cache's, and how many of their
first tokens agree. Each checkpoint scheme of the demo (bf16, and fp8-block: what the GPU serves).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cache.checkpoint.demo import build_demo
from engine.config import EngineConfig
from engine.native.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PARAGRAPH = Path(__file__).parent / "data" / "paragraph.txt"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "List three fruits:",
    "The best way to learn a language is",
    "Photosynthesis is the process by which",
    "A haiku about autumn:",
    "import numpy as np\n",
    "Q: What is 12 times 12?\nA:",
]


def perplexity(engine: LLMEngine, ids: list[int]) -> float:
    events = []
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    engine.scheduler.add(engine._sequence("ppl", ids, params, events.append))
    while not engine.scheduler.idle:
        engine._step()
    logprobs = [entry.logprob for entry in events[0].prompt_logprobs[1:]]
    return math.exp(-sum(logprobs) / len(logprobs))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_kv_cache_dtype.json")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    results = []
    for scheme in ("bf16", "fp8-block"):
        path = build_demo(scheme, progress=False)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        text = tokenizer.encode(PARAGRAPH.read_text()).ids
        prompts = [tokenizer.encode(p).ids for p in PROMPTS]
        greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
        answers = {}
        for kv in ("auto", "fp8"):
            engine = LLMEngine(EngineConfig(model=path, device="cpu", max_num_seqs=16, max_model_len=1024,
                                            kv_cache_dtype=kv))  # fmt: skip
            started = time.perf_counter()
            ppl = perplexity(engine, text)
            answers[kv] = engine.generate(prompts, greedy)
            seconds = round(time.perf_counter() - started, 1)
            results.append({"scheme": scheme, "kv_cache_dtype": kv, "kv_dtype": engine.memory["kv_cache_dtype"],
                            "bytes_per_token": engine.kv.spec.bytes_per_token, "paragraph_tokens": len(text),
                            "perplexity": round(ppl, 4), "seconds": seconds})  # fmt: skip
        prefixes = [common_prefix(a, b) for a, b in zip(answers["auto"], answers["fp8"], strict=True)]
        results[-1].update({"answers_equal": sum(p == 32 for p in prefixes), "answers": len(prompts),
                            "first_tokens_equal": sum(p > 0 for p in prefixes),
                            "common_prefix_tokens": prefixes})  # fmt: skip
        for row in results[-2:]:
            print(json.dumps(row))
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
