"""What an inference router sees of one gateway (docs/operations.md, "Many replicas"): the cost of a /metrics scrape,
and the router's metrics and /ready through an ``overlap`` and a ``replace`` restart under load.

    .venv/bin/python bench/router_view.py            # CPU, the fp8-block demo; about a minute here

A scraper reads /metrics every 50 ms (the endpoint picker's default interval) and a prober asks /ready every
0.1 s after its last answer, while clients stream short answers without pause; each restart is asked for once
the load is steady. Figures for docs/operations.md ("Many replicas").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from processes import Gateway, start_gateway
from prometheus_client.parser import text_string_to_metric_families

from app.metrics import ServingLoad, render
from cache.checkpoint.demo import build_demo
from common.heartbeat import Heartbeat

ROUTER = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "warmgate:num_requests_waiting")  # fmt: skip
SCRAPE_INTERVAL = 0.05
PROBE_PAUSE = 0.1


def router(text: str) -> dict[str, float]:
    return {f.name: f.samples[0].value for f in text_string_to_metric_families(text) if f.name in ROUTER}


async def clients(url: str, n: int, max_tokens: int, stop: asyncio.Event, outcomes: Counter[str]) -> None:
    body = {"prompt": "Count: one, two,", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}  # fmt: skip

    async def one() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            while not stop.is_set():
                try:
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        lines = [line async for line in response.aiter_lines()]
                    whole = response.status_code == 200 and "data: [DONE]" in lines
                    outcomes["ok" if whole and not any('"error"' in line for line in lines) else "failed"] += 1
                except httpx.HTTPError:
                    outcomes["failed"] += 1

    await asyncio.gather(*(one() for _ in range(n)))


async def scrape(url: str, stop: asyncio.Event, samples: list[tuple[float, float, dict[str, float]]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while not stop.is_set():
            began = time.perf_counter()
            text = (await http.get("/metrics")).text
            samples.append((time.monotonic(), time.perf_counter() - began, router(text)))
            await asyncio.sleep(SCRAPE_INTERVAL)


async def probe(url: str, stop: asyncio.Event, answers: list[tuple[float, float, int]]) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        while not stop.is_set():
            began = time.monotonic()
            status = (await http.get("/ready")).status_code
            answers.append((began, time.monotonic(), status))
            await asyncio.sleep(PROBE_PAUSE)


async def through_restart(gw: Gateway, strategy: str, n: int, max_tokens: int) -> dict[str, Any]:
    stop, outcomes = asyncio.Event(), Counter[str]()
    samples: list[tuple[float, float, dict[str, float]]] = []
    answers: list[tuple[float, float, int]] = []
    tasks = [
        asyncio.create_task(clients(gw.url, n, max_tokens, stop, outcomes)),
        asyncio.create_task(scrape(gw.url, stop, samples)),
        asyncio.create_task(probe(gw.url, stop, answers)),
    ]
    await asyncio.sleep(5)
    began = time.monotonic()
    report = (await asyncio.to_thread(gw.admin, "POST", "/admin/restart", json={"strategy": strategy})).json()
    ended = time.monotonic()
    await asyncio.sleep(3)
    stop.set()
    await asyncio.gather(*tasks)
    before = [m for t, _, m in samples if began - 3 <= t < began]
    during = [m for t, _, m in samples if began <= t <= ended]

    def span(name: str, window: list[dict[str, float]]) -> list[float]:
        return [min(m[name] for m in window), max(m[name] for m in window)] if window else []

    overlapping = [status for start, end, status in answers if end >= began and start <= ended]
    return {
        "strategy": strategy,
        "ok": report["ok"],
        "seconds": round(report["phases"]["total"], 2),
        "requests": dict(outcomes),
        "scrapes_during": len(during),
        "ready_answers_during": dict(Counter(overlapping)),
        "slowest_ready_s": round(max(end - start for start, end, _ in answers), 2),
        "before": {name: span(name, before) for name in ROUTER},
        "during": {name: span(name, during) for name in ROUTER},
        "scrape_ms_median": round(statistics.median(dt for _, dt, _ in samples) * 1e3, 2),
    }


def costs(run_dir: Path, n: int = 2000) -> dict[str, float]:
    """In this process, on the gateway's own files: rendering a scrape (CPU), an engine's write, a relay's read."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(run_dir / "metrics")
    serving = ServingLoad(running=4, waiting=4, kv_usage=0.25, block_size=16, kv_blocks=1024, model_name="demo")
    cpu = {}
    for name, argument in (("render_ms", None), ("render_with_router_ms", serving)):
        began = time.process_time()
        for _ in range(200):
            render(argument)
        cpu[name] = round((time.process_time() - began) / 200 * 1e3, 2)
    beat = Heartbeat.create(Path(tempfile.mkdtemp()) / "engine.beat")
    beat.describe("demo", 16, 1024)
    began = time.perf_counter()
    for _ in range(n):
        beat.publish(4, 4, 256)
    cpu["publish_us"] = round((time.perf_counter() - began) / n * 1e6, 2)
    began = time.perf_counter()
    for _ in range(n):
        beat.load()
    cpu["load_us"] = round((time.perf_counter() - began) / n * 1e6, 2)
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="router-view-"))
    config = (f'model = "{build_demo("fp8-block", progress=False)}"\nserved_model_name = "demo"\n\n'
              "[gateway]\nworkers = 2\n\n[engine]\nmax_num_seqs = 4\nmax_model_len = 1024\n\n"
              "[restart]\nstandby = 1\nqueue_timeout = 120\n")  # fmt: skip
    gw = start_gateway(root, config)
    try:
        results = [asyncio.run(through_restart(gw, s, args.clients, args.max_tokens)) for s in ("overlap", "replace")]
        print(json.dumps(costs(gw.run_dir)))
        for result in results:
            print(json.dumps(result))
    finally:
        gw.stop()


if __name__ == "__main__":
    main()
