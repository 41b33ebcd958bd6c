"""Small-M block-FP8 GEMMs on the GPU: the engine's Triton kernel over its launch choices, and cuBLAS' blockwise
scaled_mm; the llama3-8b layer shapes, weights rotated through copies that outgrow L2 (a decode step reads each
weight once). bench/results/gpu_gemm_small_m.json is the run that chose the kernel's defaults: there "triton" was
its predecessor, which quantized the activations in every program, and "prequantized" a copy of today's kernel.
With --deep-gemm: the engine's kernel on activations quantized beforehand (as the norms hand them over), cuBLAS, and
DeepGEMM's FP8 GEMM (same scales; its JIT needs nvcc and an sm_90a card) on the same quantized activations.

    PYTHONPATH=/tmp/site:$PWD python3 bench/gemm_small_m.py --out $OUT   # on the device machine: gemm_small_m.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_step_profile import graphed_us
from engine.native.deep_gemm import DeepGemm
from engine.native.fused_ops import Quantized
from engine.native.triton_fp8 import fp8_block_gemm, quantize_groups

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 200 << 20  # weight copies cycled per timing: more than the H200's 50 MB of L2, several times over


def cublas(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    from torch.nn.functional import ScalingType, scaled_mm

    m = x.shape[0]
    xq, xs = quantize_groups(x, -(-m // 4) * 4)
    y = scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, s.t(), ScalingType.BlockWise128x128,
                  output_dtype=torch.bfloat16)  # fmt: skip
    return y[:m]


def prepared_deep_gemm(rows: list[int]) -> DeepGemm | None:
    """The engine's DeepGEMM (engine/native/deep_gemm.py) with its kernels built for the GEMMS at these rows (padded
    to 4) before anything is timed, or None where it cannot run here (not installed, no nvcc, not sm_90)."""
    deep = DeepGemm.load(torch.device("cuda"))
    if deep is None:
        print(json.dumps({"deep_gemm": "not available"}), flush=True)
        return None
    weights = [(torch.zeros(n, k, device="cuda", dtype=torch.float8_e4m3fn), torch.ones(n // 128, k // 128,
                device="cuda")) for n, k in GEMMS.values()]  # fmt: skip
    start = time.perf_counter()
    built = deep.prepare(weights, [-(-m // 4) * 4 for m in rows])
    print(json.dumps({"deep_gemm_kernels": built, "compile_s": round(time.perf_counter() - start, 1)}), flush=True)
    return deep


def weight_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random block-FP8 weights [n, k] with their 128x128 scales, as many copies as outgrow the L2 (at least two):
    a timing cycles through them, so every call reads its weight from HBM as a decode step does."""
    return [((torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn),
             torch.rand(n // 128, k // 128, device="cuda") + 0.5)
            for _ in range(max(2, L2_BYTES // (n * k)))]  # fmt: skip


def quantized_cases(
    rows: list[int], names: list[str] | None = None
) -> Iterator[tuple[str, int, Quantized, torch.Tensor, list]]:
    """Each layer GEMM (those of ``names``, all by default) at each row count: its name, the rows, random
    activations quantized as the norms hand them to the GEMM, the engine kernel's output for them (the reference of
    a variant) and the weight copies."""
    for name, (n, k) in GEMMS.items():
        if names and name not in names:
            continue
        copies = weight_copies(n, k)
        for m in rows:
            values = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x = Quantized(*quantize_groups(values, m), values.dtype, m)
            yield name, m, x, fp8_block_gemm(x, *copies[0]), copies
        del copies
        torch.cuda.empty_cache()


def timed_us(fn, copies: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> float:
    """GPU time of one call, from a CUDA graph that calls it once per weight copy, twice round."""
    turn = itertools.cycle(copies)
    return graphed_us(lambda: fn(x, *next(turn)), calls=2 * len(copies))


def measure(case: tuple, label: str, fn: Callable[..., torch.Tensor]) -> float | None:
    """Time one launch choice on ``case`` (rows to append to, GEMM name, x, the reference output, weight copies):
    its row appended and printed; None for a choice that does not launch."""
    rows, name, x, ref, copies = case
    n, k = GEMMS[name]
    m = x.shape[0]
    try:
        err = ((fn(x, *copies[0]).float() - ref).norm() / ref.norm()).item()
        us = timed_us(fn, copies, x)
    except Exception as exc:  # a launch choice that does not fit (shared memory): recorded, skipped
        rows.append({"gemm": name, "m": m, "variant": label, "error": str(exc)[:200]})
        return None
    row = {"gemm": name, "n": n, "k": k, "m": m, "variant": label, "us": round(us, 2),
           "tb_s": round(n * k / us / 1e6, 3), "rel_err_vs_triton": round(err, 5)}  # fmt: skip
    rows.append(row)
    print(json.dumps(row), flush=True)
    return us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,16,32,64")
    parser.add_argument(
        "--splits",
        default="",
        help="also sweep split-K over these (e.g. 1,2,4,8,16; each that divides the K blocks), for block_n 64/128, "
        "4/8 warps, 3/4 stages",
    )
    parser.add_argument("--explore", action="store_true",
                        help="sweep swap-AB (weight rows on the MMA's M side) and TMA weight loads with block_n "
                             "64/128, 4/8 warps, 3/5 stages at the launch rule's split, then splits 1-16 for each row "
                             "count's and GEMM's three best")  # fmt: skip
    parser.add_argument(
        "--deep-gemm",
        action="store_true",
        help="only the engine's kernel on prequantized activations, cuBLAS and DeepGEMM",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    began = time.perf_counter()
    deep = prepared_deep_gemm([int(r) for r in args.rows.split(",")]) if args.deep_gemm else None
    for name, (n, k) in GEMMS.items():
        copies = weight_copies(n, k)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = fp8_block_gemm(x, *copies[0]).float()
            variants = {"triton": lambda x, w, s: fp8_block_gemm(x, w, s)}
            if m >= 4:
                variants["cublas"] = cublas
            for bn in (64, 128, 256):
                for warps in (4, 8):
                    for stages in (3, 4):
                        variants[f"triton bn{bn} w{warps} s{stages}"] = (
                            lambda x, w, s, bn=bn, warps=warps, stages=stages:
                            fp8_block_gemm(x, w, s, block_n=bn, num_warps=warps, num_stages=stages))  # fmt: skip
            splits = [int(v) for v in args.splits.split(",") if v and (k // 128) % int(v) == 0]
            if splits or args.explore:
                variants = {"triton": variants["triton"], **({"cublas": cublas} if m >= 4 else {})}
            if args.deep_gemm:
                xq = Quantized(*quantize_groups(x, -(-m // 4) * 4), x.dtype, m)
                variants = {"triton": lambda x, w, s, xq=xq: fp8_block_gemm(xq, w, s),
                            **({"cublas": cublas} if m >= 4 else {})}  # fmt: skip
                if deep is not None:  # its rows padded to 4 as the engine's are, then dropped
                    variants["deep_gemm"] = lambda x, w, s, xq=xq, m=m, deep=deep: deep.gemm(xq.q, xq.scale, w, s)[:m]
            launches: dict[str, dict[str, object]] = {}  # --explore's launch choices, by label
            if args.explore:
                for swap, tma, bn, warps, stages in itertools.product((False, True), (False, True), (64, 128), (4, 8),
                                                                       (3, 5)):  # fmt: skip
                    launch = {"block_n": bn, "num_warps": warps, "num_stages": stages, "swap_ab": swap, "tma": tma}
                    label = f"triton bn{bn} w{warps} s{stages}{' swap' * swap}{' tma' * tma}"
                    launches[label] = launch
                    variants[label] = lambda x, w, s, launch=launch: fp8_block_gemm(x, w, s, **launch)
            for split, bn, warps, stages in itertools.product(splits, (64, 128), (4, 8), (3, 4)):
                variants[f"triton bn{bn} w{warps} s{stages} k{split}"] = (
                    lambda x, w, s, bn=bn, warps=warps, stages=stages, split=split:
                    fp8_block_gemm(x, w, s, block_n=bn, num_warps=warps, num_stages=stages, split_k=split))  # fmt: skip

            case = (rows, name, x, ref, copies)
            measured = {label: us for label, fn in variants.items() if (us := measure(case, label, fn)) is not None}
            # --explore: the three best launch choices again, at every split of K
            for label in sorted((v for v in measured if v in launches), key=measured.__getitem__)[:3]:
                for split in (1, 2, 4, 8, 16):
                    if (k // 128) % split == 0:
                        launch = {**launches[label], "split_k": split}
                        measure(case, f"{label} k{split}",
                                lambda x, w, s, launch=launch: fp8_block_gemm(x, w, s, **launch))  # fmt: skip
        del copies
        torch.cuda.empty_cache()
    best: dict[str, dict[str, object]] = {}
    for m in sorted({r["m"] for r in rows if "us" in r}):  # type: ignore[type-var]
        per: dict[str, float] = {}
        for r in rows:
            if r.get("m") == m and "us" in r:
                per[r["variant"]] = per.get(r["variant"], 0.0) + float(r["us"])  # type: ignore[arg-type]
        complete = {v: t for v, t in per.items() if sum(1 for r in rows if r.get("m") == m and r.get("variant") == v
                                                        and "us" in r) == len(GEMMS)}  # fmt: skip
        best[str(m)] = {"layer_us": dict(sorted(complete.items(), key=lambda kv: kv[1]))}
        print(m, list(best[str(m)]["layer_us"].items())[:6], flush=True)  # type: ignore[union-attr]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "seconds": round(time.perf_counter() - began, 1), "rows": rows, "per_layer": best}  # fmt: skip
    (args.out / "gemm_small_m.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
