"""`warmgate serve` under load, measured like vLLM's benchmark_serving: TTFT, TPOT and output tok/s per concurrency.

    # CPU (the demo model, built on first use; a small sweep):
    .venv/bin/python bench/serve_load.py --device cpu --concurrency 1,4 --requests-per-client 2 --output-len 16 \
        --prompt-len 40 --restart-probe 3 --max-num-seqs 8 --max-model-len 512 --out /tmp/serve_load_cpu
    # GPU:
    python3 bench/serve_load.py --model /tmp/wg/llama3-8b-fp8-block --device cuda --max-num-seqs 128 --out $OUT
    # A gateway that is already running (the restart probe reads RUN_DIR/admin-token):
    .venv/bin/python bench/serve_load.py --url http://127.0.0.1:8000 --run-dir /tmp/warmgate --out /tmp/serve_load

The script writes a TOML config from its flags, starts `python -m app.cli serve` (log: OUT/serve.log), waits for
GET /ready, then: N sequential requests right after the first ready (first requests after an engine start); a
closed-loop sweep (C workers sending streamed /v1/completions back to back; distinct random token-id prompts,
temperature 0, ignore_eos, usage in the last chunk); POST /admin/restart (overlap) and N sequential requests again.
Writes OUT/serve_load.json (config, per-level stats, every request's samples) and OUT/serve_load.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pct(samples: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation as numpy's default; None for no samples."""
    if not samples:
        return None
    s = sorted(samples)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms_stats(samples: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean of samples in seconds, as milliseconds."""
    out = {f"p{q}_ms": None if (v := pct(samples, q)) is None else 1e3 * v for q in (50, 90, 99)}
    out["mean_ms"] = 1e3 * statistics.fmean(samples) if samples else None
    return out


def toml_literal(text: str) -> str:
    """TOML text for an --engine-set value: the value itself if it is a TOML literal, else a quoted string."""
    try:
        tomllib.loads(f"v = {text}")
        return text
    except tomllib.TOMLDecodeError:
        return json.dumps(text)


def write_config(args: argparse.Namespace, path: Path) -> str:
    engine: dict[str, str] = {"device": json.dumps(args.device), "max_num_seqs": str(args.max_num_seqs),
                              "weights": json.dumps(args.weights)}  # fmt: skip
    if args.max_model_len is not None:
        engine["max_model_len"] = str(args.max_model_len)
    if args.kv_cache_bytes is not None:
        engine["kv_cache_bytes"] = str(args.kv_cache_bytes)
    for item in args.engine_set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--engine-set {item!r}: expected key=value")
        engine[key.strip()] = toml_literal(value.strip())
    text = "[engine]\n" + "".join(f"{k} = {v}\n" for k, v in engine.items())
    tomllib.loads(text)  # refuse here rather than in the server
    path.write_text(text)
    return text


def prompt_source(args: argparse.Namespace) -> Callable[[], list[int]]:
    """Distinct random token-id prompts, lengths uniform in prompt_len ± jitter, from a seeded RNG."""
    rng, seen = random.Random(args.seed), set()

    def next_prompt() -> list[int]:
        while True:
            n = rng.randint(max(1, args.prompt_len - args.prompt_jitter), args.prompt_len + args.prompt_jitter)
            ids = tuple(rng.randrange(1000, args.vocab - 1000) for _ in range(n))
            if ids not in seen:
                seen.add(ids)
                return list(ids)

    return next_prompt


async def one_request(client: httpx.AsyncClient, prompt: list[int], output_len: int, t0: float) -> dict[str, Any]:
    """One streamed completion: start (s since t0), TTFT, inter-chunk gaps, output tokens, ok/error."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    rec: dict[str, Any] = {"start": 0.0, "prompt_len": len(prompt), "ttft": None, "itl": [], "latency": None,
                           "output_tokens": 0, "ok": False, "error": None}  # fmt: skip
    start = time.perf_counter()
    rec["start"] = start - t0
    times: list[float] = []
    usage_tokens = None
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                rec["error"] = f"HTTP {response.status_code}: {(await response.aread())[:300].decode(errors='replace')}"
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        rec["error"] = f"error event: {json.dumps(event['error'])[:300]}"
                        break
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    choice = (event.get("choices") or [{}])[0]
                    if choice.get("text") or choice.get("token_ids"):
                        times.append(time.perf_counter())
    except Exception as exc:  # a benchmark records failures instead of stopping
        rec["error"] = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()
    rec["latency"] = end - start
    rec["end"] = end - t0
    rec["output_tokens"] = usage_tokens if usage_tokens is not None else len(times)
    if times:
        rec["ttft"] = times[0] - start
        rec["itl"] = [round(b - a, 6) for a, b in itertools.pairwise(times)]
        if rec["output_tokens"] > 1:
            rec["tpot"] = (times[-1] - times[0]) / (rec["output_tokens"] - 1)
    if rec["error"] is None:
        if not done:
            rec["error"] = "stream ended without [DONE]"
        elif rec["output_tokens"] < output_len:
            rec["error"] = f"{rec['output_tokens']} tokens < {output_len} asked"
        elif rec["ttft"] is None:
            rec["error"] = "no content chunk"
    rec["ok"] = rec["error"] is None
    return rec


async def closed_loop(client: httpx.AsyncClient, prompts: list[list[int]], concurrency: int, output_len: int,
                      t0: float) -> list[dict[str, Any]]:  # fmt: skip
    """The prompts' requests, `concurrency` workers each sending the next one as soon as its previous one ended."""
    queue = iter(prompts)

    async def worker() -> list[dict[str, Any]]:
        return [await one_request(client, prompt, output_len, t0) for prompt in queue]

    return [r for rs in await asyncio.gather(*(worker() for _ in range(concurrency))) for r in rs]


def level_stats(concurrency: int, recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if r["ok"]]
    wall = max(r["end"] for r in recs) - min(r["start"] for r in recs)
    tokens = sum(r["output_tokens"] for r in recs)
    return {
        "concurrency": concurrency, "requests": len(recs), "errors": len(recs) - len(ok), "wall_s": wall,
        "output_tokens": tokens, "output_tok_s": tokens / wall, "request_s": len(recs) / wall,
        "ttft": ms_stats([r["ttft"] for r in ok]), "tpot": ms_stats([r["tpot"] for r in ok if "tpot" in r]),
        "itl": ms_stats([g for r in ok for g in r["itl"]]), "latency": ms_stats([r["latency"] for r in ok]),
        "mean_prompt_len": statistics.fmean(r["prompt_len"] for r in recs),
    }  # fmt: skip


def device_name(logs: list[Path], device: str) -> str:
    for path in logs:
        text = path.read_text(errors="replace") if path.exists() else ""
        if m := re.search(r"\b(?:device_name|gpu_name|gpu)=(\"[^\"]*\"|\S+)", text):
            return m.group(1).strip('"')
    if shutil.which("nvidia-smi") and device.startswith("cuda"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=False)  # fmt: skip
        if smi.returncode == 0 and smi.stdout.strip():
            return smi.stdout.strip().splitlines()[0]
    cpu = Path("/proc/cpuinfo")
    m = re.search(r"model name\s*:\s*(.+)", cpu.read_text()) if cpu.exists() else None
    return f"cpu: {m.group(1).strip() if m else 'unknown'}"


def git_commit() -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=False).stdout.strip()

    return git("rev-parse", "HEAD") + (" (dirty)" if git("status", "--porcelain") else "")


def probe_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Each probe's TTFTs against the steady-state TTFT p50 at the lowest concurrency swept (normally 1)."""
    if not result["levels"]:
        return {}
    base = min(result["levels"], key=lambda s: s["concurrency"])
    out: dict[str, Any] = {"baseline_concurrency": base["concurrency"], "baseline_ttft_p50_ms": base["ttft"]["p50_ms"]}
    for key in ("probe_after_ready", "probe_after_restart"):
        if key in result:
            ttfts = [None if r["ttft"] is None else 1e3 * r["ttft"] for r in result[key]]
            values = [v for v in ttfts if v is not None]
            p50 = base["ttft"]["p50_ms"]
            out[key] = {"ttft_ms": ttfts, "errors": sum(not r["ok"] for r in result[key]),
                        "max_over_p50": max(values) / p50 if values and p50 else None}  # fmt: skip
    return out


async def bench(args: argparse.Namespace, url: str, run_dir: Path | None, result: dict[str, Any]) -> None:
    prompts = prompt_source(args)
    top = max(args.concurrency)
    limits = httpx.Limits(max_connections=top + 16, max_keepalive_connections=top + 16)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        t0 = time.perf_counter()

        async def run(n: int, concurrency: int) -> list[dict[str, Any]]:
            return await closed_loop(client, [prompts() for _ in range(n)], concurrency, args.output_len, t0)

        if args.restart_probe:
            say(f"first {args.restart_probe} requests after the server became ready ...")
            result["probe_after_ready"] = await run(args.restart_probe, 1)
        for c in args.concurrency:
            warm = args.warmup if args.warmup is not None else c
            n = max(c * args.requests_per_client, 16)
            say(f"concurrency {c}: {warm} warm-up, then {n} requests ...")
            warmup = await run(warm, c) if warm else []
            recs = await run(n, c)
            stats = level_stats(c, recs)
            result["levels"].append({**stats, "warmup_errors": sum(not r["ok"] for r in warmup), "samples": recs})
            ttft, tpot = stats["ttft"]["p50_ms"] or 0, stats["tpot"]["p50_ms"] or 0
            say(f"  {stats['errors']} errors, {stats['output_tok_s']:.1f} output tok/s, {stats['request_s']:.2f} req/s,"
                f" TTFT p50 {ttft:.1f} ms, TPOT p50 {tpot:.1f} ms")  # fmt: skip
            if errors := [r["error"] for r in recs if r["error"]]:
                say(f"  first error: {errors[0]}")
        if not args.restart_probe:
            return
        token = os.environ.get("WARMGATE_ADMIN_TOKEN")
        if run_dir is not None and (run_dir / "admin-token").exists():
            token = (run_dir / "admin-token").read_text().strip()
        if token is None:
            say("restart probe skipped: no admin token (give --run-dir or WARMGATE_ADMIN_TOKEN)")
            return
        say("POST /admin/restart (overlap) ...")
        t = time.perf_counter()
        response = await client.post("/admin/restart", json={"strategy": "overlap"},
                                     headers={"authorization": f"Bearer {token}"})  # fmt: skip
        try:
            report = response.json()
        except ValueError:
            report = {"body": response.text[:2000]}
        result["restart"] = {"status": response.status_code, "seconds": time.perf_counter() - t, "report": report}
        say(f"  {response.status_code} in {result['restart']['seconds']:.2f} s: {response.text[:400]}")
        result["probe_after_restart"] = await run(args.restart_probe, 1)


def markdown(result: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    lines = [f"warmgate serve_load: {result['model']} on {result['device_name']} ({result['date']}, "
             f"{result['git_commit']})", "", f"prompt ~{result['args']['prompt_len']} tokens, "
             f"output {result['args']['output_len']} tokens, ignore_eos, temperature 0", "",
             "| concurrency | requests | errors | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in result["levels"]:
        lines.append(f"| {s['concurrency']} | {s['requests']} | {s['errors']} | {s['output_tok_s']:.1f} | "
                     f"{ms(s['ttft']['p50_ms'])} | {ms(s['ttft']['p99_ms'])} | {ms(s['tpot']['p50_ms'])} | "
                     f"{ms(s['tpot']['p99_ms'])} |")  # fmt: skip
    lines.append("\n(TTFT and TPOT in ms)\n")
    summary = result.get("probe_summary") or {}
    if summary:
        lines.append(f"First requests after an engine start, one at a time (steady TTFT p50 at concurrency "
                     f"{summary['baseline_concurrency']}: {ms(summary['baseline_ttft_p50_ms'])} ms):")  # fmt: skip
    for key, name in (("probe_after_ready", "after the server first became ready"),
                      ("probe_after_restart", "after POST /admin/restart (overlap)")):  # fmt: skip
        if key in summary:
            probe = summary[key]
            ratio = "n/a" if probe["max_over_p50"] is None else f"{probe['max_over_p50']:.2f}"
            lines.append(f"- {name}: TTFT ms [{', '.join(ms(v) for v in probe['ttft_ms'])}], "
                         f"{probe['errors']} errors; max / steady p50 = {ratio}")  # fmt: skip
    if "restart" in result:
        rep = result["restart"]["report"]
        lines.append(f"- restart: HTTP {result['restart']['status']} in {result['restart']['seconds']:.2f} s, "
                     f"weights {rep.get('weight_source')}, phases {json.dumps(rep.get('phases'))}")  # fmt: skip
    if "failed" in result:
        lines.append(f"\n**Incomplete run:** {result['failed']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the fp8-block demo)")
    p.add_argument("--url", help="benchmark a gateway that is already running (no server is started)")
    p.add_argument("--run-dir", type=Path, help="the server's run dir (default: a new temporary one)")
    p.add_argument("--port", type=int, help="default: a free one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-bytes", type=int)
    p.add_argument("--weights", default="ipc-or-disk", choices=("ipc", "ipc-or-disk", "disk"))
    p.add_argument("--engine-set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other [engine] setting, the value as a TOML literal (repeatable)")  # fmt: skip
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 32, 64, 128])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--warmup", type=int, help="warm-up requests per level (default: one per worker)")
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--prompt-jitter", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn from [1000, vocab-1000)")
    p.add_argument("--restart-probe", type=int, default=10, help="sequential requests after start and restart")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "git_commit": git_commit(), "levels": []}  # fmt: skip
    proc = None
    run_dir = args.run_dir
    logs = [args.out / "serve.log"]
    if args.url is None:
        if args.model is None:
            sys.path.insert(0, str(ROOT))
            from cache.checkpoint.demo import build_demo

            args.model = build_demo("fp8-block", progress=False)
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="warmgate-load-")) / "run"
        port = args.port or free_port()
        url = f"http://127.0.0.1:{port}"
        config = args.out / "serve_load.toml"
        result["config_toml"] = write_config(args, config)
        cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(args.model), "--port", str(port),
               "--run-dir", str(run_dir), "--config", str(config)]  # fmt: skip
        say(f"starting: {' '.join(cmd)} (log {logs[0]})")
        t0 = time.perf_counter()
        with logs[0].open("wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    else:
        url = args.url.rstrip("/")
        t0 = time.perf_counter()
    result["model"], result["url"] = str(args.model or "(running gateway)"), url
    try:
        while True:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}):\n{logs[0].read_text()[-4000:]}")
            if time.perf_counter() - t0 > 600:
                raise SystemExit(f"not ready after 600 s:\n{logs[0].read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/ready", timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        result["ready_s"] = time.perf_counter() - t0
        say(f"ready after {result['ready_s']:.1f} s")
        asyncio.run(bench(args, url, run_dir, result))
    except BaseException as exc:  # still write what was measured (a long GPU sweep is worth keeping)
        result["failed"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the server's own process group: its cache and engines
                proc.wait()
        if run_dir is not None and run_dir.exists():
            for path in sorted(run_dir.glob("*.log")):
                shutil.copy(path, args.out / path.name)
                logs.append(args.out / path.name)
        result["device_name"] = device_name(logs, args.device)
        result["probe_summary"] = probe_summary(result)
        (args.out / "serve_load.json").write_text(json.dumps(result, indent=1) + "\n")
        table = markdown(result)
        (args.out / "serve_load.md").write_text(table)
        say(table)


if __name__ == "__main__":
    main()
