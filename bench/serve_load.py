"""`warmgate serve` under load, measured like vLLM's benchmark_serving: TTFT, TPOT and output tok/s per concurrency,
failed requests, engines killed and the gateway's CPU time per output token.

    # CPU (the demo model, built on first use; a small sweep, one direct level on the engine socket):
    .venv/bin/python bench/serve_load.py --device cpu --concurrency 1,4,16 --requests-per-client 1 --output-len 8 \
        --prompt-len 40 --restart-probe 3 --max-num-seqs 8 --max-model-len 512 --direct-concurrency 4 \
        --client-procs 4 --out /tmp/serve_load_cpu
    # GPU, the H200 acceptance run (`bash bench/gpu_serving.sh setup serve` runs this, under `timeout 480`):
    python3 bench/serve_load.py --model /tmp/wg/llama3-8b-fp8-block --device cuda --max-num-seqs 128 \
        --kv-cache-bytes 20000000000 --concurrency 64,128,256,512,1024 --requests-per-client 4,4,2,2,2 \
        --direct-concurrency 64 --restart-probe 10 --deadline-s 420 --out $OUT
    # A gateway that is already running (/admin/status, the direct level and the restart probe read
    # RUN_DIR/admin-token; the serve log, if given, is scanned for engine_hung and the like):
    .venv/bin/python bench/serve_load.py --url http://127.0.0.1:8000 --run-dir /tmp/warmgate --serve-log serve.log \
        --out /tmp/serve_load

The script writes a TOML config from its flags ([engine] from --max-num-seqs etc. and --engine-set, [restart] and
[gateway] only from --restart-set / --gateway-set: their defaults otherwise), raises its open-files limit to the hard
limit (the server inherits it), starts `python -m app.cli serve` (log: OUT/serve.log) and waits for GET /ready. Then:
N sequential requests right after the first ready (first requests after an engine start); a closed-loop sweep (C
streams sending streamed /v1/completions back to back: distinct random token-id prompts, temperature 0, ignore_eos,
usage in the last chunk; with --chat, streamed /v1/chat/completions of text), once the standby engines have started;
the same load at --direct-concurrency straight to the active engine's Unix socket (from /admin/status), right after
the gateway level of the same concurrency; POST /admin/restart (overlap) and N sequential requests again. Each
level: one warm-up request per stream (--warmup), then max(C x requests-per-client, 16) counted ones.

The load client is --client-procs processes (spawned), each an asyncio client (a small HTTP/1.1 client over TCP or a
Unix socket, keep-alive; or httpx with --client httpx) running its share of the C streams; every request's samples
come back to this process. A stream counts as OK only with `[DONE]`, no error event and usage.completion_tokens ==
--output-len.

Per level: output tok/s, TTFT, TPOT, ITL, failed requests; engine restarts with reason crash (/admin/status `restarts`
before and after the level) and `event=...` lines in the logs during the level (engine_hung, engine_crashed, ...);
CPU time (utime+stime, /proc/PID/stat) over the counted requests' window, per output token: the gateway's relays
(summed) and supervisor (status `relays` / `supervisor`), or, for a gateway without relays, the `warmgate serve`
process itself; the active engine, the cache and the client processes too. From the engines' `event=request` lines
(engine/server.py), on the clients' clock: each level's TTFT inside the engine (from its front's receipt), the way in
(a client's send to that receipt) and the way back (the engine's first text to the client's). Every level's results
are written as soon as it ends; SIGTERM (a `timeout` around the run) still writes what was measured and stops the
server.
Writes OUT/serve_load.json (config, per-level stats, every request's samples) and OUT/serve_load.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.proctitle import ENGINE_THREAD_NAME

CLK_TCK = os.sysconf("SC_CLK_TCK")
EVENT = re.compile(rb"\bevent=([A-Za-z_][\w.]*)")
FIELD = re.compile(rb"\b(\w+)=([^\s\"]+)")


def say(*parts: Any) -> None:
    print(*parts, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def raise_nofile() -> tuple[int, int]:
    """Raise this process's open-files soft limit to the hard limit (1024 streams need more than 1024 sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (hard, 1 << 20, 65536):
        if want == resource.RLIM_INFINITY or want <= soft or (hard != resource.RLIM_INFINITY and want > hard):
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


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
    """TOML text for a --*-set value: the value itself if it is a TOML literal, else a quoted string."""
    try:
        tomllib.loads(f"v = {text}")
        return text
    except tomllib.TOMLDecodeError:
        return json.dumps(text)


def write_config(args: argparse.Namespace, path: Path) -> str:
    engine: dict[str, str] = {"device": json.dumps(args.device), "weights": json.dumps(args.weights)}
    if args.max_num_seqs:
        engine["max_num_seqs"] = str(args.max_num_seqs)
    if args.max_model_len is not None:
        engine["max_model_len"] = str(args.max_model_len)
    if args.kv_cache_bytes is not None:
        engine["kv_cache_bytes"] = str(args.kv_cache_bytes)
    sections: dict[str, dict[str, str]] = {"engine": engine, "restart": {}, "gateway": {}}
    for section, items in (("engine", args.engine_set), ("restart", args.restart_set), ("gateway", args.gateway_set)):
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise SystemExit(f"--{section}-set {item!r}: expected key=value")
            sections[section][key.strip()] = toml_literal(value.strip())
    text = "\n".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in values.items())
                     for name, values in sections.items() if values or name == "engine")  # fmt: skip
    tomllib.loads(text)  # refuse here rather than in the server
    path.write_text(text)
    return text


Prompt = list[int] | dict[str, Any]  # token ids (a completion), or a chat's {"messages": ..., "tokens": ...}


def prompt_source(args: argparse.Namespace) -> Callable[[], Prompt]:
    """Distinct random token-id prompts, lengths uniform in prompt_len ± jitter, from a seeded RNG; with
    --shared-prefix N, each after the same N random tokens (a system prompt every request shares). With --chat,
    chat messages instead (chat_source)."""
    if args.chat:
        return chat_source(args)
    rng, seen = random.Random(args.seed), set()
    prefix = tuple(rng.randrange(1000, args.vocab - 1000) for _ in range(args.shared_prefix))

    def next_prompt() -> list[int]:
        while True:
            n = rng.randint(max(1, args.prompt_len - args.prompt_jitter), args.prompt_len + args.prompt_jitter)
            ids = prefix + tuple(rng.randrange(1000, args.vocab - 1000) for _ in range(n))
            if ids not in seen:
                seen.add(ids)
                return list(ids)

    return next_prompt


def chat_source(args: argparse.Namespace) -> Callable[[], Prompt]:
    """Chat requests as text, as a chat client sends them: a system message of --shared-prefix words every request
    shares, then a user message of its own, prompt_len ± jitter words, distinct. The words are the model tokenizer's
    (CHECKPOINT/tokenizer.json) lowercase ones that are one token after a space, so a message of N words is N
    tokens; ``tokens``: the two messages' tokens, as the tokenizer counts them (the chat template adds its own)."""
    from tokenizers import Tokenizer

    path = (args.model or Path("(no --model)")) / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"--chat: no tokenizer at {path} (give --model, the checkpoint the server runs)")
    tokenizer = Tokenizer.from_file(str(path))
    rng, seen = random.Random(args.seed), set()
    candidates = sorted(w for w in tokenizer.get_vocab() if w.isascii() and w.isalpha() and w.islower() and len(w) > 2)
    encoded = tokenizer.encode_batch([" " + w for w in candidates], add_special_tokens=False)
    words = [w for w, e in zip(candidates, encoded, strict=True) if len(e.ids) == 1]
    if len(words) < 1000:
        raise SystemExit(f"--chat: only {len(words)} one-token words in {path}")
    system = " ".join(rng.choice(words) for _ in range(args.shared_prefix))
    shared = [{"role": "system", "content": system}] if system else []
    shared_tokens = len(tokenizer.encode(system, add_special_tokens=False).ids) if system else 0

    def next_prompt() -> Prompt:
        while True:
            n = rng.randint(max(1, args.prompt_len - args.prompt_jitter), args.prompt_len + args.prompt_jitter)
            question = " ".join(rng.choice(words) for _ in range(n))
            if question not in seen:
                seen.add(question)
                tokens = shared_tokens + len(tokenizer.encode(question, add_special_tokens=False).ids)
                return {"messages": [*shared, {"role": "user", "content": question}], "tokens": tokens}

    return next_prompt


# -- the load client (runs in each client process) --------------------------------------------------------------


class Stream:
    """One request's SSE stream, fed line by line: token times, usage, [DONE], the first error."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.usage_tokens: int | None = None
        self.done = False
        self.error: str | None = None

    def line(self, line: str) -> bool:
        """Take one line; True once the stream is over ([DONE] or an error event)."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return True
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"bad event: {data[:300]}"
            return True
        if "error" in event:
            self.error = f"error event: {json.dumps(event['error'])[:300]}"
            return True
        if event.get("usage"):
            self.usage_tokens = event["usage"].get("completion_tokens")
        choice = (event.get("choices") or [{}])[0]
        if choice.get("text") or choice.get("token_ids") or (choice.get("delta") or {}).get("content"):
            self.times.append(time.monotonic())
        return False


def finish_record(rec: dict[str, Any], stream: Stream, start: float, output_len: int) -> dict[str, Any]:
    end = time.monotonic()
    times = stream.times
    rec.update(start=start, end=end, latency=end - start, content_chunks=len(times), usage_tokens=stream.usage_tokens,
               output_tokens=stream.usage_tokens if stream.usage_tokens is not None else len(times))  # fmt: skip
    if times:
        rec["ttft"] = times[0] - start
        rec["itl"] = [b - a for a, b in itertools.pairwise(times)]
        if rec["output_tokens"] > 1:
            rec["tpot"] = (times[-1] - times[0]) / (rec["output_tokens"] - 1)
    if rec["error"] is None:
        rec["error"] = stream.error
    if rec["error"] is None:
        if not stream.done:
            rec["error"] = "stream ended without [DONE]"
        elif stream.usage_tokens is None:
            rec["error"] = "no usage in the stream"
        elif stream.usage_tokens != output_len:
            rec["error"] = f"usage.completion_tokens {stream.usage_tokens} != {output_len} asked"
        elif not times:
            rec["error"] = "no content chunk"
    rec["ok"] = rec["error"] is None
    return rec


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class RawClient:
    """A small HTTP/1.1 client: POST, then the response body (chunked, sized or to EOF) as it arrives; keep-alive."""

    def __init__(self, target: str, api_key: str | None) -> None:
        self.target = target
        self.idle: list[Conn] = []
        self.connects = 0  # new connections made (keep-alive reuses them)
        self.host = "localhost" if target.startswith("unix:") else target.split("://", 1)[1].split("/", 1)[0]
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""

    async def connect(self) -> Conn:
        self.connects += 1
        if self.target.startswith("unix:"):
            reader, writer = await asyncio.open_unix_connection(self.target[5:], limit=1 << 22)
        else:
            host, _, port = self.host.rpartition(":")
            reader, writer = await asyncio.open_connection(host or "127.0.0.1", int(port), limit=1 << 22)
            with contextlib.suppress(OSError):
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return Conn(reader, writer)

    async def post_stream(self, path: str, body: bytes, stream: Stream) -> str | None:
        """POST and feed the response's lines to stream; an error text for a non-200 answer."""
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{self.auth}Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        for attempt in (0, 1):
            conn = None
            while attempt == 0 and self.idle and conn is None:  # the second attempt: a new connection
                conn = self.idle.pop()
                if conn.reader.at_eof() or conn.writer.is_closing():
                    conn.close()
                    conn = None
            reused = conn is not None
            conn = conn or await self.connect()
            try:
                conn.writer.write(head + body)
                await conn.writer.drain()
                raw = await conn.reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                conn.close()
                if reused and attempt == 0:  # the server closed an idle keep-alive connection: once more, a new one
                    continue
                raise ConnectionError(f"no response: {type(exc).__name__}: {exc}") from exc
            break
        else:
            raise ConnectionError("no connection")
        lines = raw.decode("latin-1").split("\r\n")
        version, status = lines[0].split(" ", 2)[:2]
        headers = {k.strip().lower(): v.strip().lower() for k, _, v in (h.partition(":") for h in lines[1:] if h)}
        reusable = version == "HTTP/1.1" and headers.get("connection") != "close"
        try:
            if status != "200":
                text = b"".join([c async for c in self.body(conn, headers)])
                error: str | None = f"HTTP {status}: {text[:300].decode(errors='replace')}"
            else:
                error = None
                pending = b""
                over = False
                async for chunk in self.body(conn, headers):
                    if over:
                        continue  # read the rest of the body (normally just the last chunk) to reuse the connection
                    *complete, pending = (pending + chunk).split(b"\n")
                    for line in complete:
                        if stream.line(line.decode().rstrip("\r")):
                            over = True
                            break
                if pending and not over:
                    stream.line(pending.decode().rstrip("\r"))
            framed = "content-length" in headers or "chunked" in headers.get("transfer-encoding", "")
            reusable = reusable and framed
        except BaseException:
            conn.close()
            raise
        if reusable:
            self.idle.append(conn)
        else:
            conn.close()
        return error

    @staticmethod
    async def body(conn: Conn, headers: dict[str, str]) -> AsyncIterator[bytes]:
        reader = conn.reader
        if "chunked" in headers.get("transfer-encoding", ""):
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise ConnectionError("connection closed inside a chunked body")
                size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    while (await reader.readline()).strip():
                        pass  # trailers
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif "content-length" in headers:
            if n := int(headers["content-length"]):
                yield await reader.readexactly(n)
        else:
            while data := await reader.read(1 << 16):
                yield data

    async def aclose(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class HttpxClient:
    def __init__(self, target: str, api_key: str | None, connections: int) -> None:
        uds = target[5:] if target.startswith("unix:") else None
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        transport = httpx.AsyncHTTPTransport(uds=uds, limits=limits) if uds else None
        headers = {"authorization": f"Bearer {api_key}"} if api_key else None
        self.client = httpx.AsyncClient(base_url="http://localhost" if uds else target, limits=limits, timeout=None,
                                        transport=transport, headers=headers)  # fmt: skip

    async def post_stream(self, path: str, body: bytes, stream: Stream) -> str | None:
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        async with self.client.stream("POST", path, content=body, headers=headers) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread())[:300].decode(errors='replace')}"
            async for line in response.aiter_lines():
                if stream.line(line):
                    break
        return None

    async def aclose(self) -> None:
        await self.client.aclose()


async def one_request(client: RawClient | HttpxClient, prompt: Prompt, output_len: int,
                      timeout: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One streamed completion (a chat completion for a chat prompt): start/end (monotonic s), TTFT, inter-chunk
    gaps, output tokens, ok/error. ``extra``: more request fields (the level's --variants entry)."""
    fields: dict[str, Any] = {"max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
                              "stream_options": {"include_usage": True}}  # fmt: skip
    if isinstance(prompt, dict):
        path, prompt_len, fields["messages"] = "/v1/chat/completions", prompt["tokens"], prompt["messages"]
    else:
        path, prompt_len, fields["prompt"] = "/v1/completions", len(prompt), prompt
    body = json.dumps({**fields, **(extra or {})}).encode()
    rec: dict[str, Any] = {"prompt_len": prompt_len, "ttft": None, "itl": [], "error": None}
    stream = Stream()
    start = time.monotonic()
    try:
        async with asyncio.timeout(timeout):
            rec["error"] = await client.post_stream(path, body, stream)
    except TimeoutError:
        rec["error"] = f"timed out after {timeout:.0f} s"
    except Exception as exc:  # a benchmark records failures instead of stopping
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return finish_record(rec, stream, start, output_len)


async def run_job(job: dict[str, Any], clients: dict[str, RawClient | HttpxClient]) -> dict[str, Any]:
    """This process's share of a level: job['streams'] workers, each taking the next prompt when its last one ended."""
    key = f"{job['client']} {job['target']}"
    if key not in clients:
        clients[key] = (RawClient(job["target"], job["api_key"]) if job["client"] == "raw" else
                        HttpxClient(job["target"], job["api_key"], job["connections"]))  # fmt: skip
    client = clients[key]
    queue = iter(job["prompts"])
    stop_at = job["stop_at"]

    async def worker(delay: float) -> list[dict[str, Any]]:
        await asyncio.sleep(delay)
        out = []
        for prompt in queue:
            if stop_at is not None and time.monotonic() > stop_at:
                break
            out.append(await one_request(client, prompt, job["output_len"], job["timeout"], job.get("extra")))
        return out

    await asyncio.sleep(max(0.0, job["start_at"] - time.monotonic()))
    cpu, wall, connects = time.process_time(), time.monotonic(), getattr(client, "connects", None)
    delays = job.get("delays") or [0.0] * job["streams"]
    recs = [r for rs in await asyncio.gather(*(worker(d) for d in delays)) for r in rs]
    return {"records": recs, "cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall,
            "connects": None if connects is None else client.connects - connects}  # fmt: skip


def client_main(conn: Any, use_uvloop: bool) -> None:
    """A client process: jobs from the pipe, each run on one event loop that lives as long as the process."""
    raise_nofile()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    loop_factory = None
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            loop_factory = uvloop.new_event_loop

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        clients: dict[str, RawClient | HttpxClient] = {}
        conn.send({"ready": True, "loop": type(loop).__module__, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)})
        while (job := await loop.run_in_executor(None, conn.recv)) is not None:
            try:
                result = await run_job(job, clients)
            except Exception as exc:
                result = {"records": [], "failed": f"{type(exc).__name__}: {exc}", "cpu_s": 0.0, "wall_s": 0.0}
            await loop.run_in_executor(None, conn.send, result)
        for client in clients.values():
            await client.aclose()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve())


def variant_fields(variant: str) -> dict[str, Any]:
    """The request fields a --variants entry adds: ``plain`` none; ``json_schema`` a JSON schema held on every token
    (a list of at least 32 records of grammar_masks.py's schema, so no answer completes within --output-len and
    every token is constrained); ``logprobs=N`` logprobs with N alternatives per token."""
    if variant == "plain":
        return {}
    if variant == "json_schema":
        from grammar_masks import SCHEMA

        schema = {"type": "object", "properties": {"people": {"type": "array", "items": SCHEMA, "minItems": 32}},
                  "required": ["people"], "additionalProperties": False}  # fmt: skip
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}}
    name, _, n = variant.partition("=")
    if name == "logprobs" and n.isdigit():
        return {"logprobs": int(n)}
    raise ValueError(f"unknown variant {variant!r} (plain, json_schema, logprobs=N)")


class ClientPool:
    """--client-procs client processes; a level's streams and prompts are dealt out round robin."""

    def __init__(self, procs: int, client: str, use_uvloop: bool, api_key: str | None, timeout: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.client, self.api_key, self.timeout = client, api_key, timeout
        self.conns, self.procs = [], []
        for i in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=client_main, args=(child, use_uvloop), name=f"serve-load-client-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
        self.hello = [c.recv() for c in self.conns]

    def run(self, target: str, prompts: list[Prompt], concurrency: int, output_len: int, stop_at: float | None,
            extra: dict[str, Any] | None = None,
            ramp_s: float = 0.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
        """``ramp_s``: stream k of the level sends its first request k / concurrency * ramp_s seconds after the first
        (0: every stream at once)."""
        n = len(self.conns)
        busy = []
        start_at = time.monotonic() + 0.05
        for i, conn in enumerate(self.conns):
            streams = len(range(i, concurrency, n))
            if not streams:
                continue
            mine = [p for j, p in enumerate(prompts) if (j % concurrency) % n == i]
            delays = [k / concurrency * ramp_s for k in range(i, concurrency, n)]
            conn.send({"target": target, "prompts": mine, "streams": streams, "delays": delays,
                       "output_len": output_len, "timeout": self.timeout, "start_at": start_at, "stop_at": stop_at,
                       "client": self.client, "api_key": self.api_key, "connections": streams + 4,
                       "extra": extra})  # fmt: skip
            busy.append(conn)
        results = [conn.recv() for conn in busy]
        recs = sorted((r for res in results for r in res["records"]), key=lambda r: r["start"])
        fractions = [res["cpu_s"] / res["wall_s"] for res in results if res["wall_s"] > 0]
        info = {"procs": len(busy), "cpu_s": sum(res["cpu_s"] for res in results),
                "new_connections": sum(res.get("connects") or 0 for res in results) if self.client == "raw" else None,
                "max_proc_cpu_fraction": max(fractions, default=None),
                "failed": [res["failed"] for res in results if "failed" in res]}  # fmt: skip
        if info["failed"]:
            say(f"  client process failed: {info['failed'][0]}")
        return recs, info

    def close(self, at_once: bool = False) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                if not at_once:
                    conn.send(None)
        deadline = time.monotonic() + (0 if at_once else 10)
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)


# -- what the server's processes do --------------------------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float | None:
    """utime + stime of a live process (all its threads), from /proc/PID/stat; None if it is gone."""
    if pid is None:
        return None
    try:
        return _stat_cpu(Path(f"/proc/{pid}/stat").read_text())
    except OSError:
        return None


def _stat_cpu(stat: str) -> float:
    """utime + stime, in seconds, of a /proc .../stat line (a process's or a thread's)."""
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": fields from 3 (state) on
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime: fields 14 and 15


def front_pids(pid: int | None) -> list[int]:
    """The engine worker's front processes (engine/front.py: its HTTP API), if it has them."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if pid is not None else []
    except OSError:
        return []
    fronts = []
    for child in children:
        with contextlib.suppress(OSError):
            if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"warmgate: engine-front "):
                fronts.append(int(child))
    return fronts


def thread_cpu(pid: int | None) -> dict[str, float] | None:
    """CPU seconds of a live engine worker's threads: its engine thread (the step loop), the HTTP loops (its front
    processes' main threads, or its own main thread without fronts), its main thread reading the fronts' links
    (``link``), and the rest of all of them (torch's threads, the grammar masks' pool, ...); None if it is gone."""
    out = {"engine": 0.0, "loop": 0.0, "link": 0.0, "other": 0.0}
    fronts = front_pids(pid)
    try:
        tasks = [(pid, t) for t in Path(f"/proc/{pid}/task").iterdir()] if pid is not None else []
        for front in fronts:
            tasks += [(front, t) for t in Path(f"/proc/{front}/task").iterdir()]
    except OSError:
        return None
    for owner, task in tasks:
        try:
            name, seconds = (task / "comm").read_text().strip(), _stat_cpu((task / "stat").read_text())
        except OSError:  # the thread ended
            continue
        main = int(task.name) == owner
        key = ("engine" if name == ENGINE_THREAD_NAME else "other" if not main
               else "loop" if owner in fronts or not fronts else "link")  # fmt: skip
        out[key] += seconds
    return out if tasks else None


class Admin:
    """GET /admin/status with the admin token, when there is one."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url, self.token = url, token

    def status(self) -> dict[str, Any] | None:
        if self.token is None:
            return None
        try:
            response = httpx.get(f"{self.url}/admin/status", headers={"authorization": f"Bearer {self.token}"},
                                 timeout=30)  # fmt: skip
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None


def active_engine(status: dict[str, Any] | None) -> dict[str, Any] | None:
    if not status:
        return None
    engines = status.get("engines") or []
    active = status.get("active")
    for engine in engines:
        if engine.get("id") == active or (active is None and engine.get("state") == "active"):
            return engine
    return None


def watched_pids(status: dict[str, Any] | None, serve_pid: int | None, gateway_pid: int | None) -> dict[str, Any]:
    """The processes whose CPU time is read: {'gateway_kind', 'groups': {group: {label: pid}}}."""
    groups: dict[str, dict[str, int]] = {"relays": {}, "supervisor": {}, "gateway": {}, "engine": {}, "cache": {}}
    kind = None
    relays = (status or {}).get("relays")
    if isinstance(relays, list) and relays:
        kind = "relays"
        for i, relay in enumerate(relays):
            if isinstance(relay, dict) and relay.get("pid"):
                groups["relays"][f"relay-{relay.get('index', i)}"] = int(relay["pid"])
        supervisor = (status or {}).get("supervisor") or {}
        if supervisor.get("pid") or serve_pid:
            groups["supervisor"]["supervisor"] = int(supervisor.get("pid") or serve_pid)
    elif gateway_pid or serve_pid:
        kind = "single-process"  # a gateway without relays: the `warmgate serve` process does everything
        groups["gateway"]["warmgate-serve"] = int(gateway_pid or serve_pid)
    active = None
    if engine := active_engine(status):
        groups["engine"][f"engine-{engine.get('id')}"] = active = int(engine["pid"])
    for engine in (status or {}).get("engines") or []:
        if engine.get("pid") and engine is not active_engine(status):
            groups["engine"][f"engine-{engine.get('id')}-{engine.get('state')}"] = int(engine["pid"])
    for label, pid in list(groups["engine"].items()):
        for i, front in enumerate(front_pids(pid)):  # its HTTP API's processes count with it
            groups["engine"][f"{label}-front-{i}"] = front
    if (cache := (status or {}).get("cache") or {}).get("pid"):
        groups["cache"]["cache"] = int(cache["pid"])
    return {"gateway_kind": kind, "groups": groups, "active_engine": active}


def cpu_snapshot(pids: dict[str, Any]) -> dict[str, Any]:
    snapshot: dict[str, Any] = {g: {label: cpu_seconds(pid) for label, pid in members.items()}
                                for g, members in pids["groups"].items()}  # fmt: skip
    snapshot["engine_threads"] = thread_cpu(pids.get("active_engine"))
    return snapshot


def cpu_usage(pids: dict[str, Any], before: dict[str, Any], wall: float, tokens: int) -> dict[str, Any]:
    """CPU seconds per group over the window, cores (cpu / wall), µs per output token; gone processes named. The
    active engine's also by thread (``engine_threads_us_per_token``: its step loop, HTTP loop, front link, the
    rest)."""
    after = cpu_snapshot(pids)
    out: dict[str, Any] = {"gateway_kind": pids["gateway_kind"], "wall_s": wall, "output_tokens": tokens, "groups": {}}
    threads_before, threads_after = before.get("engine_threads"), after.get("engine_threads")
    if threads_before is not None and threads_after is not None and tokens:
        out["engine_threads_us_per_token"] = {k: 1e6 * (threads_after[k] - threads_before[k]) / tokens
                                              for k in threads_after}  # fmt: skip
    for group, members in pids["groups"].items():
        if not members:
            continue
        per = {}
        gone = []
        for label in members:
            a, b = before[group].get(label), after[group].get(label)
            if a is None or b is None:
                gone.append(label)
            else:
                per[label] = b - a
        cpu = sum(per.values())
        out["groups"][group] = {"pids": members, "cpu_s": cpu, "per_process_cpu_s": per, "gone": gone,
                                "cores": cpu / wall if wall > 0 else None,
                                "us_per_token": 1e6 * cpu / tokens if tokens else None}  # fmt: skip
    return out


class LogWatch:
    """`event=NAME` lines added to the serve log and the run dir's logs since the last mark, counted by file."""

    def __init__(self, files: Callable[[], list[Path]]) -> None:
        self.files = files
        self.offsets: dict[Path, int] = {}

    def mark(self) -> None:
        self.offsets = {p: p.stat().st_size for p in self.files() if p.exists()}

    def _since_mark(self) -> dict[Path, bytes]:
        out: dict[Path, bytes] = {}
        for path in self.files():
            if not path.exists():
                continue
            with path.open("rb") as f:
                start = self.offsets.get(path, 0)
                f.seek(start if start <= path.stat().st_size else 0)
                out[path] = f.read()
        return out

    def events(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for path, text in self._since_mark().items():
            counts = Counter(m.group(1).decode() for m in EVENT.finditer(text))
            if counts:
                out[path.name] = dict(counts)
        return out

    def requests(self) -> list[tuple[float, float | None]]:
        """The engines' `event=request` lines since the mark: (received_at, ttft_ms or None), each request's receipt
        by its engine's front on the host's monotonic clock and its time from there to its first token's text."""
        out = []
        for text in self._since_mark().values():
            for line in text.splitlines():
                if b"event=request " in line:
                    fields = dict(FIELD.findall(line))
                    if (at := fields.get(b"received_at")) is not None:
                        ttft = fields.get(b"ttft_ms", b"-")
                        out.append((float(at), None if ttft == b"-" else float(ttft)))
        return out

    def traced_steps(self) -> list[dict[str, float]]:
        """The engines' `event=step_after_activation` lines since the mark that carry `launched_at` (the host's
        monotonic clock): each traced step's launch, device ms, tokens, prompt tokens, sequences and the shared prefix
        its attention walked once (WARMGATE_TRACED_STEPS in the server's environment says how many steps are traced)."""
        out = []
        for text in self._since_mark().values():
            for line in text.splitlines():
                if b"event=step_after_activation " in line:
                    fields = {k.decode(): v for k, v in FIELD.findall(line)}
                    if "launched_at" in fields:
                        out.append({k: float(fields[k]) for k in ("launched_at", "device_ms", "tokens",
                                                                  "prompt_tokens", "seqs", "shared")})  # fmt: skip
        return out

    def engine_steps(self) -> dict[str, float | None] | None:
        """The engines' `engine_stats` lines since the mark, weighted by their steps: step and device times, and the
        device's idle share between steps that followed one another; the waits for arrivals of late scheduling
        (their count, and their mean weighted by it)."""
        rows = [dict(FIELD.findall(line)) for text in self._since_mark().values()
                for line in text.splitlines() if b"event=engine_stats" in line]  # fmt: skip
        rows = [{k.decode(): float(v) for k, v in row.items() if v.replace(b".", b"").isdigit()} for row in rows]
        rows = [row for row in rows if row.get("steps")]
        if not rows:
            return None
        steps = sum(row["steps"] for row in rows)

        def mean(key: str) -> float | None:
            have = [row for row in rows if key in row]
            weight = sum(row["steps"] for row in have)
            return round(sum(row[key] * row["steps"] for row in have) / weight, 3) if weight else None

        holds = sum(row.get("holds", 0.0) for row in rows)
        held = sum(row.get("holds", 0.0) * row.get("held_ms_mean", 0.0) for row in rows)
        return {"lines": len(rows), "steps": steps, "step_ms_mean": mean("step_ms_mean"),
                "device_ms_mean": mean("device_ms_mean"), "device_idle": mean("device_idle"), "holds": holds,
                "held_ms_mean": round(held / holds, 3) if holds else None}  # fmt: skip


def restart_key(r: dict[str, Any]) -> str:
    return json.dumps([r.get("at"), r.get("reason"), r.get("engine"), r.get("strategy")])


def new_restarts(before: dict[str, Any] | None, after: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    if before is None or after is None:
        return None
    seen = {restart_key(r) for r in before.get("restarts") or []}
    return [r for r in after.get("restarts") or [] if restart_key(r) not in seen]


def is_kill(restart: dict[str, Any]) -> bool:
    reason = str(restart.get("reason") or "")
    return "crash" in reason or "hung" in reason


# -- the run -----------------------------------------------------------------------------------------------------


def ttft_by_round(concurrency: int, recs: list[dict[str, Any]]) -> list[float | None]:
    """TTFT p50 (ms) of each ``concurrency`` requests in the order they were sent: with the streams started together
    the first is a true wave; later ones drift apart as the streams do (a level's p50 mixes them)."""
    ordered = sorted(recs, key=lambda r: r["start"])
    rounds = [ordered[i : i + concurrency] for i in range(0, len(ordered), concurrency)]
    return [ms_stats([r["ttft"] for r in chunk])["p50_ms"] for chunk in rounds]


def engine_side(recs: list[dict[str, Any]], requests: list[tuple[float, float | None]]) -> dict[str, Any] | None:
    """Each counted request's time in the engine against the client's, from the engines' request lines (LogWatch
    .requests) on the clients' clock: the engine's TTFT (its front's receipt to the first token's text), the way in
    (a client's send to that receipt) and the way back (the engine's first text to the client's). Sends and receipts
    are matched by rank (sorted; a mean does not depend on the matching): None unless every counted request has one
    line received within the level (the warm-up's come before its first send)."""
    if not recs:
        return None
    first = min(r["start"] for r in recs)
    mine = sorted((at, ttft) for at, ttft in requests if at >= first and ttft is not None)
    if len(mine) != len(recs) or any(r["ttft"] is None for r in recs):
        return None
    sends = sorted(r["start"] for r in recs)
    client_first = sorted(r["start"] + r["ttft"] for r in recs)
    engine_first = sorted(at + ttft / 1e3 for at, ttft in mine)
    return {"ttft": ms_stats([ttft / 1e3 for _, ttft in mine]),
            "way_in": ms_stats([at - sent for (at, _), sent in zip(mine, sends, strict=True)]),
            "way_back": ms_stats([c - e for c, e in zip(client_first, engine_first, strict=True)])}  # fmt: skip


def prompt_steps(recs: list[dict[str, Any]], traced: list[dict[str, float]]) -> dict[str, Any] | None:
    """The traced steps with prompt rows launched within the level (LogWatch.traced_steps, on the clients' clock):
    how many, how many walked a shared prefix once (and how long it was), their mean device ms and rows."""
    if not recs:
        return None
    first, last = min(r["start"] for r in recs), max(r["end"] for r in recs)
    steps = [s for s in traced if first <= s["launched_at"] <= last and s["prompt_tokens"] > 0]
    if not steps:
        return None
    shared = [s for s in steps if s["shared"] > 0]
    return {"steps": len(steps), "shared_steps": len(shared),
            "shared_positions": max((s["shared"] for s in shared), default=0),
            "device_ms_mean": round(statistics.fmean(s["device_ms"] for s in steps), 2),
            "tokens_mean": round(statistics.fmean(s["tokens"] for s in steps), 1)}  # fmt: skip


def level_notes(s: dict[str, Any]) -> list[str]:
    """A level's lines under the table, as it has the figures: TTFT by round, the time in and on the way to the
    engine, the traced steps with prompt rows."""
    notes = []
    if len(rounds := s.get("ttft_by_round") or []) > 1:
        notes.append(f"TTFT p50 by round of {s['concurrency']} requests in sending order: "
                     f"{', '.join(fmt(r) for r in rounds)}")  # fmt: skip
    if side := s.get("engine_side"):
        notes.append(f"in the engine, TTFT p50 {fmt(side['ttft']['p50_ms'])} (from its front's receipt); the way in (a "
                     f"client's send to that receipt) p50 {fmt(side['way_in']['p50_ms'])} / p99 "
                     f"{fmt(side['way_in']['p99_ms'])}; the way back p50 {fmt(side['way_back']['p50_ms'])} / p99 "
                     f"{fmt(side['way_back']['p99_ms'])}")  # fmt: skip
    if steps := s.get("prompt_steps"):
        notes.append(f"{steps['steps']} traced steps with prompt rows, {steps['shared_steps']} of them over a shared "
                     f"prefix walked once ({steps['shared_positions']:.0f} positions); {steps['tokens_mean']} tokens "
                     f"and {steps['device_ms_mean']} ms of device time a step")  # fmt: skip
    return notes


def level_stats(concurrency: int, recs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in recs if r["ok"]]
    wall = max(r["end"] for r in recs) - min(r["start"] for r in recs) if recs else 0.0
    tokens = sum(r["output_tokens"] for r in recs)
    errors = Counter(re.sub(r"\d+", "N", r["error"])[:120] for r in recs if r["error"])
    return {
        "concurrency": concurrency, "requests": len(recs), "errors": len(recs) - len(ok), "wall_s": wall,
        "output_tokens": tokens, "ok_output_tokens": sum(r["output_tokens"] for r in ok),
        "output_tok_s": tokens / wall if wall else 0.0, "request_s": len(recs) / wall if wall else 0.0,
        "ttft": ms_stats([r["ttft"] for r in ok]), "ttft_by_round": ttft_by_round(concurrency, ok),
        "tpot": ms_stats([r["tpot"] for r in ok if "tpot" in r]),
        "itl": ms_stats([g for r in ok for g in r["itl"]]), "latency": ms_stats([r["latency"] for r in ok]),
        "mean_prompt_len": statistics.fmean(r["prompt_len"] for r in recs) if recs else None,
        "error_kinds": dict(errors.most_common(8)),
    }  # fmt: skip


def compact(recs: list[dict[str, Any]], t0: float) -> list[dict[str, Any]]:
    """Samples for the JSON: times relative to the run's start, rounded; the gaps summarised, not listed."""
    out = []
    for r in recs:
        s = {k: v for k, v in r.items() if k != "itl"}
        s["start"], s["end"] = round(r["start"] - t0, 6), round(r["end"] - t0, 6)
        for k in ("ttft", "tpot", "latency"):
            if s.get(k) is not None:
                s[k] = round(s[k], 6)
        s["itl_max"] = round(max(r["itl"]), 6) if r["itl"] else None
        out.append(s)
    return out


def gpu_processes() -> dict[int, int] | None:
    """Device memory (MiB) per process, as nvidia-smi counts it (CUDA context included); None without a GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    rows = [line.split(",") for line in smi.stdout.splitlines() if line.count(",") == 1]
    return {int(pid): int(mib) for pid, mib in rows if pid.strip().isdigit() and mib.strip().isdigit()}


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
    """Each probe's TTFTs against the steady-state TTFT p50 at the lowest gateway concurrency swept."""
    levels = [s for s in result["levels"] if s["target"] == "gateway" and s["ttft"]["p50_ms"] is not None]
    if not levels:
        return {}
    base = min(levels, key=lambda s: s["concurrency"])
    out: dict[str, Any] = {"baseline_concurrency": base["concurrency"], "baseline_ttft_p50_ms": base["ttft"]["p50_ms"]}
    for key in ("probe_after_ready", "probe_after_restart"):
        if key in result:
            ttfts = [None if r["ttft"] is None else 1e3 * r["ttft"] for r in result[key]]
            values = [v for v in ttfts if v is not None]
            p50 = base["ttft"]["p50_ms"]
            out[key] = {"ttft_ms": ttfts, "errors": sum(not r["ok"] for r in result[key]),
                        "max_over_p50": max(values) / p50 if values and p50 else None}  # fmt: skip
    return out


def direct_summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Gateway TTFT p50 over the engine socket's, per concurrency measured both ways (target: <= 1.15)."""
    out = []
    for d in (s for s in result["levels"] if s["target"] == "engine-socket"):
        gw = [s for s in result["levels"] if s["target"] == "gateway" and s["concurrency"] == d["concurrency"]]
        if gw and gw[0]["ttft"]["p50_ms"] and d["ttft"]["p50_ms"]:
            out.append({"concurrency": d["concurrency"], "gateway_ttft_p50_ms": gw[0]["ttft"]["p50_ms"],
                        "engine_ttft_p50_ms": d["ttft"]["p50_ms"],
                        "ratio": gw[0]["ttft"]["p50_ms"] / d["ttft"]["p50_ms"]})  # fmt: skip
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, url: str, run_dir: Path | None, serve_pid: int | None,
                 serve_log: Path | None, result: dict[str, Any], write: Callable[[], None]) -> None:  # fmt: skip
        self.args, self.url, self.run_dir, self.result, self.write = args, url, run_dir, result, write
        self.serve_pid = serve_pid
        self.prompts = prompt_source(args)
        self.stop_at = None if args.deadline_s is None else args.started + args.deadline_s
        token = os.environ.get("WARMGATE_ADMIN_TOKEN")
        if run_dir is not None and (run_dir / "admin-token").exists():
            token = (run_dir / "admin-token").read_text().strip()
        self.token = token
        self.admin = Admin(url, token)

        def logs() -> list[Path]:
            files = [serve_log] if serve_log is not None else []
            return files + (sorted(run_dir.glob("*.log")) if run_dir is not None and run_dir.exists() else [])

        self.logs = LogWatch(logs)
        self.pool: ClientPool | None = None

    def past_deadline(self) -> bool:
        return self.stop_at is not None and time.monotonic() > self.stop_at

    def rpc(self, concurrency: int) -> int:
        a = self.args
        if concurrency in a.concurrency:
            return a.requests_per_client[a.concurrency.index(concurrency)]
        return a.requests_per_client[0]

    def run(self) -> None:
        a = self.args
        self.pool = ClientPool(a.client_procs, a.client, a.client_loop != "asyncio", a.api_key, a.request_timeout)
        self.result["client"] = {"procs": a.client_procs, "kind": a.client, "hello": self.pool.hello}
        say(f"{a.client_procs} client processes ({a.client} client, loop {self.pool.hello[0]['loop']}, "
            f"open files {self.pool.hello[0]['nofile']})")  # fmt: skip
        try:
            self.sweep()
        except BaseException:
            self.pool.close(at_once=True)  # mid-level (SIGTERM, ^C): the clients' results are not waited for
            raise
        self.pool.close()

    def sweep(self) -> None:
        a, result = self.args, self.result
        assert self.pool is not None
        status = self.admin.status()
        result["status_at_start"] = status
        if status is None:
            say("no /admin/status (no admin token: give --run-dir or WARMGATE_ADMIN_TOKEN): no CPU, crash counts or "
                "direct levels")  # fmt: skip
        if a.restart_probe:
            say(f"first {a.restart_probe} requests after the server became ready ...")
            recs, _ = self.pool.run(self.url, [self.prompts() for _ in range(a.restart_probe)], 1, a.output_len, None)
            result["probe_after_ready"] = compact(recs, a.started)
        self.settle()
        direct = [c for c in a.direct_concurrency if c > 0]  # 0: none
        for c in a.concurrency:
            for variant in a.variants:
                self.level("gateway", c, variant)
            if c in direct:
                direct.remove(c)
                self.level("engine-socket", c)
        for c in direct:
            self.level("engine-socket", c)
        result["status_at_end"] = self.admin.status()
        if a.restart_probe:
            self.restart_probe()

    def settle(self) -> None:
        """Wait (at most --settle-timeout) for the standby engines to finish starting: an engine capturing CUDA graphs
        beside the measured one would take CPU and GPU time from the first level."""
        a = self.args
        want = 2 if a.device.startswith("cuda") else 1  # [restart] standby's default (app/config.py)
        for item in a.restart_set:
            key, _, value = item.partition("=")
            if key.strip() == "standby":
                want = int(value)
        t = time.monotonic()
        end = t + a.settle_timeout
        status = None
        while time.monotonic() < end and not self.past_deadline():
            status = self.admin.status()
            if status is None:
                return
            states = [e.get("state") for e in status.get("engines") or []]
            if states.count("active") == 1 and states.count("standby") >= want and set(states) <= {"active", "standby"}:
                break
            time.sleep(0.5)
        else:
            engines = [(e.get("id"), e.get("state")) for e in (status or {}).get("engines") or []]
            self.result["settle_s"] = None
            say(f"engines not settled after {time.monotonic() - t:.0f} s: {engines}; measuring anyway")
            return
        self.result["settle_s"] = time.monotonic() - t
        say(f"engines settled after {self.result['settle_s']:.1f} s")

    def level(self, target_kind: str, c: int, variant: str = "plain") -> None:
        a, result = self.args, self.result
        assert self.pool is not None
        if self.past_deadline():
            say(f"{target_kind} {c}: skipped (past --deadline-s)")
            result["skipped"].append({"target": target_kind, "concurrency": c})
            return
        status = self.admin.status()
        target = self.url
        if target_kind == "engine-socket":
            engine = active_engine(status)
            if engine is None or not engine.get("socket"):
                say(f"engine socket {c}: skipped (no active engine in /admin/status)")
                result["skipped"].append({"target": target_kind, "concurrency": c, "why": "no active engine"})
                return
            target = f"unix:{engine['socket']}"
        warm = a.warmup if a.warmup is not None else c
        n = max(c * self.rpc(c), 16)
        prompts = [self.prompts() for _ in range(n)]
        warm_prompts = [self.prompts() for _ in range(warm)]
        extra = variant_fields(variant)
        say(f"{target_kind} {c} {variant}: {warm} warm-up, then {n} requests ({target}) ...")
        self.logs.mark()
        warmup, _ = self.pool.run(target, warm_prompts, c, a.output_len, self.stop_at, extra) if warm else ([], {})
        pids = watched_pids(self.admin.status() or status, self.serve_pid, a.gateway_pid)
        before = cpu_snapshot(pids)
        fault: dict[str, Any] = {"concurrency": c}  # filled by the fault's thread, also after the level
        if a.fault and target_kind == "gateway" and c in a.fault_levels:
            timer = threading.Timer(a.fault_at, self.inject, args=(fault,))
            timer.daemon = True
            timer.start()
        t = time.monotonic()
        recs, client = self.pool.run(target, prompts, c, a.output_len, self.stop_at, extra, a.ramp_s)
        wall = time.monotonic() - t
        if "kind" in fault:
            result.setdefault("faults", []).append(fault)
        stats = level_stats(c, recs)
        cpu = cpu_usage(pids, before, wall, stats["output_tokens"])
        after = self.admin.status()
        restarts = new_restarts(status, after)
        relays_before = {r.get("pid") for r in (status or {}).get("relays") or [] if isinstance(r, dict)}
        relays_after = {r.get("pid") for r in (after or {}).get("relays") or [] if isinstance(r, dict)}
        events = self.logs.events()
        totals = Counter()
        for counts in events.values():
            totals.update(counts)
        record = {"target": target_kind, "variant": variant, "url": target, **stats, "warmup_requests": len(warmup),
                  "warmup_errors": sum(not r["ok"] for r in warmup), "truncated": len(recs) < n, "cpu": cpu,
                  "client": client, "crash_restarts": None if restarts is None else sum(map(is_kill, restarts)),
                  "restarts": restarts, "log_events": events, "events": dict(totals),
                  "new_relay_pids": sorted(relays_after - relays_before) if relays_before else None,
                  "relays": (after or {}).get("relays"), "supervisor": (after or {}).get("supervisor"),
                  "memory": {e.get("id"): e.get("memory") for e in (after or {}).get("engines") or []},
                  "engine_steps": self.logs.engine_steps(),
                  "engine_side": engine_side([r for r in recs if r["ok"]], self.logs.requests()),
                  "prompt_steps": prompt_steps(recs, self.logs.traced_steps()),
                  "gpu_processes": gpu_processes(),
                  "samples": compact(recs, a.started)}  # fmt: skip
        result["levels"].append(record)
        ttft, tpot = stats["ttft"]["p50_ms"] or 0, stats["tpot"]["p50_ms"] or 0
        g = cpu["groups"]
        gw = g.get("relays") or g.get("gateway") or {}
        say(f"  {stats['errors']}/{stats['requests']} failed, {stats['output_tok_s']:.1f} output tok/s, "
            f"TTFT p50 {ttft:.1f} ms, TPOT p50 {tpot:.1f} ms, crash restarts {record['crash_restarts']}, "
            f"engine_hung {totals.get('engine_hung', 0)}, gateway ({cpu['gateway_kind']}) "
            f"{fmt(gw.get('us_per_token'))} µs/tok, engine {fmt(g.get('engine', {}).get('us_per_token'))} µs/tok "
            f"(step loop {fmt((cpu.get('engine_threads_us_per_token') or {}).get('engine'))}), "
            f"client max {fmt(client.get('max_proc_cpu_fraction'), '.2f')} core, "
            f"device idle {fmt((record['engine_steps'] or {}).get('device_idle'), '.3f')}, "
            f"holds {fmt((record['engine_steps'] or {}).get('holds'), '.0f')}"
            + (" (truncated at the deadline)" if record["truncated"] else ""))  # fmt: skip
        if stats["error_kinds"]:
            say(f"  errors: {json.dumps(stats['error_kinds'])[:600]}")
        self.write()

    def inject(self, fault: dict[str, Any]) -> None:
        """--fault, while a level's requests run: kill -9 of the supervisor (`warmgate serve` starts another, which
        adopts everything), or `warmgate upgrade`; until a new supervisor answers with every relay connected."""
        a = self.args
        before = self.admin.status() or {}
        supervisor = (before.get("supervisor") or {}).get("pid")
        fault.update({"kind": a.fault, "supervisor_before": supervisor, "at_s": round(time.monotonic() - a.started, 3),
                      "engines_before": sorted(e.get("pid") for e in before.get("engines") or [])})  # fmt: skip
        t = time.monotonic()
        if a.fault == "kill-supervisor":
            os.kill(supervisor, signal.SIGKILL)
        else:
            cmd = [sys.executable, "-m", "app.cli", "upgrade", "--run-dir", str(self.run_dir)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            fault["upgrade"] = (done.stdout or done.stderr).strip()[:400]
        while time.monotonic() - t < 300:
            now = self.admin.status() or {}
            pid = (now.get("supervisor") or {}).get("pid")
            if pid not in (None, supervisor) and all(r.get("connected") for r in now.get("relays") or []):
                fault.update({"supervisor_after": pid, "recovered_s": round(time.monotonic() - t, 3),
                              "engines_after": sorted(e.get("pid") for e in now.get("engines") or [])})  # fmt: skip
                break
            time.sleep(0.1)
        say(f"  fault {a.fault}: {json.dumps(fault)[:400]}")

    def restart_probe(self) -> None:
        a, result = self.args, self.result
        assert self.pool is not None
        if self.past_deadline():
            say("restart probe skipped (past --deadline-s)")
            return
        if self.token is None:
            say("restart probe skipped: no admin token (give --run-dir or WARMGATE_ADMIN_TOKEN)")
            return
        say("POST /admin/restart (overlap) ...")
        t = time.perf_counter()
        response = httpx.post(f"{self.url}/admin/restart", json={"strategy": "overlap"}, timeout=600,
                              headers={"authorization": f"Bearer {self.token}"})  # fmt: skip
        try:
            report = response.json()
        except ValueError:
            report = {"body": response.text[:2000]}
        result["restart"] = {"status": response.status_code, "seconds": time.perf_counter() - t, "report": report}
        say(f"  {response.status_code} in {result['restart']['seconds']:.2f} s: {response.text[:400]}")
        recs, _ = self.pool.run(self.url, [self.prompts() for _ in range(a.restart_probe)], 1, a.output_len, None)
        result["probe_after_restart"] = compact(recs, a.started)


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [f"warmgate serve_load: {result['model']} on {result.get('device_name', '?')} ({result['date']}, "
             f"{result['git_commit']})", "",
             ("chat requests as text: " if a.get("chat") else "")
             + (f"a shared prefix of {a['shared_prefix']} tokens, then " if a.get("shared_prefix") else "")
             + f"prompt ~{a['prompt_len']} tokens, output {a['output_len']} tokens, ignore_eos, temperature 0; "
             f"closed loop, {a['client_procs']} client processes ({a['client']} client)"
             + (f", the streams' starts spread over {a['ramp_s']} s" if a.get("ramp_s") else "")
             + (f"; engine: `{result['engine_settings']}`" if result.get("engine_settings") else ""), "",
             "| target | concurrency | variant | requests | failed | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 "
             "| TPOT p99 | crash restarts | engine_hung |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for s in result["levels"]:
        hung = s["events"].get("engine_hung", 0)
        cut = " (cut)" if s["truncated"] else ""
        lines.append(f"| {s['target']} | {s['concurrency']} | {s.get('variant', 'plain')} | {s['requests']}{cut} | "
                     f"{s['errors']} | {s['output_tok_s']:,.0f} | {fmt(s['ttft']['p50_ms'])} | "
                     f"{fmt(s['ttft']['p99_ms'])} | {fmt(s['tpot']['p50_ms'], '.2f')} | "
                     f"{fmt(s['tpot']['p99_ms'], '.2f')} | {fmt(s['crash_restarts'], 'd')} | {hung} |")  # fmt: skip
    for s in result["levels"]:
        lines += [f"\n{s['target']} {s['concurrency']} {s.get('variant', 'plain')}: {note}" for note in level_notes(s)]
    lines.append("\n(TTFT and TPOT in ms; failed: no `[DONE]`, an error event, or usage.completion_tokens != "
                 f"{a['output_len']}; crash restarts: /admin/status restarts with reason crash during the level, "
                 "warm-up included; engine_hung: `event=engine_hung` log lines)\n")  # fmt: skip
    kinds = {s["cpu"]["gateway_kind"] for s in result["levels"] if s["target"] == "gateway"}
    gateway = ("relays (summed)" if kinds == {"relays"} else
               "`warmgate serve` (single-process gateway: no relays in /admin/status)" if kinds == {"single-process"}
               else "n/a (no /admin/status)" if kinds == {None} else f"mixed: {sorted(map(str, kinds))}")  # fmt: skip
    lines += [f"CPU time (utime+stime) over the counted requests, per output token; gateway = {gateway}:", "",
              "| target | concurrency | gateway µs/tok | supervisor µs/tok | engine µs/tok (step loop / HTTP loop / "
              "front link / other threads) | gateway cores | engine cores | client max core |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    gone = False
    for s in result["levels"]:
        g = s["cpu"]["groups"]
        gw = g.get("relays") or g.get("gateway") or {}
        sup, eng = g.get("supervisor") or {}, g.get("engine") or {}

        def mark(group: dict[str, Any], value: float | None, spec: str = ".1f") -> str:
            return fmt(value, spec) + (" *" if group.get("gone") else "")

        gone = gone or any(x.get("gone") for x in (gw, sup, eng))
        threads = s["cpu"].get("engine_threads_us_per_token")
        by_thread = (f" ({' / '.join(fmt(threads.get(k)) for k in ('engine', 'loop', 'link', 'other'))})"
                     if threads else "")  # fmt: skip
        lines.append(f"| {s['target']} | {s['concurrency']} | {mark(gw, gw.get('us_per_token'))} | "
                     f"{mark(sup, sup.get('us_per_token'))} | {mark(eng, eng.get('us_per_token'))}{by_thread} | "
                     f"{mark(gw, gw.get('cores'), '.2f')} | {mark(eng, eng.get('cores'), '.2f')} | "
                     f"{fmt(s['client'].get('max_proc_cpu_fraction'), '.2f')} |")  # fmt: skip
    if gone:
        lines.append("\n\\* a process measured ended during the level: its CPU time is missing (`gone` in the JSON)")
    for d in result.get("direct_summary") or []:
        lines.append(f"\nTTFT p50 at {d['concurrency']} streams: gateway {d['gateway_ttft_p50_ms']:.1f} ms, engine "
                     f"socket {d['engine_ttft_p50_ms']:.1f} ms: {d['ratio']:.3f}x (target <= 1.15)")  # fmt: skip
    if result.get("skipped"):
        lines.append(f"\nSkipped (past --deadline-s or no engine): {json.dumps(result['skipped'])}")
    summary = result.get("probe_summary") or {}
    if "probe_after_ready" in summary or "probe_after_restart" in summary:
        lines.append(f"\nFirst requests after an engine start, one at a time (steady TTFT p50 at concurrency "
                     f"{summary['baseline_concurrency']}: {fmt(summary['baseline_ttft_p50_ms'])} ms):")  # fmt: skip
    for key, name in (("probe_after_ready", "after the server first became ready"),
                      ("probe_after_restart", "after POST /admin/restart (overlap)")):  # fmt: skip
        if key in summary:
            probe = summary[key]
            ttfts = ", ".join(fmt(v) for v in probe["ttft_ms"])
            ratio = fmt(probe["max_over_p50"], ".2f")
            lines.append(f"- {name}: TTFT ms [{ttfts}], {probe['errors']} errors; max / steady p50 = {ratio}")
    if "restart" in result:
        rep = result["restart"]["report"]
        lines.append(f"- restart: HTTP {result['restart']['status']} in {result['restart']['seconds']:.2f} s, "
                     f"weights {rep.get('weight_source')}, phases {json.dumps(rep.get('phases'))}")  # fmt: skip
    for f in result.get("faults") or []:
        level = next((s for s in result["levels"] if s["target"] == "gateway" and s["concurrency"] == f["concurrency"]),
                     None)  # fmt: skip
        failed = "n/a" if level is None else f"{level['errors']} of {level['requests']} requests failed"
        lines.append(f"\nFault `{f['kind']}` {f.get('at_s')} s into the run, during the gateway level at "
                     f"{f['concurrency']} streams: {failed}; a new supervisor (pid {f.get('supervisor_before')} -> "
                     f"{f.get('supervisor_after')}) served with every relay connected after "
                     f"{f.get('recovered_s')} s; engines {f.get('engines_before')} -> "
                     f"{f.get('engines_after')}")  # fmt: skip
    if "failed" in result:
        lines.append(f"\n**Incomplete run:** {result['failed']}")
    return "\n".join(lines) + "\n"


def int_list(text: str) -> list[int]:
    return [int(c) for c in text.split(",") if c.strip()] if text.strip().lower() not in ("", "none") else []


def on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(f"signal {signum}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, help="checkpoint directory (default: the fp8-block demo)")
    p.add_argument("--url", help="benchmark a gateway that is already running (no server is started)")
    p.add_argument("--run-dir", type=Path, help="the server's run dir (default: a new temporary one)")
    p.add_argument("--serve-log", type=Path, help="with --url: the gateway's log, scanned for event= lines")
    p.add_argument("--gateway-pid", type=int, help="with --url and a gateway without relays: its pid, for its CPU")
    p.add_argument("--api-key", help="sent as a bearer token with every completion (with --url)")
    p.add_argument("--port", type=int, help="default: a free one")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=128, help="0: not set (the engine's default)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-bytes", type=int)
    p.add_argument("--weights", default="ipc-or-disk", choices=("ipc", "ipc-or-disk", "disk"))
    for section in ("engine", "restart", "gateway"):
        p.add_argument(f"--{section}-set", action="append", default=[], metavar="KEY=VALUE",
                       help=f"any [{section}] setting, the value as a TOML literal (repeatable)")  # fmt: skip
    p.add_argument("--concurrency", type=int_list, default=[1, 8, 32, 64, 128])
    p.add_argument("--requests-per-client", type=int_list, default=[4],
                   help="counted requests per stream (16 a level at least): one, or one per --concurrency")  # fmt: skip
    p.add_argument("--warmup", type=int, help="warm-up requests per level (default: one per stream)")
    p.add_argument("--ramp-s", type=float, default=0.0,
                   help="the measured streams start this many seconds apart in all, evenly (default: all at once, "
                        "after the warm-up: a wave of every stream's first request)")  # fmt: skip
    p.add_argument("--direct-concurrency", type=int_list, default=[64],
                   help="levels also sent to the active engine's Unix socket directly ('none': none)")  # fmt: skip
    p.add_argument("--client-procs", type=int, default=8, help="load client processes")
    p.add_argument("--client", choices=("raw", "httpx"), default="raw", help="the clients' HTTP client")
    p.add_argument("--client-loop", choices=("auto", "asyncio"), default="auto", help="auto: uvloop where installed")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--settle-timeout", type=float, default=240.0,
                   help="seconds to wait, before the sweep, for the standby engines to finish starting")  # fmt: skip
    p.add_argument("--deadline-s", type=float,
                   help="seconds from the script's start after which no request, level or restart probe starts "
                        "(what was measured is kept)")  # fmt: skip
    p.add_argument("--variants", type=lambda t: t.split(","), default=["plain"],
                   help="each gateway level runs once per entry: plain, json_schema (every token held to a schema), "
                        "logprobs=N (N alternatives per token)")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=160)
    p.add_argument("--prompt-jitter", type=int, default=3)
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with (before its own)")
    p.add_argument("--chat", action="store_true",
                   help="chat completions of text (a system message of --shared-prefix tokens every request shares, "
                        "a user message of --prompt-len of its own; the words from --model's tokenizer)")  # fmt: skip
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=49152, help="token ids are drawn from [1000, vocab-1000)")
    p.add_argument("--restart-probe", type=int, default=10, help="sequential requests after start and restart")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fault",
        choices=("kill-supervisor", "upgrade"),
        help="inject this into the gateway levels of --fault-levels, --fault-at s into their requests",
    )
    p.add_argument("--fault-at", type=float, default=5.0)
    p.add_argument("--fault-levels", type=int_list, default=[64])
    args = p.parse_args()
    for variant in args.variants:
        try:
            variant_fields(variant)
        except ValueError as exc:
            p.error(f"--variants: {exc}")
    if len(args.requests_per_client) not in (1, len(args.concurrency)):
        p.error("--requests-per-client: one value, or one per --concurrency level")
    if len(args.requests_per_client) == 1:
        args.requests_per_client = args.requests_per_client * len(args.concurrency)
    args.started = time.monotonic()
    signal.signal(signal.SIGTERM, on_sigterm)
    nofile = raise_nofile()  # the server started below inherits it
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "git_commit": git_commit(), "nofile": list(nofile), "cpu_count": os.cpu_count(),
                              "levels": [], "skipped": []}  # fmt: skip

    def write() -> None:
        result["probe_summary"] = probe_summary(result)
        result["direct_summary"] = direct_summary(result)
        (args.out / "serve_load.json").write_text(json.dumps(result, indent=1) + "\n")
        (args.out / "serve_load.md").write_text(markdown(result))

    proc = None
    run_dir = args.run_dir
    serve_log = args.serve_log
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
        result["engine_settings"] = ", ".join(f"{k} = {json.dumps(v)}" for k, v in
                                              tomllib.loads(result["config_toml"])["engine"].items())  # fmt: skip
        cmd = [sys.executable, "-m", "app.cli", "serve", "--model", str(args.model), "--port", str(port),
               "--run-dir", str(run_dir), "--config", str(config)]  # fmt: skip
        say(f"starting: {' '.join(cmd)} (log {logs[0]}; open files {nofile})")
        serve_log = logs[0]
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
        Bench(args, url, run_dir, proc.pid if proc else None, serve_log, result, write).run()
    except BaseException as exc:  # still write what was measured (a long GPU sweep is worth keeping)
        result["failed"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second TERM must not cut the clean-up short
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):  # what is left of the server's own process group: its
                os.killpg(proc.pid, signal.SIGKILL)  # cache and engines (a TERM during start-up leaves the cache)
            proc.wait()
        if run_dir is not None and run_dir.exists():
            for path in sorted(run_dir.glob("*.log")):
                shutil.copy(path, args.out / path.name)
                logs.append(args.out / path.name)
        result["device_name"] = device_name(logs, args.device)
        write()
        say(markdown(result))


if __name__ == "__main__":
    main()
