"""Paged attention on the GPU for the steps a prefix wave and decoding make: prefill chunks over a shared cached prefix
(the blocks every sequence's table shares), with and without decode rows, decode alone, fresh prompts; each timed in a
CUDA graph over 32 layers' caches (llama3-8b's 32 query heads on 8 KV heads, dim 128). Steps over the shared prefix run
twice in this tree: told the prefix (``StepBatch.shared_prefix``: walked once for the rows of several sequences) and not
(``per_sequence``); decode steps also through the launch of a step with prompt rows (``as_mixed``, with and without the
shared prefix), and as the model launches them (``engine``: from the unrotated q/k/v projection, rotating the queries
and writing the new keys and values, the output quantized for o_proj where the kernel does that; ``engine_per_sequence``
beside it over a shared prefix). ``--baseline FILE``: a second copy of engine/native/triton_attention.py (e.g. ``git
show REV:engine/native/triton_attention.py``) timed beside the working tree's, twice each in turn, with the largest
difference of their outputs from the current kernel's. ``--launches n32_r168,dg8,...``: launch choices of LAUNCHES tried
too on the steps with prompt rows and those that walk a shared prefix once (decode's ``as_mixed``); ``--splits
unsplit,split8,...``: decode steps with their positions split over other numbers of programs (SPLITS; over a shared
prefix, the walk a sequence so split); ``--cases decode``: only the cases whose names start so; ``--engine-parts``:
decode's ``engine`` launch also with only its rotation and writes (``engine_rope``) and only its quantized output
(``engine_quantize``).

    PYTHONPATH=/tmp/site:$PWD python3 bench/attention_ab.py --out $OUT/ab.json [--baseline /tmp/old_attention.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.native.triton_attention as current
from bench.gpu_step_profile import graphed_us
from engine.native.attention import StepBatch
from engine.native.triton_fp8 import quantize_groups

HEADS, KV_HEADS, DIM, LAYERS, PAGE, PREFIX = 32, 8, 128, 32, 16, 2000
CHUNKS = [(PREFIX + 50, 50)] * 20  # 20 questions of 50 tokens after a cached 2,000-token system prompt
DECODES = [(PREFIX + 100, 1)] * 44  # sequences of the same wave already decoding
# (context after the step, rows) per sequence; the first positions every sequence holds in the same blocks (0: none)
CASES: dict[str, tuple[list[tuple[int, int]], int]] = {
    "20 chunks of 50 over 2,000 cached": (CHUNKS, PREFIX),
    "20 chunks of 50 + 44 decode rows over 2,000 cached": (CHUNKS + DECODES, PREFIX),
    "44 decode rows, then 20 chunks, over 2,000 cached": (DECODES + CHUNKS, PREFIX),  # the engine's order
    "44 decode rows at 2,100": (DECODES, PREFIX),
    "64 decode rows at 2,100": ([(PREFIX + 100, 1)] * 64, PREFIX),
    # decode over a shared prefix: from the fewest sequences a launch walks unsplit on an H100 (17) to 128, and a
    # prefix as short as a sequence's own positions (SHARED_MIN: 256)
    "decode over a shared prefix: 24 at 2,100": ([(PREFIX + 100, 1)] * 24, PREFIX),
    "decode over a shared prefix: 32 at 2,100": ([(PREFIX + 100, 1)] * 32, PREFIX),
    "decode over a shared prefix: 128 at 2,100": ([(PREFIX + 100, 1)] * 128, PREFIX),
    "decode over a shared prefix: 64 at 2,300": ([(PREFIX + 300, 1)] * 64, PREFIX),
    "decode over a shared prefix: 64 at 256 + 200": ([(456, 1)] * 64, 256),
    "decode over a shared prefix: 128 at 512 + 100": ([(612, 1)] * 128, 512),
    "decode 1 at 300": ([(300, 1)], 0),
    "decode 64 at 300": ([(300, 1)] * 64, 0),
    "decode 1 at 2,000": ([(2000, 1)], 0),
    "decode 1 at 8,000": ([(8000, 1)], 0),
    "decode 4 at 4,000": ([(4000, 1)] * 4, 0),
    "decode 8 at 1,000": ([(1000, 1)] * 8, 0),
    "decode 16 at 300": ([(300, 1)] * 16, 0),
    "decode 16 at 2,000": ([(2000, 1)] * 16, 0),
    "decode 24 at 300": ([(300, 1)] * 24, 0),
    "decode 24 at 1,300": ([(1300, 1)] * 24, 0),
    "decode 32 at 300": ([(300, 1)] * 32, 0),
    "decode 32 at 1,300": ([(1300, 1)] * 32, 0),
    "decode 32 at 2,100": ([(2100, 1)] * 32, 0),
    "decode 48 at 1,300": ([(1300, 1)] * 48, 0),
    "fresh 1 x 1,024": ([(1024, 1024)], 0),
    "fresh 4 x 512": ([(512, 512)] * 4, 0),
}
# Launch choices other than launch_shape's for the shared walk (paged_attention's keyword arguments). Compiled for
# sm_90 by Triton 3.6 (bench/kernel_resources.py), the launch of a step with prompt rows holds 250 registers a thread:
# two programs an SM. 32-position key tiles take 184 (still two), and capped at 168 fit in 164 without spilling:
# three an SM. 3 stages; decode rows of 8 or 16 sequences to a tile.
LAUNCHES: dict[str, dict[str, int]] = {
    "n32": {"block_n": 32},
    "n32_r168": {"block_n": 32, "maxnreg": 168},
    "n32_s3_r168": {"block_n": 32, "num_stages": 3, "maxnreg": 168},
    "s3": {"num_stages": 3},
    "dg8": {"decode_group": 8},
    "dg16": {"decode_group": 16},
    "n32_r168_dg8": {"block_n": 32, "maxnreg": 168, "decode_group": 8},
    "w8": {"num_warps": 8},  # 64-row tiles over two warp groups
    "q32_w8": {"block_q": 32, "num_warps": 8},  # 128-row tiles (32 tokens x 4 heads), a warp group per 64 rows
    "q32_w8_s3": {"block_q": 32, "num_warps": 8, "num_stages": 3},
    "q32_w8_n128": {"block_q": 32, "num_warps": 8, "block_n": 128},
    "q32_w8_r255": {"block_q": 32, "num_warps": 8, "maxnreg": 255},
}
# Decode steps with their positions split over other numbers of programs than launch_shape's (split_kv; "split1": not
# split), over a shared prefix the walk a sequence so split (``per_sequence_split2``, ...); and "unsplit", the launch
# launch_shape made before it split them (256-position tiles with 8 warps).
SPLITS: dict[str, dict[str, int]] = {
    "unsplit": {"split_kv": 1, "block_n": 256, "num_warps": 8},
    "split1": {"split_kv": 1},
    "split2": {"split_kv": 2},
    "split4": {"split_kv": 4},
    "split8": {"split_kv": 8},
    "split16": {"split_kv": 16},
    "split8_n256": {"split_kv": 8, "block_n": 256, "num_warps": 8},
    "split16_n256": {"split_kv": 16, "block_n": 256, "num_warps": 8},
}


def step_batch(specs: list[tuple[int, int]], prefix: int, device: torch.device) -> tuple[StepBatch, int, int]:
    """The step's metadata, its cache's blocks and its rows; ``prefix``: the first positions of every sequence in the
    same blocks (as prefix caching leaves them; 0: none), a decode step's walked once for several sequences."""
    prefix_blocks = prefix // PAGE
    next_block = prefix_blocks + 1
    tables, starts = [], [0]
    for length, rows in specs:
        n = -(-length // PAGE)
        own = n - prefix_blocks
        tables.append(list(range(1, prefix_blocks + 1)) + list(range(next_block, next_block + own)))
        next_block += own
        starts.append(starts[-1] + rows)
    table = torch.zeros(len(specs), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    batch = StepBatch(tokens=torch.empty(0), positions=torch.empty(0), slots=torch.empty(0),
                      query_start=torch.tensor(starts, device=device),
                      seq_lens=torch.tensor([length for length, _ in specs], device=device),
                      block_tables=table.to(device), logits_indices=torch.empty(0),
                      max_query_len=max(rows for _, rows in specs), block_size=PAGE,
                      shared_prefix=torch.tensor([prefix_blocks * PAGE], device=device),
                      decode_walks_shared=prefix > 0)  # fmt: skip
    return batch, next_block, starts[-1]


def engine_decode(batch: StepBatch, rows: int, device: torch.device) -> tuple[torch.Tensor, dict[str, Any]]:
    """A decode step's inputs as the model gives them to attention: the unrotated q/k/v projection, and the launch's
    rotary angles, each sequence's new token's slot and o_proj's quantized rows (triton_attention.Rope)."""
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * DIM, device=device, dtype=torch.bfloat16)
    angles = torch.rand(rows, DIM // 2, device=device) * 6
    last = batch.seq_lens - 1
    blocks = batch.block_tables.gather(1, (last // PAGE)[:, None].to(torch.int64))[:, 0]
    slots = blocks.to(torch.int64) * PAGE + last % PAGE
    return qkv, {"rope": current.Rope(angles.cos(), angles.sin(), slots, HEADS), "quantize_rows": rows}


def engine_output(kernel: ModuleType, meta: StepBatch, choices: dict[str, Any], qkv: torch.Tensor,
                  caches: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:  # fmt: skip
    """A decode launch's output as o_proj takes it, as bytes: its codes and scales, quantized by the launch or, where
    the launch left it unquantized, by quantize_groups as the model does."""
    out = kernel.paged_attention(qkv, *caches, meta, DIM**-0.5, **choices)
    rows = choices["quantize_rows"]
    parts = (out.q, out.scale) if isinstance(out, current.Quantized) else quantize_groups(out, rows)
    return [part.contiguous().view(torch.uint8) for part in parts]


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_attention", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, help="another triton_attention.py to time beside this tree's")
    parser.add_argument("--launches", default="", help="names from LAUNCHES, comma-separated")
    parser.add_argument("--splits", default="", help="names from SPLITS, comma-separated")
    parser.add_argument("--cases", default="", help="only the cases whose names start with one of these, e.g. decode")
    parser.add_argument("--engine-parts", action="store_true", help="decode's engine launch with one part each too")
    args = parser.parse_args()
    launches = {name: LAUNCHES[name] for name in filter(None, args.launches.split(","))}
    splits = {name: SPLITS[name] for name in filter(None, args.splits.split(","))}
    device = torch.device("cuda")
    baseline = load(args.baseline) if args.baseline else None
    results: dict[str, dict[str, float | bool]] = {}
    chosen = tuple(filter(None, args.cases.split(",")))
    for name, (specs, shared) in CASES.items():
        if chosen and not name.startswith(chosen):
            continue
        batch, blocks, rows = step_batch(specs, shared, device)
        caches = [(torch.randn(blocks * PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16),
                   torch.randn(blocks * PAGE, KV_HEADS, DIM, device=device, dtype=torch.bfloat16))
                  for _ in range(LAYERS)]  # fmt: skip
        q = torch.randn(rows, HEADS, DIM, device=device, dtype=torch.bfloat16)
        # label -> (kernel module, the step's metadata, launch choices, the queries: q, or decode's q/k/v projection)
        variants: dict[str, tuple[ModuleType, StepBatch, dict[str, Any], torch.Tensor]] = {
            "current": (current, batch, {}, q)
        }
        per_sequence = replace(batch, shared_prefix=None, decode_walks_shared=False)
        if shared:
            variants["per_sequence"] = (current, per_sequence, {}, q)
        if batch.max_query_len == 1:  # decode rows through the launch of a step with prompt rows, and as the model asks
            variants["as_mixed"] = (current, replace(batch, max_query_len=2), {}, q)
            if shared:
                as_mixed = replace(batch, max_query_len=2, shared_prefix=None)
                variants["as_mixed_per_sequence"] = (current, as_mixed, {}, q)
            qkv, as_engine = engine_decode(batch, rows, device)
            variants["engine"] = (current, batch, as_engine, qkv)
            if shared:
                variants["engine_per_sequence"] = (current, per_sequence, as_engine, qkv)
            if args.engine_parts:  # the engine's launch with one of its two parts: rotating and writing, quantizing
                rope_only = {"rope": as_engine["rope"]}
                variants["engine_rope"] = (current, batch, rope_only, qkv)
                variants["engine_quantize"] = (current, batch, {"quantize_rows": rows}, q)
                if shared:
                    variants["engine_rope_per_sequence"] = (current, per_sequence, rope_only, qkv)
                    variants["engine_quantize_per_sequence"] = (current, per_sequence, {"quantize_rows": rows}, q)
        if shared or batch.max_query_len > 1:  # steps with prompt rows, and decode rows walked with them
            walked_once = "as_mixed" if batch.max_query_len == 1 else "current"
            for choice, choices in launches.items():
                variants[f"{walked_once}+{choice}"] = (current, variants[walked_once][1], choices, q)
        if batch.max_query_len == 1:  # over a shared prefix: the walk a sequence so split
            for choice, choices in splits.items():
                label, meta = (f"per_sequence_{choice}", per_sequence) if shared else (choice, batch)
                variants[label] = (current, meta, choices, q)
        if baseline:
            variants["baseline"] = (baseline, batch, {}, q)
        row: dict[str, float | bool] = {}
        for turn in range(2):
            for label, (kernel, meta, choices, query) in variants.items():

                def step(kernel: ModuleType = kernel, meta: StepBatch = meta, choices: dict[str, Any] = choices,
                         query: torch.Tensor = query, caches: list[tuple[torch.Tensor, torch.Tensor]] = caches,
                         ) -> None:  # fmt: skip
                    for k, v in caches:
                        kernel.paged_attention(query, k, v, meta, DIM**-0.5, **choices)

                row[f"{label}_us" + ("_again" if turn else "")] = round(graphed_us(step, 5), 1)
        first = current.paged_attention(q, *caches[0], batch, DIM**-0.5).float()
        for label, (kernel, meta, choices, query) in variants.items():
            if label != "current" and query is q and "quantize_rows" not in choices:
                other = kernel.paged_attention(q, *caches[0], meta, DIM**-0.5, **choices).float()
                row[f"{label}_max_abs_difference"] = float((first - other).abs().max())
                row[f"{label}_identical"] = bool(torch.equal(first, other))
        if "engine_per_sequence" in variants:  # the shared walk's output against a walk a sequence, as o_proj takes it
            made = [engine_output(*variants[label], caches[0]) for label in ("engine", "engine_per_sequence")]
            row["engine_per_sequence_identical"] = all(map(torch.equal, *made))
        results[name] = row
        print(f"{name:52s} {row}", flush=True)
        del caches
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
