"""Which row counts M cuBLAS' FP8 scaled_mm accepts, for blockwise (1x128 x 128x128) and rowwise scaling.

    python3 bench/cublas_blockwise_rule.py --out $OUT     # on a Hopper GPU; writes cublas_blockwise_rule.json

For every M in 1..320 and a few large ones, and (N, K) shapes of llama3-8b, call scaled_mm as
engine/native/kernels.py does (activation scales column-major, strides (1, M)) without padding, and
record what is refused. Then the same with rows padded to multiples of 4, 8 and 16, and with only
the scale's leading dimension padded. The engine pads to the smallest multiple that every M passed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.native.kernels import quantize_per_token, quantize_per_token_group

SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096)]
ROWS = [*range(1, 321), 511, 1000, 1023, 1024, 2047, 4095]


_WEIGHTS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    if (n, k) not in _WEIGHTS:
        _WEIGHTS.clear()
        _WEIGHTS[(n, k)] = (torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn),
                            torch.rand(n // 128, k // 128, device="cuda") + 0.5)  # fmt: skip
    return _WEIGHTS[(n, k)]


def blockwise(m: int, n: int, k: int, pad_rows: int = 1, pad_scale_only: bool = False) -> bool:
    from torch.nn.functional import ScalingType, scaled_mm

    mp = -(-m // pad_rows) * pad_rows
    x = torch.randn(mp, k, device="cuda", dtype=torch.bfloat16)
    w, ws = weights(n, k)
    xq, xs = quantize_per_token_group(x)
    if pad_scale_only:  # M rows, but the scale's leading dimension rounded up to 4
        lead = -(-m // 4) * 4
        storage = torch.zeros(k // 128, lead, device="cuda")
        storage[:, :m] = xs[:m].t()
        xq, xs = xq[:m], storage.as_strided((m, k // 128), (1, lead))
    try:
        scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, ws.t(), ScalingType.BlockWise128x128,
                  output_dtype=torch.bfloat16)  # fmt: skip
        torch.cuda.synchronize()
        return True
    except (RuntimeError, ValueError):  # cuBLAS' refusal, or torch's own layout check
        return False


def rowwise(m: int, n: int, k: int) -> bool:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w, _ = weights(n, k)
    xq, xs = quantize_per_token(x)
    try:
        torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=torch.ones(1, n, device="cuda"), out_dtype=torch.bfloat16)
        torch.cuda.synchronize()
        return True
    except (RuntimeError, ValueError):  # cuBLAS' refusal, or torch's own layout check
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                 "cuda": torch.version.cuda, "shapes": SHAPES, "rows": ROWS}  # fmt: skip
    refused: dict[str, list[int]] = {}
    for n, k in SHAPES:
        refused[f"blockwise {n}x{k}"] = [m for m in ROWS if not blockwise(m, n, k)]
        refused[f"rowwise {n}x{k}"] = [m for m in ROWS if not rowwise(m, n, k)]
        for multiple in (4, 8, 16):
            refused[f"blockwise {n}x{k} rows padded to {multiple}"] = [
                m for m in ROWS if not blockwise(m, n, k, pad_rows=multiple)]  # fmt: skip
        refused[f"blockwise {n}x{k} scale lead dim padded to 4"] = [
            m for m in ROWS if m > 64 and not blockwise(m, n, k, pad_scale_only=True)]  # fmt: skip
    result["refused"] = refused
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cublas_blockwise_rule.json").write_text(json.dumps(result, indent=1))
    for name, ms in refused.items():
        print(f"{name}: {len(ms)} refused {ms[:40]}")


if __name__ == "__main__":
    main()
