"""Where the engine's CUDA-graph capture time goes, and what a graph needs warmed up before its capture.

    python3 bench/graph_capture.py --model /tmp/wg/llama3-8b-fp8-block --out $OUT     # on the H200

Four runs, each a fresh process (the serving config: max_num_seqs 64, 2,048-token steps, so 18 graphs):
every size warmed up before its capture (today's engine) or only the first of each kind, each with
Triton's disk cache warm or empty (a machine's first start: kernels compile during the first passes).
Each run reports the capture seconds split into warm-up, capture and first replay, and checks the
logits of a graphed decode step and mixed step against the same steps run eagerly. Writes
graph_capture.json and graph_capture.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def one_run(model: Path, warm_up_each: bool) -> dict[str, Any]:
    import torch

    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine
    from engine.native.scheduler import Scheduled, Sequence
    from engine.sampling_params import SamplingParams

    config = EngineConfig(model=model, device="cuda", max_num_seqs=64, kv_cache_bytes=8 * 10**9,
                          cuda_graphs=False)  # fmt: skip
    engine = LLMEngine(config)
    runner = engine.runner
    runner.use_graphs, runner.pool = True, torch.cuda.graph_pool_handle()
    seconds = runner.capture_all(warm_up_each=warm_up_each)

    alloc = engine.scheduler.allocator
    errors = {}
    for name, lengths, decode in (("decode_24", [40 + 3 * i for i in range(24)], True),
                                  ("mixed_300", [100, 200], False)):  # fmt: skip
        seqs = [Sequence(f"s{i}", list(range(100 + i, 100 + i + n)), SamplingParams(), lambda e: None)
                for i, n in enumerate(lengths)]  # fmt: skip
        for seq in seqs:
            assert alloc.grow(seq.blocks, seq.length)
        if decode:  # the context's keys and values, eagerly; then the last token of each is the decode step
            runner.use_graphs = False
            runner.run([Scheduled(s, 0, s.length - 1) for s in seqs])
            runner.use_graphs = True
            work = [Scheduled(s, s.length - 1, 1) for s in seqs]
        else:
            work = [Scheduled(s, 0, s.length) for s in seqs]
        graphed = runner.run(work).logits.clone()
        runner.use_graphs = False
        eager = runner.run(work).logits.clone()
        runner.use_graphs = True
        errors[name] = round(float((graphed - eager).norm() / eager.norm()), 5)
        for seq in seqs:
            alloc.release(seq.blocks)
    return {"warm_up_each": warm_up_each, "graphs": len(runner.graphs), "capture_s": round(seconds, 3),
            "parts_s": {k: round(v, 3) for k, v in runner.capture_parts.items()},
            "logits_rel_err_graph_vs_eager": errors}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", choices=["each", "first"])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.model, args.one == "each")))
        return
    runs = []
    for cache in ("warm", "empty"):
        for mode in ("each", "first"):
            env = dict(os.environ)
            if cache == "empty":
                env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-empty-")
            t = time.perf_counter()
            done = subprocess.run([sys.executable, __file__, "--model", str(args.model), "--one", mode], env=env,
                                  capture_output=True, text=True, timeout=400)  # fmt: skip
            lines = done.stdout.strip().splitlines()
            result = json.loads(lines[-1]) if done.returncode == 0 and lines else {"error": done.stderr[-1500:]}
            result.update({"triton_cache": cache, "mode": mode, "process_s": round(time.perf_counter() - t, 1)})
            print(json.dumps(result), flush=True)
            runs.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph_capture.json").write_text(json.dumps(runs, indent=1))
    lines = ["| Triton cache | warm-up | graphs | capture s | warm-up / capture / replay s | logits rel. err "
             "(graph vs eager) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in runs:
        if "error" in r:
            lines.append(f"| {r['triton_cache']} | {r['mode']} | failed: {r['error'][-200:]!r} | | | |")
            continue
        p = r["parts_s"]
        lines.append(f"| {r['triton_cache']} | {r['mode']} | {r['graphs']} | {r['capture_s']} | "
                     f"{p.get('warmup')} / {p.get('capture')} / {p.get('replay')} | "
                     f"{r['logits_rel_err_graph_vs_eager']} |")  # fmt: skip
    (args.out / "graph_capture.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
