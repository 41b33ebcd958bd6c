"""Does a step run slower back to back than with pauses? (H200 diagnostic: clocks and power)

Llama-3-8B's four layer GEMMs at 1,024 rows through cuBLAS' blockwise FP8 scaled_mm, as a 1,024-token step runs
them, 32 layers (14.3 TFLOP), timed three ways for ``--seconds`` each: one CUDA graph of the 32 layers replayed back
to back; the same graph with a pause after each replay (``--pause-ms``); the 128 GEMMs launched eagerly, back to back.
With ``--model``, instead: the engine's decode graphs at ``--batches`` sequences (~300 positions each), back to back
and with pauses. Each replay or eager pass is timed with CUDA events. nvidia-smi samples the SM clock, the power draw
and the active clock-event (throttle) reasons every 50 ms meanwhile; each mode reports the samples in its window.

    PYTHONPATH=/tmp/site:$PWD python3 bench/prefill_clocks_probe.py --out $OUT/prefill_clocks.json
    # not run yet (docs/benchmarks.md, thirty-second session):
    PYTHONPATH=/tmp/site:$PWD python3 bench/prefill_clocks_probe.py --out $OUT/decode_clocks.json \
        --model /tmp/wg/llama3-8b-fp8-block --batches 1,64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.native.triton_fp8 import quantize_groups

GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS = 32
QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"


def layer_chain(rows: int) -> Callable[[], None]:
    """32 layers' four blockwise FP8 GEMMs of ``rows`` rows (one weight set: at 1,024 rows they are compute-bound)."""
    from torch.nn.functional import ScalingType, scaled_mm

    calls = []
    for n, k in GEMMS.values():
        w = (torch.randn(n, k, device="cuda") / 4).to(torch.float8_e4m3fn)
        s = torch.rand(n // 128, k // 128, device="cuda") + 0.5
        xq, xs = quantize_groups(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), rows)
        calls.append((xq, w, xs, s))

    def run() -> None:
        for _ in range(LAYERS):
            for xq, w, xs, s in calls:
                scaled_mm(xq, w.t(), xs, ScalingType.BlockWise1x128, s.t(), ScalingType.BlockWise128x128,
                          output_dtype=torch.bfloat16)  # fmt: skip

    return run


def decode_engine(model: Path) -> Any:
    """An engine of ``model`` with the serving benchmarks' settings (bench/gpu_step_profile.py's)."""
    from engine.config import EngineConfig
    from engine.native.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, device="cuda", max_num_seqs=128, max_model_len=2048,
                                  max_num_batched_tokens=1024, kv_cache_bytes=20 * 10**9))  # fmt: skip


def decode_graph(engine: Any, batch: int) -> Callable[[], None]:
    """The replay of the engine's decode graph for ``batch`` sequences, ``batch`` sequences of ~300 positions now
    admitted in place of whatever ran before (a smaller graph replayed later reads the first of them)."""
    from bench.gpu_step_profile import clear, fill

    clear(engine)
    fill(engine, batch, torch.Generator().manual_seed(batch), 300)
    for _ in range(3):
        engine._step()
    torch.cuda.synchronize()
    bucket = next(b for b in engine.runner.decode_sizes if b >= batch)
    return engine.runner.graphs[("decode", bucket)][0].replay  # type: ignore[no-any-return]


def timed(step: Callable[[], None], seconds: float, pause_s: float) -> list[float]:
    """ms of each ``step`` (CUDA events around it) over ``seconds``, ``pause_s`` of host sleep after each."""
    pairs = []
    end_at = time.monotonic() + seconds
    while time.monotonic() < end_at:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        pairs.append((start, end))
        if pause_s:
            end.synchronize()
            time.sleep(pause_s)
        elif len(pairs) % 8 == 0:
            pairs[-4][1].synchronize()  # keep the host a few steps ahead, never far
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in pairs]


def samples(path: Path, t0: float, t1: float) -> dict[str, object]:
    """nvidia-smi's samples between host times t0 and t1: SM MHz and watts (median, min), throttle reasons seen."""
    clocks, watts, reasons = [], [], set()
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            stamp = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            stamp += float("0." + parts[0].split(".")[1]) if "." in parts[0] else 0.0
        except ValueError:
            continue
        if t0 <= stamp <= t1:
            clocks.append(float(parts[1]))
            watts.append(float(parts[2]))
            reasons.add(parts[4])
    if not clocks:
        return {"samples": 0}
    return {"samples": len(clocks), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "watts_median": statistics.median(watts), "watts_max": max(watts), "reasons": sorted(reasons)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--pause-ms", type=float, default=20.0)
    parser.add_argument("--model", type=Path, help="time the engine's decode graphs of this model instead")
    parser.add_argument("--batches", default="1,64")
    args = parser.parse_args()
    tflop = 0.0 if args.model else LAYERS * 2 * args.rows * sum(n * k for n, k in GEMMS.values()) / 1e12
    modes: dict[str, tuple[Callable[[], None], float]] = {}
    if args.model:
        engine = decode_engine(args.model)  # alive until the end: its graphs are what is timed
        for batch in (int(b) for b in args.batches.split(",")):
            replay = decode_graph(engine, batch)
            modes[f"decode {batch} back to back"] = (replay, 0.0)
            modes[f"decode {batch} with pauses"] = (replay, args.pause_ms / 1e3)
    else:
        chain = layer_chain(args.rows)
        chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        graph.replay()
        torch.cuda.synchronize()
        modes = {"graph back to back": (graph.replay, 0.0), "graph with pauses": (graph.replay, args.pause_ms / 1e3),
                 "eager back to back": (chain, 0.0), "graph back to back again": (graph.replay, 0.0)}  # fmt: skip
    log = args.out.with_suffix(".smi.csv")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=log.open("w"), stderr=subprocess.DEVNULL)  # fmt: skip
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "rows": args.rows, "tflop": tflop}
    try:
        time.sleep(1.0)
        idle = (time.time() - 0.9, time.time())
        for name, (step, pause) in modes.items():
            t0 = time.time()
            ms = timed(step, args.seconds, pause)
            t1 = time.time()
            time.sleep(1.0)
            tail = ms[len(ms) // 2 :]
            median = statistics.median(ms)
            result[name] = {"steps": len(ms), "first_ms": round(ms[0], 3), "median_ms": round(median, 3),
                            "second_half_median_ms": round(statistics.median(tail), 3),
                            **({"tflops_median": round(tflop / median * 1e3, 1)} if tflop else {}),
                            "_window": (t0, t1)}  # fmt: skip
            print(name, {k: v for k, v in result[name].items() if k != "_window"}, flush=True)  # type: ignore[union-attr]
    finally:
        smi.terminate()
        smi.wait()
    result["idle"] = samples(log, *idle)
    for name in modes:
        entry = result[name]
        entry.update(samples(log, *entry.pop("_window")))  # type: ignore[union-attr]
        print(name, entry, flush=True)
    print("idle", result["idle"], flush=True)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
