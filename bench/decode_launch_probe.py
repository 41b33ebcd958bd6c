"""Launch choices of a decode step's kernels at decode sizes (1-64 rows), on the GPU (issue 25's batch-64 step).

The twenty-second session swept split-K with the GEMM summing its own planes; since then a second kernel
(_sum_planes) adds them, and the splits were never swept again: here, llama3-8b's four layer GEMMs at each split that
divides their K blocks against the launch rule's, the split-K sum included, weights cycled past the L2. Also the
rotary/KV-write kernel's tokens a program and the SiLU-mul kernel's columns a program and warps (one token and 1,024
columns when this probe was written; the rotary kernel's rule has taken up to 8 since), and with --warps the GEMMs'
warps a program, with --block-m the GEMMs' rows a tile (several row tiles of 16 or 32 at 64 rows: fewer K splits,
the weight read by each through the L2). Each timing is a CUDA graph of the call repeated (bench/gpu_step_profile.py's
graphed_us).

    PYTHONPATH=/tmp/site:$PWD python3 bench/decode_launch_probe.py --out $OUT/decode_launch.json
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

from bench.gemm_small_m import GEMMS, quantized_cases, timed_us
from bench.gpu_step_profile import graphed_us
from engine.native.fused_ops import rope_kv_write, silu_mul
from engine.native.triton_fp8 import BLOCK_K, MAX_SPLIT, fp8_block_gemm, row_tile

HEADS, KV_HEADS, DIM, INTERMEDIATE = 32, 8, 128, 14336


def gemm_rows(rows: list[int], out: list[dict[str, object]], warps: list[int], block_ms: list[int | None]) -> None:
    for name, m, x, ref, copies in quantized_cases(rows):
        k = GEMMS[name][1]
        splits = [None, *(s for s in range(1, MAX_SPLIT + 1) if (k // BLOCK_K) % s == 0)]
        for split, w, bm in itertools.product(splits, warps, block_ms):
            if bm is not None and bm >= row_tile(m):
                continue  # the rule's own tile (or wider): timed as block_m "rule"
            fn = lambda x, wt, s, split=split, w=w, bm=bm: fp8_block_gemm(x, wt, s, split_k=split, num_warps=w,  # noqa: E731
                                                                          block_m=bm)  # fmt: skip
            same = bool(torch.equal(fn(x, *copies[0]), ref)) if split is None else None
            row = {"kernel": "gemm", "gemm": name, "m": m, "split": split or "rule", "warps": w,
                   "block_m": bm or "rule", "us": round(timed_us(fn, copies, x), 2)}  # type: ignore[arg-type]  # fmt: skip
            if same is not None:
                row["same_as_rule"] = same
            out.append(row)
            print(json.dumps(row), flush=True)


def small_kernels(rows: list[int], out: list[dict[str, object]]) -> None:
    slots = 4096
    k_cache = torch.zeros(slots, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    for m in rows:
        qkv = torch.randn(m, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16)
        cos = torch.randn(m, DIM // 2, device="cuda")
        sin = torch.randn(m, DIM // 2, device="cuda")
        where = torch.randperm(slots, device="cuda")[:m]
        for block_t in (1, 2, 4, 8, 16):
            us = graphed_us(lambda b=block_t: rope_kv_write(qkv, cos, sin, k_cache, v_cache, where, HEADS, KV_HEADS,
                                                            block_t=b))  # fmt: skip
            out.append(row := {"kernel": "rope_kv_write", "m": m, "block_t": block_t, "us": round(us, 2)})
            print(json.dumps(row), flush=True)
        gate_up = torch.randn(m, 2 * INTERMEDIATE, device="cuda", dtype=torch.bfloat16)
        for block, warps in itertools.product((512, 1024, 2048, 4096), (2, 4, 8)):
            us = graphed_us(lambda b=block, w=warps: silu_mul(gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:],
                                                              m, block=b, num_warps=w))  # fmt: skip
            out.append(row := {"kernel": "silu_mul", "m": m, "block": block, "warps": warps, "us": round(us, 2)})
            print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="JSON file")
    parser.add_argument("--rows", default="1,16,32,64")
    parser.add_argument("--warps", default="4", help="the GEMMs' warps a program to try, e.g. 4,8")
    parser.add_argument("--only", choices=("gemms", "small"), help="one part (default: both)")
    parser.add_argument("--block-m", default="rule",
                        help="the GEMMs' rows a tile to try, e.g. rule,16,32: below the rows, several row tiles read "
                             "the same weight tiles (through the L2) and need fewer K splits")  # fmt: skip
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    began = time.perf_counter()
    out: list[dict[str, object]] = []
    if args.only != "gemms":
        small_kernels(rows, out)
    if args.only != "small":
        block_ms = [None if b == "rule" else int(b) for b in args.block_m.split(",")]
        gemm_rows(rows, out, [int(w) for w in args.warps.split(",")], block_ms)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "seconds": round(time.perf_counter() - began, 1), "rows": out}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
