"""Paged attention at decode sizes on the GPU: the engine's Triton kernel over key-tile widths, warps and stages, for
llama3-8b's heads (32 query heads on 8 KV heads, dim 128) at batch 1 / 16 / 64 and contexts of 300 / 1,000 / 2,000
positions, each timed in a CUDA graph over 32 layers' caches (a decode step's attention reads each layer once).

    PYTHONPATH=/tmp/site:$PWD python3 bench/attention_decode.py --out $OUT   # on the device machine
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_step_profile import graphed_us
from engine.native.fused_ops import sm_count
from engine.native.triton_attention import launch_shape, paged_attention
from tests.attention_cases import PAGE, make_batch

HEADS, KV_HEADS, DIM, LAYERS = 32, 8, 128, 32


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="300,1000,2000")
    parser.add_argument(
        "--query-len",
        type=int,
        default=1,
        help="query rows per sequence (> 1: prefill chunks over a cached context, as prefix hits are)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    device = torch.device("cuda")
    rows: list[dict[str, object]] = []
    began = time.perf_counter()
    for batch_size, context in itertools.product(map(int, args.batches.split(",")), map(int, args.contexts.split(","))):
        blocks = batch_size * -(-context // PAGE) + 2
        batch = make_batch([(context, args.query_len)] * batch_size, blocks, device, gen)
        caches = [(torch.randn(blocks * PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16),
                   torch.randn(blocks * PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16))
                  for _ in range(LAYERS)]  # fmt: skip
        q = torch.randn(batch_size * args.query_len, HEADS, DIM, device=device, dtype=torch.bfloat16)
        ref = paged_attention(q, *caches[0], batch, DIM**-0.5).float()
        rule_q = launch_shape(HEADS // KV_HEADS, args.query_len, batch_size * KV_HEADS, sm_count(device)).block_q
        query_tiles = (rule_q,) if args.query_len == 1 else (rule_q, 2 * rule_q, 4 * rule_q)
        for block_q, block_n, warps, stages in itertools.product(query_tiles, (32, 64, 128, 256), (2, 4, 8), (2, 3)):

            def step(block_n=block_n, warps=warps, stages=stages, block_q=block_q, caches=caches) -> None:
                for k, v in caches:
                    paged_attention(q, k, v, batch, DIM**-0.5, block_n=block_n, num_warps=warps, num_stages=stages,
                                    block_q=block_q)  # fmt: skip

            try:
                got = paged_attention(q, *caches[0], batch, DIM**-0.5, block_n=block_n, num_warps=warps,
                                      num_stages=stages, block_q=block_q)  # fmt: skip
                err = (got.float() - ref).abs().max().item()
                us = graphed_us(step, calls=2)
            except Exception as exc:  # a choice that does not fit (shared memory, registers): recorded, skipped
                rows.append({"batch": batch_size, "context": context, "block_q": block_q, "block_n": block_n,
                             "warps": warps, "stages": stages, "error": str(exc)[:200]})  # fmt: skip
                continue
            kv_bytes = 2 * batch_size * context * KV_HEADS * DIM * 2 * LAYERS
            row = {"batch": batch_size, "context": context, "block_q": block_q, "block_n": block_n, "warps": warps,
                   "stages": stages,
                   "step_us": round(us, 1), "tb_s": round(kv_bytes / us / 1e6, 3),
                   "max_err": round(err, 5)}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        del caches
        torch.cuda.empty_cache()
    best = {}
    for key in sorted({(r["batch"], r["context"]) for r in rows}):
        timed = sorted((r for r in rows if (r["batch"], r["context"]) == key and "step_us" in r),
                       key=lambda r: r["step_us"])  # fmt: skip
        rule = tuple(launch_shape(HEADS // KV_HEADS, args.query_len, key[0] * KV_HEADS, sm_count(device)))
        # every choice runs with the rule's splits (paged_attention's default): the rule's tile is its first four
        chosen = next((r for r in timed if (r["block_q"], r["block_n"], r["warps"], r["stages"]) == rule[:4]), None)
        old = next((r for r in timed if (r["block_q"], r["block_n"], r["warps"], r["stages"]) == (rule[0], 64, 4, 2)),
                   None)  # fmt: skip
        best[f"b{key[0]} ctx{key[1]}"] = {"rule": rule, "rule_us": chosen and chosen["step_us"],
                                          "64x4x2_us": old and old["step_us"],
                                          "best": [(r["block_q"], r["block_n"], r["warps"], r["stages"], r["step_us"])
                                                   for r in timed[:4]]}  # fmt: skip
        print(key, best[f"b{key[0]} ctx{key[1]}"], flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "seconds": round(time.perf_counter() - began, 1), "rows": rows, "best": best}  # fmt: skip
    result["query_len"] = args.query_len
    (args.out / "attention_decode.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
