"""The cache process with real processes, on the GPU (the H200, through the device tool) or the CPU.

* ``four-path``: the demo checkpoint (fp8-block) on CUDA: disk load -> ipc-or-disk with no
  cache (falls back) -> ipc attach in a fresh engine -> a second ipc attach in another fresh
  engine while the first runs; greedy outputs compared, GPU memory per step.
* ``restarts``: a synthetic llama3-8b fp8-block checkpoint held by one cache process; one
  disk-loaded engine for comparison, then N engine restarts (fresh worker processes, weights
  attached): attach time, time to ready, device memory while each engine runs, outputs.

    python bench/cache_restarts.py --out $OUT restarts --model /path/llama3-8b-fp8-block --restarts 10
    python bench/cache_restarts.py --out $OUT four-path --model /path/smollm2-135m-instruct-fp8-block
    python bench/cache_restarts.py --device cpu --out bench/results restarts --model DEMO --restarts 5

Memory: on CUDA, the growth of the device's used memory while a process starts (NVML); on
CPU, the process's private memory (RssAnon) and the shared memory it maps (RssShmem).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from processes import Process, Worker, proc_status, start_cache, start_worker

from cache.client import CacheClient

PROMPTS = ["The capital of France is", "Write a haiku about the sea."]
ENGINE: dict[str, Any] = {"device": "cuda", "max_num_seqs": 4, "max_model_len": 1024}


def device_used_bytes() -> int:
    if ENGINE["device"] == "cpu":
        return 0
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used)


def generate(worker: Worker) -> list[str]:
    out = []
    with worker.sync_client() as client:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            response.raise_for_status()
            out.append(response.json()["choices"][0]["text"])
    return out


def health(worker: Worker) -> dict[str, Any]:
    with worker.sync_client() as client:
        return client.get("/health").json()  # type: ignore[no-any-return]


def engine_run(directory: Path, model: Path, name: str, **config: Any) -> tuple[Worker, dict[str, Any]]:
    """Start a worker, measure it, generate; the worker is left running."""
    used_before = device_used_bytes()
    t = time.perf_counter()
    worker = start_worker(directory, model, name, **ENGINE, **config)
    ready_s = time.perf_counter() - t
    h = health(worker)
    row = {
        "engine": name,
        "spawn_to_ready_s": round(ready_s, 3),
        "weights": h["weights"],
        "startup_phases_s": {k: round(v, 4) for k, v in h["startup_phases"].items()},
        "device_used_growth_bytes": device_used_bytes() - used_before,
        "outputs": generate(worker),
    }
    if ENGINE["device"] == "cpu":
        status = proc_status(worker.pid)
        row["rss_anon_bytes"], row["rss_shmem_bytes"] = status["RssAnon"], status["RssShmem"]
    print(json.dumps({k: v for k, v in row.items() if k != "outputs"}), flush=True)
    return worker, row


def four_path(model: Path, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    rows, running = [], []
    cache: Process | None = None
    try:
        worker, row = engine_run(work, model, "disk")
        rows.append(row)
        worker.stop()
        worker, row = engine_run(
            work, model, "fallback", weights="ipc-or-disk", cache_socket=work / "run" / "cache.sock"
        )
        rows.append(row)
        worker.stop()
        used = device_used_bytes()
        cache = start_cache(work, model, device=ENGINE["device"])
        with CacheClient(cache.socket) as client:
            stats, manifest = client.stats(), client.manifest()
        cache_row = {"bytes": stats.bytes, "device_used_growth_bytes": device_used_bytes() - used,
                     "qkv_layer": manifest.layers["model.layers.0.self_attn.qkv_proj"]}  # fmt: skip
        for name in ("ipc1", "ipc2"):
            worker, row = engine_run(work, model, name, weights="ipc", cache_socket=cache.socket)
            running.append(worker)
            rows.append(row)
        with CacheClient(cache.socket) as client:
            leases = client.stats().leases
    finally:
        for worker in running:
            worker.stop()
        if cache is not None:
            cache.stop()
    reference = rows[0]["outputs"]
    return {
        "model": str(model),
        "engines": rows,
        "cache": cache_row,
        "leases_with_both_running": len(leases),
        "identical_outputs": all(r["outputs"] == reference for r in rows),
        "sources": [r["weights"]["source"] for r in rows],
    }


def restarts(model: Path, work: Path, count: int) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    worker, disk = engine_run(work, model, "disk")
    worker.stop()
    used = device_used_bytes()
    t = time.perf_counter()
    cache = start_cache(work, model, device=ENGINE["device"])
    cache_ready_s = time.perf_counter() - t
    rows = []
    try:
        with CacheClient(cache.socket) as client:
            stats = client.stats()
        cache_growth = device_used_bytes() - used
        for i in range(count):
            worker, row = engine_run(work, model, f"ipc{i}", weights="ipc", cache_socket=cache.socket)
            worker.stop()
            rows.append(row)
        with CacheClient(cache.socket) as client:
            final = client.stats()
    finally:
        cache.stop()
    attach = [r["startup_phases_s"]["weight_load"] for r in rows]
    return {
        "model": str(model),
        "weight_bytes": stats.bytes,
        "cache_spawn_to_ready_s": round(cache_ready_s, 3),
        "cache_device_used_growth_bytes": cache_growth,
        "disk_engine": disk,
        "ipc_engines": rows,
        "attach_s": {"min": min(attach), "max": max(attach), "mean": sum(attach) / len(attach)},
        "identical_outputs": all(r["outputs"] == disk["outputs"] for r in rows),
        "all_ipc": all(r["weights"]["source"] == "ipc" for r in rows),
        "attach_count": final.attach_count,
        "leases_after": len(final.leases),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/warmgate-cache-bench"))
    parser.add_argument("step", choices=("four-path", "restarts"))
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--restarts", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    ENGINE["device"] = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    if args.step == "four-path":
        result = four_path(args.model, args.work / "four-path")
    else:
        result = restarts(args.model, args.work / "restarts", args.restarts)
    import torch

    result["device"] = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu (2 cores)"
    prefix = "gpu" if args.device.startswith("cuda") else "cpu"
    (args.out / f"{prefix}_cache_{args.step}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k not in ("engines", "ipc_engines", "disk_engine")}, indent=1))


if __name__ == "__main__":
    main()
