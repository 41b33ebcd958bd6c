"""`warmgate serve` on CPU: cold start vs warm restarts (phase by phase) and the gateway's added latency.

    .venv/bin/python bench/gateway_cpu.py --out bench/results   # writes gateway_cpu.json

Added latency: the same 1-token completion sent N times straight to the active engine's Unix socket and
N times through the gateway's HTTP port, the two paths in turn; p50/p99 of each.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": 1e3 * statistics.median(ordered), "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
            "mean_ms": 1e3 * statistics.fmean(ordered)}  # fmt: skip


def timed_requests(client: httpx.Client, n: int, body: dict[str, Any]) -> list[float]:
    out = []
    for _ in range(n):
        out.append(timed(client, body))
    return out


def timed(client: httpx.Client, body: dict[str, Any]) -> float:
    t = time.perf_counter()
    response = client.post("/v1/completions", json=body)
    seconds = time.perf_counter() - t
    response.raise_for_status()
    return seconds


def alternating(a: httpx.Client, b: httpx.Client, n: int, body: dict[str, Any]) -> tuple[list[float], list[float]]:
    """``n`` requests on each path, one after the other in turn: the machine's drift (a standby engine warming up,
    other work on two cores) weighs on both alike. Measured apart, one path after the other, the two medians
    moved by 6 ms between rounds here while the relay adds about 0.5 ms (bench/relay_cpu.py's stub)."""
    on_a, on_b = [], []
    for _ in range(n):
        on_a.append(timed(a, body))
        on_b.append(timed(b, body))
    return on_a, on_b


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from cache.checkpoint.demo import build_demo

        args.model = build_demo("fp8-block", progress=False)
    run_dir = Path(tempfile.mkdtemp(prefix="warmgate-bench-")) / "run"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(args.model), "--port", str(port),
           "--run-dir", str(run_dir)]  # fmt: skip
    log = run_dir.parent / "serve.log"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    result: dict[str, Any] = {"model": str(args.model)}
    try:
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/ready", timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        result["cold_start_s"] = time.perf_counter() - t0
        token = (run_dir / "admin-token").read_text().strip()
        admin = httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=300)
        status = admin.get("/admin/status").json()
        result["cold_start_first_engine"] = status["restarts"][0]
        result["cold_start_log"] = [line.split(" event=", 1)[1] for line in log.read_text().splitlines()
                                    if " event=" in line and "logger=warmgate.supervisor" in line]  # fmt: skip
        result["warm_restarts"] = [admin.post("/admin/restart", json={"strategy": s}).json()
                                   for s in ("overlap", "replace", "overlap", "replace")]  # fmt: skip

        status = admin.get("/admin/status").json()
        engine_socket = next(e["socket"] for e in status["engines"] if e["id"] == status["active"])
        body = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
        direct = httpx.Client(transport=httpx.HTTPTransport(uds=engine_socket), base_url="http://engine", timeout=60)
        gateway = httpx.Client(base_url=url, timeout=60)
        timed_requests(direct, 10, body)  # warm both paths
        timed_requests(gateway, 10, body)
        d, g = alternating(direct, gateway, args.requests, body)
        result["latency_1_token"] = {"requests": args.requests, "direct_engine_socket": percentiles(d),
                                     "through_gateway": percentiles(g)}  # fmt: skip
        p = result["latency_1_token"]
        p["added_p50_ms"] = p["through_gateway"]["p50_ms"] - p["direct_engine_socket"]["p50_ms"]
        p["added_p99_ms"] = p["through_gateway"]["p99_ms"] - p["direct_engine_socket"]["p99_ms"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    summary = {
        "cold_start_s": result["cold_start_s"],
        "first_engine": result["cold_start_first_engine"]["phases"],
        "warm": [(r["strategy"], r["weight_source"], r["phases"]) for r in result["warm_restarts"]],
        "latency": result["latency_1_token"],
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
