"""CPU throughput of the native engine on the demo model (this project's 2-core machine).

Start-up phases, decode tokens/s at batch 1 and 8 (step time once all sequences decode,
sampling included) and prefill tokens/s, for bf16 and each FP8 scheme (dequantizing path).

    python bench/cpu_engine.py [--out bench/results/cpu_engine.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_timing import decode_step_seconds
from cache.checkpoint.demo import build_demo
from engine.config import EngineConfig
from engine.native.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PARAGRAPH = Path(__file__).parent / "data" / "paragraph.txt"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_engine.json")
    args = parser.parse_args()
    from tokenizers import Tokenizer

    rows = []
    for scheme in ("bf16", "fp8-block", "fp8-channel", "fp8-tensor"):
        path = build_demo(scheme, progress=False)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        paragraph = tokenizer.encode(PARAGRAPH.read_text()).ids
        t = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=path, max_num_seqs=8, max_model_len=1024))
        row: dict = {"scheme": scheme, "startup_s": round(time.perf_counter() - t, 2),
                     "phases_s": {k: round(v, 3) for k, v in engine.startup_phases.items()}}  # fmt: skip
        params = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
        for batch in (1, 8):
            prompts = [paragraph[i * 16 : i * 16 + 32] for i in range(batch)]
            step = min(decode_step_seconds(engine, prompts, params) for _ in range(2))
            row[f"decode_b{batch}_tok_s"] = round(batch / step, 1)
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        t = time.perf_counter()
        engine.generate([paragraph], one)
        row["prefill_tok_s"] = round(len(paragraph) / (time.perf_counter() - t), 1)
        rows.append(row)
        print(row, flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| scheme | start-up s | decode tok/s, batch 1 | decode tok/s, batch 8 | prefill tok/s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['scheme']} | {r['startup_s']} | {r['decode_b1_tok_s']} | {r['decode_b8_tok_s']} | "
              f"{r['prefill_tok_s']} |")  # fmt: skip


if __name__ == "__main__":
    main()
