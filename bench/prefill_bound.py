"""How fast the GPU's best available GEMMs could prefill llama3-8b's prompts: issue 25's 1,150-token wave.

The wave's first round is 32 prompts of 1,150 tokens arriving together, so its last first token cannot come before
all 36,800 prompt tokens have gone through the model: its TTFT (the wave's p99: 128 requests, the first round's
slowest) is at least those tokens' GEMM time. This probe times llama3-8b's four layer GEMMs at prefill sizes through
what the engine uses there, cuBLAS' blockwise scaled_mm: "engine" with ``quantize_groups`` before it (as o_proj's
activations are quantized), "blockwise_alone" on operands already quantized (as the RMSNorm and SiLU kernels hand
over the other GEMMs'). Then cuBLAS' FP8 GEMM with one scale per tensor (no block scales: the device's FP8 ceiling
through cuBLAS) and a bf16 matmul. Each is turned into the 32 layers' GEMM milliseconds for the first round.

Where DeepGEMM can be imported (its JIT needs nvcc and an sm_90a card), "deep_gemm" times its FP8 GEMM with the same
scales (1x128 activations, 128x128 weights) on the same quantized operands, and each row gives its largest difference
from cuBLAS' blockwise output, relative to that output's largest magnitude. Its kernels are compiled per shape (M
included) first, in parallel, before anything is timed.

    PYTHONPATH=/tmp/site:$PWD python3 bench/prefill_bound.py --out $OUT/prefill_bound.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gemm_small_m import GEMMS, cublas, prepared_deep_gemm
from bench.gpu_step_profile import graphed_us
from engine.native.triton_fp8 import quantize_groups

LAYERS = 32
FIRST_ROUND_TOKENS = 32 * 1150


def main() -> None:
    from torch.nn.functional import ScalingType, scaled_mm

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True, help="JSON file")
    parser.add_argument("--rows", default="512,1024,2048,4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    ms = [int(r) for r in args.rows.split(",")]
    deep = prepared_deep_gemm(ms)
    for m in ms:
        layer: dict[str, float] = {}
        for name, (n, k) in GEMMS.items():
            w = (torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn)
            s = torch.rand(n // 128, k // 128, device="cuda") + 0.5
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_groups(x, m)
            one = torch.ones((), device="cuda")
            wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            variants = {
                "engine": lambda: cublas(x, w, s),
                "blockwise_alone": lambda: scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, s.t(),
                                                     ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
                "tensorwise_fp8": lambda: scaled_mm(xq, w.t(), one, ScalingType.TensorWise, one,
                                                    ScalingType.TensorWise, output_dtype=torch.bfloat16),
                "bf16": lambda: x @ wb.t(),
            }  # fmt: skip
            if deep is not None:
                variants["deep_gemm"] = lambda: deep.gemm(xq, xs, w, s)
            reference = variants["blockwise_alone"]().float()
            for label, fn in variants.items():
                us = graphed_us(fn, calls=10)
                row = {"m": m, "gemm": name, "variant": label, "us": round(us, 2),
                       "tflops": round(2 * m * n * k / us / 1e6, 1)}  # fmt: skip
                if label == "deep_gemm":
                    diff = (fn().float() - reference).abs().max() / reference.abs().max()
                    row["max_diff_vs_blockwise"] = float(diff)
                rows.append(row)
                print(json.dumps(row), flush=True)
                layer[label] = layer.get(label, 0.0) + us
        flops = 2 * m * sum(n * k for n, k in GEMMS.values())
        for label, us in layer.items():
            summary = {"m": m, "variant": label, "layer_gemms_us": round(us, 1), "tflops": round(flops / us / 1e6, 1),
                       "first_round_gemm_ms": round(us * LAYERS * FIRST_ROUND_TOKENS / m / 1e3, 1)}  # fmt: skip
            rows.append(summary)
            print(json.dumps(summary), flush=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                    "first_round_tokens": FIRST_ROUND_TOKENS, "rows": rows}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
