"""What the engine's Triton kernels use on an H100/H200, without a GPU: each launch a llama3-8b fp8-block step makes
(decode at 1, 16, 64 and 128 sequences, a mixed step of questions over a cached 2,000-token prefix beside decode
rows, a fresh 1,024-token prompt) compiled for sm_90 as the JIT would specialize it, with its registers a thread,
spilled bytes, shared memory, the programs an SM holds at once and its grid's waves over 132 SMs, and whether its
loop's loads are pipelined (copied to shared memory asynchronously).

The launches come from the engine's own kernel wrappers called on the CPU with the step's shapes, in Triton's
interpreter with the kernels' bodies not run (tests/triton_interpreter.py: ``record_launches(execute=False)``); one
layer of each step (the 32 are alike) and its logits' argmax. cuBLAS' GEMMs above 64 rows are not Triton's.

    python bench/kernel_resources.py [--out FILE.json]

Launch choices other than the engine's: ``--attention block_n=32,maxnreg=168`` adds the attention launches of the
prompt steps again with those keyword arguments (engine/native/triton_attention.py's paged_attention), ``--decode
split_kv=8`` those of the decode steps. ``--kv-cache-dtype fp8``: the KV cache in float8 e4m3 (the engine setting).
Each launch's ``ptx_digest`` is its PTX without the line table: run in two trees, equal digests say a change left
that kernel's code as it was.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, DIM, VOCAB = 4096, 14336, 32, 8, 128, 128256
SMS = 132
PREFIX = 2000
# step name -> (context after the step, rows) per sequence, and the first positions every sequence holds in the same
# blocks (0: none)
STEPS: dict[str, tuple[list[tuple[int, int]], int]] = {
    "decode 1": ([(300, 1)], 0),
    "decode 16": ([(300, 1)] * 16, 0),
    "decode 64": ([(300, 1)] * 64, 0),
    "decode 128": ([(300, 1)] * 128, 0),
    "44 decode rows + 20 questions over a cached prefix": ([(PREFIX + 100, 1)] * 44 + [(PREFIX + 50, 50)] * 20, PREFIX),
    "64 decode rows over a cached prefix": ([(PREFIX + 100, 1)] * 64, PREFIX),
    "fresh 1,024-token prompt": ([(1024, 1024)], 0),
}


def record(path: str, step: str, attention: dict[str, int], decode: dict[str, int], kv_cache_dtype: str) -> None:
    """Run one step's kernel wrappers in the interpreter, launches recorded to ``path``, not run."""
    import triton_interpreter

    triton_interpreter.enable()
    triton_interpreter.record_launches(path, execute=False)
    import torch

    from engine.native import fused_ops, triton_attention, triton_fp8

    for module in (fused_ops, triton_attention, triton_fp8):  # as on Hopper: decode-sized launches overlap with PDL
        module.pdl_enabled = lambda device: True  # type: ignore[assignment]  # the CPU has no device to ask

    from bench.attention_ab import step_batch
    from engine.native.fused_ops import add_rms_norm, rope_kv_write, silu_mul
    from engine.native.kernels import CUBLAS_BLOCKWISE_ROWS, SMALL_M
    from engine.native.triton_attention import Rope, paged_attention
    from engine.native.triton_fp8 import fp8_block_gemm, quantize_groups
    from engine.native.triton_logprobs import argmax

    bf16, fp8, cpu = torch.bfloat16, torch.float8_e4m3fn, torch.device("cpu")

    def weight(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(n, k, dtype=fp8), torch.empty(n // 128, k // 128)

    qkv_w, o_w = weight((HEADS + 2 * KV_HEADS) * DIM, HIDDEN), weight(HIDDEN, HEADS * DIM)
    gate_up_w, down_w = weight(2 * INTERMEDIATE, HIDDEN), weight(HIDDEN, INTERMEDIATE)
    norm = torch.empty(HIDDEN, dtype=bf16)
    specs, shared = STEPS[step]
    batch, blocks, rows = step_batch(specs, shared, cpu)
    triton_gemm = rows <= SMALL_M
    quantized = rows if triton_gemm else rows + -rows % CUBLAS_BLOCKWISE_ROWS  # as the cuBLAS path pads them
    x = torch.empty(rows, HIDDEN, dtype=bf16)
    kv = fp8 if kv_cache_dtype == "fp8" else bf16
    k_cache, v_cache = (torch.empty(blocks * batch.block_size, KV_HEADS, DIM, dtype=kv) for _ in range(2))
    h = add_rms_norm(x, x, norm, 1e-5, quantized)
    qkv = fp8_block_gemm(h, *qkv_w) if triton_gemm else torch.empty(rows, qkv_w[0].shape[0], dtype=bf16)
    cos = sin = torch.empty(rows, DIM // 2)
    slots = torch.zeros(rows, dtype=torch.long)
    if batch.max_query_len == 1:  # decode: the attention rotates and writes the cache itself, as the model asks
        q, rope = qkv, Rope(cos, sin, slots, HEADS)
    else:
        q, rope = rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, HEADS, KV_HEADS), None
    out = paged_attention(q, k_cache, v_cache, batch, DIM**-0.5, quantize_rows=quantized, rope=rope)
    if extra := attention if batch.max_query_len > 1 else decode:
        paged_attention(q, k_cache, v_cache, batch, DIM**-0.5, quantize_rows=quantized, rope=rope, **extra)
    if triton_gemm:
        o = fp8_block_gemm(out, *o_w)
    elif isinstance(out, torch.Tensor):  # cuBLAS' GEMM takes it quantized; a decode step's attention did that
        quantize_groups(out, quantized)
    h = add_rms_norm(x, o if triton_gemm else x, norm, 1e-5, quantized)
    gate_up = fp8_block_gemm(h, *gate_up_w) if triton_gemm else torch.empty(rows, 2 * INTERMEDIATE, dtype=bf16)
    act = silu_mul(gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:], quantized)
    down = fp8_block_gemm(act, *down_w) if triton_gemm else x
    add_rms_norm(x, down, norm, 1e-5)
    argmax(torch.empty(rows, VOCAB))


def table(compiled: list[dict]) -> list[dict]:
    """One row a launch: the kernel, its launch choices, what it uses, its largest grid in waves over SMS SMs."""
    rows = []
    for launch in compiled:
        constants = {k: v for k, v in launch["constants"].items() if k.isupper() and k != "USE_PDL"}
        programs = max(x * y * z for x, y, z in launch["grids"])
        held = launch["programs_per_sm"] * SMS
        rows.append({"kernel": launch["name"], "choices": {**constants, **launch["options"]},
                     "registers": launch["registers"], "spilled": launch["spilled"], "shared": launch["shared"],
                     "programs_per_sm": launch["programs_per_sm"], "async_copies": launch["async_copies"],
                     "prefetches_before_wait": launch["prefetches_before_wait"], "ptx_digest": launch["ptx_digest"],
                     "programs": programs, "waves": round(programs / held, 2) if held else None})  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| kernel | launch choices | registers | spilled B | shared KiB | programs / SM | async copies | "
             "largest grid | waves |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        choices = ", ".join(f"{k}={v}" for k, v in r["choices"].items())
        lines.append(f"| {r['kernel']} | {choices} | {r['registers']} | {r['spilled']} | {r['shared'] / 1024:.1f} | "
                     f"{r['programs_per_sm']} | {r['async_copies']} | {r['programs']} | {r['waves']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--attention", default="", help="extra attention launch choices, e.g. block_n=32,maxnreg=168")
    parser.add_argument("--decode", default="", help="extra decode attention launch choices, e.g. split_kv=8")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="auto: bf16")
    parser.add_argument("--record", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    def choices(text: str) -> dict[str, int]:
        return {k: int(v) for k, v in (pair.split("=") for pair in filter(None, text.split(",")))}

    if args.record:
        record(*args.record, choices(args.attention), choices(args.decode), args.kv_cache_dtype)
        return
    import triton
    import triton_interpreter

    steps = {}
    with tempfile.TemporaryDirectory() as tmp:
        for step in STEPS:
            launches = str(Path(tmp) / "launches.jsonl")
            subprocess.run([sys.executable, __file__, "--record", launches, step, "--attention", args.attention,
                            "--decode", args.decode, "--kv-cache-dtype", args.kv_cache_dtype], check=True)  # fmt: skip
            steps[step] = table(triton_interpreter.compile_launches(launches))
            print(f"\n{step} (one layer and the logits' argmax; Triton {triton.__version__}):\n\n"
                  f"{markdown(steps[step])}", flush=True)  # fmt: skip
    if args.out:
        found = {"target": "sm_90", "sms": SMS, "triton": triton.__version__, "kv_cache_dtype": args.kv_cache_dtype,
                 "steps": steps}  # fmt: skip
        args.out.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
