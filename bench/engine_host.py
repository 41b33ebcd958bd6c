"""An engine process's host work per generated token, thread by thread, on the CPU: the real engine worker (its
HTTP server, text, SSE framing, the internal stream the relays read, its scheduler and sampler) with the model
runner's step as a CUDA graph's looks from the host: its inputs staged and copied with two torch calls (the
upload), then launched on a stand-in GPU that runs each step for ``--step-ms`` after the one before it; a step's
tokens are read (``Drawn.read``) once its time there ended, the engine thread waiting without the GIL, as on a
CUDA event. The logits are made once, with their argmax. Streaming clients read it on its socket, as the relays
do.

    python bench/engine_host.py [--streams 64] [--step-ms 6] [--seconds 20] [--logprobs N] [--token-us U]
                                [--shared-prefix N --prompt-len L] [--profile engine|loop] [--fronts N]
                                [--set KEY=VALUE] [--out FILE]
    python bench/engine_host.py --burst 64 [--rounds 10] [--prompt-len 160] [--shared-prefix N | --chat-words N] ...

Reported: output tokens/s and each request's time to its first chunk (``ttft_ms``: the admission, the internal
stream's first comment), and to its first token's text from its front's receipt (``front_ttft_ms``, the engine's
request lines); CPU microseconds per generated token of the engine thread, the HTTP loops (the front processes' main
threads, engine/front.py; the worker's own with ``--fronts 0``), the worker's main thread reading the fronts' links
and the rest (from /proc, per thread); the stand-in GPU's idle share between back-to-back steps (``gpu_idle``: the
time it had no step to run, from one step's end to the next one's launch, over the steps' wall time;
``step_wall_ms``), and the engine's own figure for it from its ``engine_stats`` lines (``engine_device_idle``); and
the cores the clients used (on a machine of two cores they compete with the engine: read tokens/s there with that in
mind). ``--profile``: that thread's functions under cProfile (its overhead inflates every figure: read them as
shares).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.serve_load import thread_cpu

DEVICE_IDLE = re.compile(r"device_idle=([\d.]+)")  # the engine's own figure, in its engine_stats lines
FRONT_TTFT = re.compile(r"event=request .* ttft_ms=([\d.]+)")  # a request's receipt to its first text, by its front
GAPS_FILE = ".gpu.json"  # beside the engine's socket: the stand-in GPU's steps, busy and idle seconds
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def worker(socket_path: str, config: str, step_ms: float, token_us: float, profile: Path | None) -> None:
    """The engine worker, its model replaced as the module docstring says."""
    import torch

    from engine import worker as engine_worker
    from engine.native import llm_engine
    from engine.native.model_runner import StepOutput

    original = llm_engine.LLMEngine.__init__
    gpu = {"steps": 0, "busy": 0.0, "idle": 0.0, "free_at": 0.0}  # the stand-in GPU's time, for GAPS_FILE

    class Timing:
        def __init__(self, seconds: float, ends: float) -> None:
            self._seconds, self._ends = seconds, ends

        def seconds(self) -> float:
            return self._seconds

        def done(self) -> bool:
            return time.perf_counter() >= self._ends

    drawing = llm_engine.draw

    def draw(*args: Any, **kwargs: Any) -> Any:
        """A step's tokens (the step launched last), read once the stand-in GPU has run it."""
        drawn, ends = drawing(*args, **kwargs), gpu["free_at"]
        read = drawn.read

        def read_when_done() -> Any:
            if (wait := ends - time.perf_counter()) > 0:
                time.sleep(wait)
            return read()

        drawn.read = read_when_done
        return drawn

    llm_engine.draw = draw

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        runner = self.runner
        runner.asynchronous = True  # its steps run on the stand-in GPU, after the call returns
        logits_rows = torch.randn(runner.max_seqs, self.args.shape.vocab, generator=torch.Generator().manual_seed(0))
        argmax = logits_rows.argmax(dim=-1)

        # The device's copies of the staged inputs: on a GPU they are uploaded with two torch calls, and a torch
        # call lets go of the GIL, which the HTTP loop may then hold (the runner's meta and tables are the host
        # buffers themselves on the CPU, so copies stand in for them).
        meta, tables = runner.host.clone(), runner.host_tables.clone()

        def run(step: Any, every_token: Any = frozenset(), drawn: Any = None) -> StepOutput:
            """A CUDA graph's step on the host: stage the inputs, upload them, launch (the stand-in GPU starts it when
            the step before it ends)."""
            seqs, tokens = len(step), sum(w.count for w in step)
            runner._stage(step, tokens, seqs)
            step_s = (step_ms + tokens * token_us / 1e3) / 1e3
            meta.copy_(runner.host)
            tables[:seqs].copy_(runner.host_tables[:seqs])
            now = time.perf_counter()
            if 0 < now - gpu["free_at"] < 0.1:  # back to back, but the GPU ran out of work: it idled until now
                gpu["idle"] += now - gpu["free_at"]
            if now - gpu["free_at"] < 0.1:
                gpu["steps"] += 1
                gpu["busy"] += step_s
            gpu["free_at"] = max(now, gpu["free_at"]) + step_s
            if gpu["steps"] % 50 == 0:
                Path(socket_path + GAPS_FILE).write_text(json.dumps(gpu))
            return StepOutput(logits_rows[:seqs], argmax[:seqs], Timing(step_s, gpu["free_at"]))  # type: ignore[arg-type]

        runner.run = run

    llm_engine.LLMEngine.__init__ = init
    if profile is None:
        engine_worker.main(socket_path, config)
        return
    import cProfile

    profiler = cProfile.Profile(time.thread_time)  # the thread's CPU: a wait for the GIL counts for nothing
    if profile.stem == "engine":  # the engine thread's loop, from its start to its end
        loop = llm_engine.LLMEngine._loop

        def profiled_loop(self: Any) -> None:
            profiler.enable()
            try:
                loop(self)
            finally:
                profiler.disable()
                profiler.dump_stats(str(profile))

        llm_engine.LLMEngine._loop = profiled_loop
        engine_worker.main(socket_path, config)
        return
    from engine import front

    serve_front = front.run_front

    def profiled_front(*args: Any, **kwargs: Any) -> int:  # the HTTP loop: a front process's main thread
        profiler.enable()
        try:
            return serve_front(*args, **kwargs)
        finally:
            profiler.disable()
            index = kwargs["index"]
            profiler.dump_stats(str(profile) if index == 0 else f"{profile}.{index}")  # the first front's: the report's

    front.run_front = profiled_front
    if json.loads(config).get("front_processes") == 0:  # one process: the HTTP loop is its main thread
        profiler.enable()
        try:
            engine_worker.main(socket_path, config)
        finally:
            profiler.disable()
            profiler.dump_stats(str(profile))
    else:
        engine_worker.main(socket_path, config)


async def load(socket_path: str, streams: int, seconds: float, max_tokens: int, extra: dict[str, Any],
               ttfts: list[float] | None = None, prompts: Any = None) -> tuple[int, float]:  # fmt: skip
    """Streaming completions from ``streams`` clients for ``seconds``: the tokens they got and the seconds it took
    (and into ``ttfts``, each request's seconds to its first chunk). ``prompts``: each request's prompt from it
    (token ids), else one short text for all. The clients are made before the clock starts: making 64 of them takes
    this machine about two seconds, in which the first requests' answers would wait unread."""
    import httpx

    from engine.internal_stream import RESUMABLE_HEADER

    tokens = 0
    body = {"prompt": "Count: one, two, three,", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **extra}  # fmt: skip
    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://engine",
                                 timeout=120) for _ in range(streams)]  # fmt: skip
    began = time.monotonic()
    deadline = began + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        async with http:
            while time.monotonic() < deadline:
                sent, first = time.perf_counter(), None
                sending = body if prompts is None else {**body, "prompt": prompts()}
                async with http.stream("POST", "/v1/completions", json=sending,
                                       headers={RESUMABLE_HEADER: "1"}) as response:  # fmt: skip
                    assert response.status_code == 200, await response.aread()
                    async for _ in response.aiter_raw():
                        first = first or time.perf_counter()
                if ttfts is not None and first is not None:
                    ttfts.append(first - sent)
                tokens += max_tokens  # ignore_eos: every answer has max_tokens tokens

    await asyncio.gather(*(client(http) for http in clients))
    return tokens, time.monotonic() - began


async def bursts(socket_path: str, size: int, rounds: int, prompt_len: int, max_tokens: int, vocab: int,
                 resumed: int = 0, shared_prefix: int = 0,
                 chat_words: int = 0) -> list[list[tuple[float, float]]]:  # fmt: skip
    """``rounds`` times, ``size`` streaming requests sent at once (distinct prompts of ``prompt_len`` token ids, as
    a wave of new requests), each round once the one before ended: each round's seconds from its sending to each
    request's opening and first token. ``resumed``: each is a request resumed after that many tokens (the gateway's
    ``warmgate_resume``, as the relays send the streams a crash moved to a new engine). ``shared_prefix``: every
    prompt starts with the same that many token ids (a system prompt: with prefix caching, computed once).
    ``chat_words``: chat requests instead, as text: a system message of that many words every request shares and a
    question of ``prompt_len`` words of its own (the front renders and tokenizes them)."""
    import random

    import httpx

    from engine.internal_stream import RESUMABLE_HEADER

    rng = random.Random(0)
    shared = [rng.randrange(1000, vocab - 1000) for _ in range(shared_prefix)]
    syllables = ["ka", "lo", "mi", "ren", "tas", "or", "ul", "be", "si", "con", "ter", "ing", "pro", "ex", "al", "ma",
                 "ti", "on", "er", "an", "de", "vel", "str", "ous"]  # fmt: skip
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)]
    system = " ".join(rng.choice(words) for _ in range(chat_words))
    clients = [httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=socket_path), base_url="http://engine",
                                 timeout=120) for _ in range(size)]  # fmt: skip

    async def one(http: httpx.AsyncClient, prompt: list[int], sent: float) -> tuple[float, float]:
        """Seconds to the stream's opening (the engine admitted it: its first chunk, a comment of the internal
        stream) and to its first token (its first data event; a chat's first after its role chunk)."""
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens + resumed, "temperature": 0,
                                "ignore_eos": True, "stream": True}  # fmt: skip
        path, first_data = "/v1/completions", 1
        if chat_words:
            question = " ".join(words[i % len(words)] for i in prompt)
            body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": [
                {"role": "system", "content": system}, {"role": "user", "content": question}]}  # fmt: skip
            path, first_data = "/v1/chat/completions", 2
        if resumed:
            output = [rng.randrange(1000, vocab - 1000) for _ in range(resumed)]
            body["warmgate_resume"] = {"id": f"cmpl-{id(prompt)}", "created": 0, "prompt_ids": prompt,
                                       "output_ids": output, "chars": 0, "started": True}  # fmt: skip
        opened = token = None
        data = 0
        async with http.stream("POST", path, json=body, headers={RESUMABLE_HEADER: "1"}) as response:
            assert response.status_code == 200, await response.aread()
            async for chunk in response.aiter_raw():
                opened = opened or time.perf_counter()
                data += chunk.count(b"data: {")
                if token is None and data >= first_data:
                    token = time.perf_counter()
        assert opened is not None and token is not None
        return opened - sent, token - sent

    out = []
    for _ in range(rounds):
        prompts = [shared + [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)] for _ in clients]
        sent = time.perf_counter()
        out.append(await asyncio.gather(*(one(h, p, sent) for h, p in zip(clients, prompts, strict=True))))
        await asyncio.sleep(0.2)
    for http in clients:
        await http.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=6.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--logprobs", type=int, help="each request asks for this many alternatives per token")
    parser.add_argument("--token-us", type=float, default=0.0,
                        help="the stand-in step's time per token on top of --step-ms (a prefill's cost; ~15 us on "
                             "the H200 for llama3-8b fp8-block: 2,048-token steps of 36 ms)")  # fmt: skip
    parser.add_argument("--burst", type=int, default=0,
                        help="instead of streams: rounds of this many requests sent at once (--prompt-len token ids, "
                             "--max-tokens each); reported: each one's time to its first chunk, the loop's CPU per "
                             "request")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--resumed", type=int, default=0, help="--burst: each request resumed after this many tokens")
    parser.add_argument("--prompt-len", type=int, default=160)
    parser.add_argument("--shared-prefix", type=int, default=0,
                        help="token ids every prompt starts with (before its own --prompt-len); without --burst, the "
                             "streams' prompts are these instead of one short text")  # fmt: skip
    parser.add_argument("--chat-words", type=int, default=0,
                        help="--burst: chat requests as text instead, a system message of this many words shared, "
                             "a question of --prompt-len words")  # fmt: skip
    parser.add_argument("--profile", choices=("engine", "loop"), help="profile this thread")
    parser.add_argument(
        "--fronts",
        type=int,
        default=1,
        help="the engine's front processes (front_processes; 0: its HTTP API in the worker's process)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting, the value as JSON (e.g. late_scheduling=false)",
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        socket_path, config, step_ms, token_us, profile = args.worker
        worker(socket_path, config, float(step_ms), float(token_us), Path(profile) if profile != "-" else None)
        return
    from cache.checkpoint.demo import build_demo
    from cache.checkpoint.synth import SHAPES, synth_checkpoint

    demo = build_demo("bf16", progress=False)  # its tokenizer: the text work is the real one
    tmp = Path(tempfile.mkdtemp(prefix="engine-host-"))
    model = synth_checkpoint(tmp / "tiny", {**SHAPES["smollm2-135m"], **TINY}, "bf16", tokenizer=demo,
                             progress=False)  # fmt: skip
    socket_path = str(tmp / "engine.sock")
    longest = args.shared_prefix + 2 * args.chat_words + args.prompt_len + args.max_tokens
    config = json.dumps({"model": str(model), "device": "cpu", "max_num_seqs": max(args.streams, args.burst),
                         "max_model_len": max(1024, 2 * longest), "front_processes": args.fronts,
                         **{k: json.loads(v) for k, _, v in (item.partition("=") for item in args.set)}})  # fmt: skip
    profile = tmp / f"{args.profile}.prof" if args.profile else None
    cmd = [sys.executable, __file__, "--worker", socket_path, config, str(args.step_ms), str(args.token_us),
           str(profile or "-")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with (tmp / "worker.log").open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    try:
        while not Path(socket_path).exists() or b"event=ready" not in (tmp / "worker.log").read_bytes():
            if proc.poll() is not None:
                raise SystemExit((tmp / "worker.log").read_text()[-3000:])
            time.sleep(0.1)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        if args.burst:
            result = measure_bursts(args, socket_path, proc.pid, vocab)
        else:
            result = measure_streams(args, socket_path, proc.pid, tmp / "worker.log", vocab)
    finally:
        proc.terminate()
        proc.wait(60)
    result.update(settings=args.set, cpu_count=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
    print(json.dumps(result))
    print_profile(profile)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


def quantiles(samples: list[float], points: dict[str, float]) -> dict[str, float]:
    """Milliseconds at each named fraction of the sorted samples (seconds)."""
    ordered = sorted(samples)
    return {q: round(1e3 * ordered[int(f * (len(ordered) - 1))], 1) for q, f in points.items()}


def measure_bursts(args: argparse.Namespace, socket_path: str, pid: int, vocab: int) -> dict[str, Any]:
    asyncio.run(bursts(socket_path, args.burst, 1, args.prompt_len, args.max_tokens, vocab, 0,
                       args.shared_prefix, args.chat_words))  # warm  # fmt: skip
    before = thread_cpu(pid) or {}
    rounds = asyncio.run(bursts(socket_path, args.burst, args.rounds, args.prompt_len, args.max_tokens, vocab,
                                args.resumed, args.shared_prefix, args.chat_words))  # fmt: skip
    after = thread_cpu(pid) or {}
    requests = args.burst * args.rounds
    points = {"p50": 0.5, "p90": 0.9, "max": 1.0}
    return {"burst": args.burst, "rounds": args.rounds, "prompt_len": args.prompt_len,
            "shared_prefix": args.shared_prefix, "chat_words": args.chat_words, "resumed": args.resumed,
            "max_tokens": args.max_tokens, "step_ms": args.step_ms, "token_us": args.token_us,
            "admitted_ms": quantiles([t[0] for r in rounds for t in r], points),
            "first_token_ms": quantiles([t[1] for r in rounds for t in r], points),
            "last_admitted_ms_per_round": [round(1e3 * max(t[0] for t in r), 1) for r in rounds],
            "last_first_token_ms_per_round": [round(1e3 * max(t[1] for t in r), 1) for r in rounds],
            "cpu_us_per_request": {k: round((after.get(k, 0) - before.get(k, 0)) / requests * 1e6, 1)
                                   for k in after}}  # fmt: skip


def measure_streams(args: argparse.Namespace, socket_path: str, pid: int, worker_log: Path,
                    vocab: int) -> dict[str, Any]:  # fmt: skip
    extra = {"logprobs": args.logprobs} if args.logprobs is not None else {}
    prompts = None
    if args.shared_prefix:  # each request: the shared token ids, then --prompt-len of its own
        import random

        rng = random.Random(0)
        shared = [rng.randrange(1000, vocab - 1000) for _ in range(args.shared_prefix)]

        def prompts() -> list[int]:
            return shared + [rng.randrange(1000, vocab - 1000) for _ in range(args.prompt_len)]

    asyncio.run(load(socket_path, args.streams, 2.0, args.max_tokens, extra, None, prompts))  # warm: every stream
    before, client = thread_cpu(pid) or {}, time.process_time()
    gpu_before = json.loads(Path(socket_path + GAPS_FILE).read_text())
    log_offset = worker_log.stat().st_size
    ttfts: list[float] = []
    tokens, wall = asyncio.run(load(socket_path, args.streams, args.seconds, args.max_tokens, extra, ttfts, prompts))
    after, client = thread_cpu(pid) or {}, time.process_time() - client
    gpu_after = json.loads(Path(socket_path + GAPS_FILE).read_text())
    lines = worker_log.read_text()[log_offset:].splitlines()
    stats_lines = [line for line in lines if "event=engine_stats" in line]
    front_ttfts = [float(m) / 1e3 for line in lines for m in FRONT_TTFT.findall(line)]
    steps, busy, idle = (gpu_after[k] - gpu_before[k] for k in ("steps", "busy", "idle"))
    per_token = {k: round((after.get(k, 0) - before.get(k, 0)) / tokens * 1e6, 2) for k in after}
    return {"streams": args.streams, "logprobs": args.logprobs, "step_ms": args.step_ms, "seconds": round(wall, 1),
            "tokens": tokens,
            "tok_s": round(tokens / wall), "ideal_tok_s": round(args.streams / args.step_ms * 1e3),
            "ttft_ms": quantiles(ttfts, {"p50": 0.5, "p90": 0.9, "p99": 0.99}),
            "front_ttft_ms": quantiles(front_ttfts, {"p50": 0.5, "p90": 0.9, "p99": 0.99}) if front_ttfts else None,
            "shared_prefix": args.shared_prefix, "prompt_len": args.prompt_len if args.shared_prefix else None,
            "cpu_us_per_token": per_token, "gpu_idle": round(idle / (idle + busy), 3),
            "step_wall_ms": round((idle + busy) / steps * 1e3, 2),
            "engine_device_idle": [float(m) for line in stats_lines for m in DEVICE_IDLE.findall(line)],
            "client_cores": round(client / wall, 2)}  # fmt: skip


def print_profile(profile: Path | None) -> None:
    if profile is not None and profile.exists():
        import pstats

        stats = pstats.Stats(str(profile))
        stats.sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
