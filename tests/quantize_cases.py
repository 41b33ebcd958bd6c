"""The fused activation quantization (engine/native/fused_ops.py, quantize_rows) checked the same way by the CPU
(Triton interpreter) and GPU tests, as attention_cases.py does for paged attention."""

from __future__ import annotations

import torch


def check_quantized_for_gemm(device: torch.device, shapes: list[tuple[int, int, int, int]],
                             split_k: int | None) -> None:  # fmt: skip
    """For each (rows, quantized rows, hidden, intermediate): RMSNorm with the residual added and SiLU-and-multiply
    (of views into one merged gate/up output, as the model passes them) hand a block-FP8 GEMM the same fp8 codes and
    scales as quantize_groups of their unquantized output (in as many rows: those past ``rows`` zeros, as cuBLAS'
    GEMM takes them), update the residual stream alike, and give the Triton GEMM the same output (unpadded shapes).
    ``split_k``: the GEMM's (None: its launch rule, which needs a GPU)."""
    from engine.native.fused_ops import Quantized, add_rms_norm, silu_mul
    from engine.native.triton_fp8 import fp8_block_gemm, quantize_groups

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    for rows, padded, hidden, intermediate in shapes:
        x, residual = randn(rows, hidden).bfloat16(), randn(rows, hidden).bfloat16()
        weight = (torch.rand(hidden, device=device, generator=gen) + 0.5).bfloat16()
        x_plain, x_fused = x.clone(), x.clone()
        plain = add_rms_norm(x_plain, residual, weight, 1e-5)
        fused = add_rms_norm(x_fused, residual, weight, 1e-5, quantize_rows=padded)
        assert torch.equal(x_fused, x_plain)  # the residual stream, updated in place alike
        gate_up = randn(rows, 2 * intermediate).bfloat16() * 3
        gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
        for made, reference in ((fused, plain), (silu_mul(gate, up, quantize_rows=padded), silu_mul(gate, up))):
            assert isinstance(made, Quantized) and made.dtype == torch.bfloat16 and made.rows == rows
            q, s = quantize_groups(reference, padded)
            assert made.q.dtype == q.dtype and torch.equal(made.q.view(torch.uint8), q.view(torch.uint8))
            assert made.scale.stride() == s.stride() == (1, padded) and torch.equal(made.scale, s)
            assert not made.q[rows:].float().any()
            if padded != rows:
                continue
            cols = reference.shape[1]
            w = (randn(256, cols) / 4).to(torch.float8_e4m3fn)
            ws = torch.rand(2, cols // 128, device=device, generator=gen) + 0.5
            assert torch.equal(fp8_block_gemm(made, w, ws, split_k=split_k),
                               fp8_block_gemm(reference, w, ws, split_k=split_k))  # fmt: skip
