"""The engine worker as a real process on a real Unix socket, driving the real engine on the bf16 demo model (CPU)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import PROMPT
from processes import MAX_MODEL_LEN, Worker, health, launch_worker, start_worker, wait_for

from common.uds import bind_unix_socket
from engine.tokenizer import ChatTokenizer

FRANCE = [{"role": "user", "content": PROMPT}]


def stop_worker(worker: Worker) -> None:
    worker.stop()


@pytest.fixture(scope="module")
def model(demo_path) -> Path:
    return demo_path("bf16")


@pytest.fixture(scope="module")
def worker(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    running = start_worker(tmp_path_factory.mktemp("engine"), model)
    yield running
    stop_worker(running)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> ChatTokenizer:
    return ChatTokenizer(model)


async def read_stream(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of an SSE response, checking the framing and the closing [DONE]."""
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = (await response.aread()).decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-200:]
    assert all(e.startswith("data: ") for e in events[:-1])
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


def chat_stream_text(events: list[dict[str, Any]]) -> tuple[str, str, list[str]]:
    """(text, finish_reason, content pieces) of a chat stream, checking its shape."""
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert choices[0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["delta"]["content"] for c in choices[1:] if c["delta"].get("content")]
    finishes = [c["finish_reason"] for c in choices if c["finish_reason"] is not None]
    assert len(finishes) == 1 and choices[-1]["finish_reason"] == finishes[0]
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    return "".join(pieces), finishes[0], pieces


def assert_openai_error(response: httpx.Response, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    for word in words:
        assert word in body["error"]["message"], body
    return body["error"]


def test_startup_phases_logged_and_socket_private(worker: Worker) -> None:
    log = worker.log()
    phases = ("import", "tokenizer", "device_init", "weight_load", "model_init", "kv_alloc", "warmup", "server_warmup")
    for phase in phases:
        assert f"event=startup phase={phase} seconds=" in log, log
    assert "event=ready" in log
    assert stat.S_IMODE(worker.socket.stat().st_mode) == 0o600


def test_models_and_health(worker: Worker, model: Path) -> None:
    async def run() -> None:
        async with worker.client() as client:
            models = (await client.get("/v1/models")).json()
            one = (await client.get(f"/v1/models/{model.name}")).json()
            other = await client.get("/v1/models/other%2Fmodel")
            health = await client.get("/health")
        assert one == models["data"][0]
        assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
        assert "other/model" in other.json()["error"]["message"]
        assert models["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [
            (model.name, "model", MAX_MODEL_LEN)
        ]
        assert health.status_code == 200 and health.json()["status"] == "ok"

    asyncio.run(run())


def test_concurrent_chat_and_completions(worker: Worker, tokenizer: ChatTokenizer, model: Path) -> None:
    greedy = {"messages": FRANCE, "temperature": 0, "model": model.name}
    completion = {"prompt": "The capital of France is", "temperature": 0, "max_tokens": 5, "ignore_eos": True}

    async def run() -> list[Any]:
        async with worker.client() as client:
            return await asyncio.gather(
                client.post("/v1/chat/completions", json=greedy),
                read_stream(client, "/v1/chat/completions", {**greedy, "stream_options": {"include_usage": True}}),
                client.post("/v1/chat/completions", json={**greedy, "max_tokens": 5}),
                client.post("/v1/chat/completions", json={**greedy, "stop": [" Paris", "Lyon"]}),
                read_stream(client, "/v1/chat/completions", {**greedy, "stop": " Paris"}),
                client.post("/v1/completions", json=completion),
                read_stream(client, "/v1/completions", {**completion, "stream_options": {"include_usage": True}}),
            )

    plain, streamed, short, stopped, stopped_stream, text, text_stream = asyncio.run(run())
    prompt_tokens = len(tokenizer.apply_chat_template(FRANCE))

    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["object"] == "chat.completion" and body["model"] == model.name
    answer = body["choices"][0]
    assert answer["message"]["role"] == "assistant" and "Paris" in answer["message"]["content"]
    assert answer["finish_reason"] == "stop" and "<|im_end|>" not in answer["message"]["content"]
    usage = body["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    text_out, finish, pieces = chat_stream_text(streamed)
    assert (text_out, finish) == (answer["message"]["content"], "stop")
    # The same counts; how much of the prompt each found cached depends on which of them computed it first.
    cached = [u.pop("prompt_tokens_details")["cached_tokens"] for u in (usage, streamed[-1]["usage"])]
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == usage
    assert all(0 <= c < prompt_tokens and c % 16 == 0 for c in cached), cached  # whole blocks, not the last token
    # Each token of this English answer is a chunk; the final <|im_end|> is counted but never shown.
    assert usage["completion_tokens"] == len(pieces) + 1

    short_body = short.json()
    assert short_body["choices"][0]["finish_reason"] == "length"
    assert short_body["usage"]["completion_tokens"] == 5
    assert answer["message"]["content"].startswith(short_body["choices"][0]["message"]["content"])

    before_paris = answer["message"]["content"].split(" Paris")[0]
    assert stopped.json()["choices"][0] == {
        "index": 0,
        "message": {"role": "assistant", "content": before_paris},
        "finish_reason": "stop",
        "logprobs": None,
    }
    assert chat_stream_text(stopped_stream)[:2] == (before_paris, "stop")

    text_body = text.json()
    assert text_body["object"] == "text_completion"
    assert text_body["choices"][0]["finish_reason"] == "length" and "Paris" in text_body["choices"][0]["text"]
    assert text_body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10,
                                  "prompt_tokens_details": {"cached_tokens": 0}}  # less than a block  # fmt: skip
    choices = [e["choices"][0] for e in text_stream if e["choices"]]
    assert "".join(c["text"] for c in choices) == text_body["choices"][0]["text"]
    assert len(choices) == 5 and choices[-1]["finish_reason"] == "length"
    assert text_stream[-1]["usage"] == text_body["usage"]


def test_long_texts_tokenized_off_the_loop_give_the_tokenizers_ids_and_its_refusals(
    worker: Worker, tokenizer: ChatTokenizer
) -> None:
    """Prompts past THREADED_TEXT_CHARS are tokenized in a worker thread (engine/server.py: EngineAPI.prompts), many
    at once: each gets the ids the tokenizer gives (its usage counts them; the text answers as its ids do), and a
    text refused (a lone surrogate, in the thread; a prompt over the context, after it) gets the 400 it gets inline.
    The texts share a long beginning, computed once (a request of each kind before the rest): the CPU engine's
    prefill stays short beside the other tests."""
    from engine.server import THREADED_TEXT_CHARS

    base = " ".join(["the river ran past the old stone house and the garden"] * 40)
    texts = [f"{base} Now name thing number {i}." for i in range(3)]
    assert all(len(t) >= THREADED_TEXT_CHARS and len(tokenizer.encode(t)) < MAX_MODEL_LEN - 32 for t in texts)
    greedy = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
    chats = [[{"role": "system", "content": t}, {"role": "user", "content": "Name one."}] for t in texts]
    too_long = " ".join([base] * 4)
    assert len(tokenizer.encode(too_long)) > MAX_MODEL_LEN

    async def run() -> list[Any]:
        async with worker.client(timeout=120) as client:
            for path, body in (("/v1/chat/completions", {"messages": chats[0]}), ("/v1/completions", {"prompt": base})):
                assert (await client.post(path, json={**body, "max_tokens": 1})).status_code == 200
            sent = [client.post("/v1/chat/completions", json={**greedy, "messages": m}) for m in chats]
            sent += [client.post("/v1/completions", json={**greedy, "prompt": t}) for t in texts]
            sent += [client.post("/v1/completions", json={**greedy, "prompt": tokenizer.encode(t)}) for t in texts]
            sent.append(read_stream(client, "/v1/chat/completions", {**greedy, "messages": chats[0]}))
            headers = {"content-type": "application/json"}
            lone = json.dumps({**greedy, "prompt": texts[0]}).replace("river", "\\ud800", 1).encode()
            sent.append(client.post("/v1/completions", content=lone, headers=headers))
            sent.append(client.post("/v1/completions", json={**greedy, "prompt": too_long}))
            return await asyncio.gather(*sent)

    responses = asyncio.run(run())
    chat, text, ids = responses[0:3], responses[3:6], responses[6:9]
    for response, messages in zip(chat, chats, strict=True):
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(tokenizer.apply_chat_template(messages))
    for by_text, by_ids, t in zip(text, ids, texts, strict=True):
        assert by_text.status_code == by_ids.status_code == 200, (by_text.text, by_ids.text)
        assert by_text.json()["usage"]["prompt_tokens"] == len(tokenizer.encode(t))
        assert by_text.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    assert chat_stream_text(responses[9])[0] == chat[0].json()["choices"][0]["message"]["content"]
    assert_openai_error(responses[10], 400, "not valid Unicode")
    assert assert_openai_error(responses[11], 400, "maximum context length")["param"] == "prompt"


def test_each_request_logs_its_admission_and_first_token_times_within_what_the_client_saw(worker: Worker) -> None:
    """The request log line: admit_ms (receipt to admission) <= ttft_ms (receipt to the first token's text) <= the
    client's own time to the first token's event (which holds the engine's and more), streamed or not; received_at
    on the monotonic clock the test's process reads too."""
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    began = time.monotonic()

    async def run() -> tuple[str, float, str, float]:
        async with worker.client() as client:
            started = time.monotonic()
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = response.aiter_lines()
                first = await anext(line async for line in lines if line.startswith("data: {"))
                streamed_ms = 1e3 * (time.monotonic() - started)
                async for _ in lines:
                    pass
            started = time.monotonic()
            whole = await client.post("/v1/completions", json=body)
            whole_ms = 1e3 * (time.monotonic() - started)
            return json.loads(first.removeprefix("data: "))["id"], streamed_ms, whole.json()["id"], whole_ms

    streamed_id, streamed_ms, whole_id, whole_ms = asyncio.run(run())

    def fields(request_id: str) -> dict[str, str]:
        lines = wait_for(lambda: [ln for ln in worker.log().splitlines() if f"event=request id={request_id} " in ln],
                         30, f"the log line of {request_id}")  # written as the response ends  # fmt: skip
        return dict(part.split("=", 1) for part in lines[0].split("event=request ")[1].split())

    for request_id, client_ms in ((streamed_id, streamed_ms), (whole_id, whole_ms)):
        logged = fields(request_id)
        assert 0 <= float(logged["admit_ms"]) <= float(logged["ttft_ms"]) <= client_ms, (logged, client_ms)
        assert began <= float(logged["received_at"]) <= time.monotonic(), logged  # one clock for the host


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_concurrent_prompts_of_every_length_in_a_tight_kv_cache(model: Path, tmp_path: Path,
                                                                kv_cache_dtype: str) -> None:  # fmt: skip
    """16 clients at once, prompts of 1-600 tokens, prefilled in 128-token chunks, with KV blocks for fewer
    tokens than they need together (the engine preempts and recomputes): each stream's text is what the
    same request gets alone, and /health counts the preemptions. With the cache in fp8 (four times the blocks of the
    same bytes) the streams end, preempted and recomputed, and every block comes back; their texts are not compared:
    the CPU's attention (torch) differs in the last bits with a chunk's rows (one row against several), which an fp8
    cache's rounding can turn into another greedy token, where the fp32 cache's cannot."""
    per_token = 30 * 2 * 3 * 64 * (4 if kv_cache_dtype == "auto" else 1)  # the demo in fp32, or its cache in fp8
    worker = start_worker(tmp_path, model, max_num_seqs=16, max_num_batched_tokens=128,
                          kv_cache_bytes=per_token * 16 * 66, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    lengths = [1, 7, 40, 64, 65, 100, 128, 129, 200, 257, 300, 333, 400, 480, 555, 600]
    prompts = [[(i * 7919 + j * 104729) % 40000 + 100 for j in range(n)] for i, n in enumerate(lengths)]

    def body(prompt: list[int]) -> dict[str, Any]:
        return {"prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True}

    def text(events: list[dict[str, Any]]) -> str:
        return "".join(e["choices"][0]["text"] for e in events if e["choices"])

    async def together() -> list[list[dict[str, Any]]]:
        async with worker.client(timeout=300) as client:  # recomputing preempted prompts on 2 shared cores
            return await asyncio.gather(*(read_stream(client, "/v1/completions", body(p)) for p in prompts))

    try:
        concurrent = [text(events) for events in asyncio.run(together())]
        with worker.sync_client() as client:
            health = client.get("/health").json()
            alone = [client.post("/v1/completions", json=body(p)).json()["choices"][0]["text"] for p in prompts]
        assert health["preemptions"] > 0, health
        assert health["kv_blocks_free"] == health["kv_blocks_total"] == 65, "every block returned"
        assert health["memory"]["kv_cache_dtype"] == {"auto": "float32", "fp8": "float8_e4m3fn"}[kv_cache_dtype]
        for n, got, expected in zip(lengths, concurrent, alone, strict=True):
            assert got and expected, n
            assert kv_cache_dtype == "fp8" or got == expected, n
    finally:
        stop_worker(worker)


BAD_REQUESTS = [
    ("/v1/chat/completions", {"temperature": 0}, 400, "messages"),
    ("/v1/chat/completions", {"messages": FRANCE, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": FRANCE, "n": 1000}, 400, "less than or equal to 16"),
    ("/v1/chat/completions", {"messages": FRANCE, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 5000}, 400, "maximum context length"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ("/v1/chat/completions", {"messages": FRANCE, "model": "gpt-4o"}, 404, "gpt-4o"),
    ("/v1/completions", {"prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": ["one", "two"], "n": 9}, 400, "passes 16 choices"),
    ("/v1/completions", {"prompt": [1, 10**9]}, 400, "out of range"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "out of range"),
    ("/v1/completions", {"prompt": [1, 2.0]}, 400, "prompt"),  # token ids are JSON integers
    ("/v1/completions", {"prompt": [True]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], ["a"]]}, 400, "prompt"),
]


async def read_internal(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[tuple[str, dict]]:
    """The internal stream the gateway reads: ("data", chunk) and ("ids", note) items in order, up to [DONE]."""
    headers = {"x-warmgate-resumable": "1"}
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        raw = (await response.aread()).decode()
    items: list[tuple[str, dict]] = []
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], raw[-200:]
    for event in events[:-2]:
        for line in event.split("\n"):
            if line.startswith("data: "):
                items.append(("data", json.loads(line.removeprefix("data: "))))
            else:
                assert line.startswith(": warmgate "), line
                items.append(("ids", json.loads(line.removeprefix(": warmgate "))))
    return items


def streamed_text(items: list[tuple[str, dict]], chat: bool) -> str:
    pieces = []
    for kind, item in items:
        for choice in item.get("choices", []) if kind == "data" else []:
            pieces.append((choice["delta"].get("content") if chat else choice["text"]) or "")
    return "".join(pieces)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}])
def test_a_request_resumed_after_any_event_continues_exactly(worker: Worker, path: str, sampling: dict) -> None:
    chat = path.endswith("chat/completions")
    prompt = {"messages": FRANCE} if chat else {"prompt": "A short story about a robot who"}
    body = {**prompt, **sampling, "max_tokens": 24, "stop": ["zq!"], "stream_options": {"include_usage": True}}

    async def run() -> None:
        async with worker.client() as client:
            whole = await read_internal(client, path, body)
            opening = whole[0][1]
            assert whole[0][0] == "ids" and opening["prompt_ids"]
            assert opening["id"].startswith("chatcmpl" if chat else "cmpl")
            notes = [(i, item) for i, (kind, item) in enumerate(whole) if kind == "ids" and i > 0]
            all_ids = [t for _, note in notes for t in note["ids"]]
            usage = whole[-1][1]["usage"]
            assert usage["completion_tokens"] == len(all_ids) and usage["prompt_tokens"] == len(opening["prompt_ids"])
            # The first note says how much of the prompt was cached (the usage's figure), and only the first.
            cached = notes[0][1]["cached"]
            assert usage["prompt_tokens_details"] == {"cached_tokens": cached}
            assert all("cached" not in note for _, note in notes[1:])
            text = streamed_text(whole, chat)
            # Cut after token-carrying events (the first, the last but one, and four between): resume with
            # what a client had received by then.
            cuts = notes[:-1]
            for cut, note in [cuts[round(i * (len(cuts) - 1) / 5)] for i in range(6)] if len(cuts) > 6 else cuts:
                before = whole[: cut + 1]
                ids = [t for i, n in notes if i <= cut for t in n["ids"]]
                resume = {"id": opening["id"], "created": opening["created"], "prompt_ids": opening["prompt_ids"],
                          "output_ids": ids, "chars": note["chars"], "started": True,
                          "cached_tokens": cached}  # fmt: skip
                after = await read_internal(client, path, {**body, "warmgate_resume": resume})
                data = [item for kind, item in after if kind == "data"]
                assert all(d["id"] == opening["id"] and d["created"] == opening["created"] for d in data)
                if chat:
                    assert all("role" not in c["delta"] for d in data for c in d["choices"])
                assert streamed_text(before, chat) + streamed_text(after, chat) == text, (cut, ids)
                assert data[-1]["usage"] == usage  # cached_tokens too: where the request began

    asyncio.run(run())


def test_a_resume_without_room_left_or_with_bad_ids_is_refused(worker: Worker) -> None:
    resume = {"id": "cmpl-x", "created": 1, "prompt_ids": [1, 2, 3], "output_ids": [4, 5], "chars": 0}
    with worker.sync_client() as client:
        full = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "warmgate_resume": resume})
        assert_openai_error(full, 400, "already has 2 of its 2 tokens")
        bad = {**resume, "output_ids": [10**9]}
        out_of_range = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "warmgate_resume": bad})
        assert_openai_error(out_of_range, 400, "out of range")


def test_bad_requests_get_openai_errors(worker: Worker) -> None:
    async def run() -> list[httpx.Response]:
        async with worker.client() as client:
            sent = [client.post(path, json=body) for path, body, _, _ in BAD_REQUESTS]
            headers = {"content-type": "application/json"}
            sent.append(client.post("/v1/chat/completions", content=b"{not json", headers=headers))
            # JSON that Python's parser takes and pydantic's does not (the route reads it as FastAPI did): a lone
            # surrogate escape, which the prompt checks name; NaN, which the field's validation refuses.
            lone = b'{"prompt": "Hi \\ud800 there", "max_tokens": 2}'
            sent.append(client.post("/v1/completions", content=lone, headers=headers))
            nan = b'{"prompt": "Hi", "temperature": NaN}'
            sent.append(client.post("/v1/completions", content=nan, headers=headers))
            sent.append(client.get("/v1/chat/completions"))
            return await asyncio.gather(*sent)

    responses = asyncio.run(run())
    for (path, body, status, word), response in zip(BAD_REQUESTS, responses, strict=False):
        error = assert_openai_error(response, status, word)
        assert error["type"] == "invalid_request_error", (path, body, error)
    assert_openai_error(responses[-4], 400, "JSON")
    assert_openai_error(responses[-3], 400, "not valid Unicode")
    assert assert_openai_error(responses[-2], 400, "temperature")["param"] == "temperature"
    assert_openai_error(responses[-1], 405, "POST")


async def _wait_until_idle(client: httpx.AsyncClient, seconds: float) -> dict[str, Any]:
    """The worker's /health once nothing runs or is in flight, or the last one seen at the deadline."""
    deadline = time.monotonic() + seconds
    while True:
        health: dict[str, Any] = (await client.get("/health")).json()
        if (health["running"] == 0 and health["in_flight"] == 0) or time.monotonic() >= deadline:
            return health
        await asyncio.sleep(0.05)


def test_client_disconnect_cancels_the_request(worker: Worker) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True, "stream": True}

    async def run() -> dict[str, Any]:
        async with worker.client() as client:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # one token arrived: the request is running; leaving closes the connection
            return await _wait_until_idle(client, 20)

    health = asyncio.run(run())
    assert health["running"] == 0 and health["in_flight"] == 0, health


def test_client_timeout_cancels_a_non_streaming_request(worker: Worker) -> None:
    # 500 tokens take ~30 s on this CPU; the client gives up after 1 s and closes its connection.
    body = {"prompt": "Once upon a time", "max_tokens": 500, "ignore_eos": True}

    async def run() -> dict[str, Any]:
        async with worker.client() as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=1.0))
        async with worker.client() as client:
            return await _wait_until_idle(client, 10)

    health = asyncio.run(run())
    assert health["running"] == 0 and health["in_flight"] == 0, health


def test_openai_client(worker: Worker, model: Path) -> None:
    import openai

    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(worker.socket)))
    client = openai.OpenAI(base_url="http://engine/v1", api_key="x", http_client=http)
    chat = client.chat.completions.create(model=model.name, messages=FRANCE, temperature=0)
    assert "Paris" in (chat.choices[0].message.content or "") and chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.completion_tokens > 0

    stream = client.completions.create(
        model=model.name,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 5

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model.name, messages=FRANCE, temperature=-1)
    http.close()


def long_story(max_tokens: int) -> dict[str, Any]:
    """A streamed completion that runs exactly max_tokens tokens, ending with a usage chunk."""
    return {
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def completed_stream(lines: list[str]) -> tuple[str | None, int]:
    """(finish_reason, completion_tokens) of a streamed completion's SSE lines, which must end with [DONE]."""
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return events[-2]["choices"][0]["finish_reason"], events[-1]["usage"]["completion_tokens"]


def test_drain_finishes_streams_and_refuses_new_requests(model: Path, tmp_path: Path) -> None:
    worker = start_worker(tmp_path, model)

    async def run() -> tuple[list[str], dict[str, Any], httpx.Response, httpx.Response]:
        async with worker.client() as client:
            first_token = asyncio.Event()

            async def stream() -> list[str]:
                lines: list[str] = []
                async with client.stream("POST", "/v1/completions", json=long_story(24)) as response:
                    async for line in response.aiter_lines():
                        if line:
                            lines.append(line)
                            first_token.set()
                return lines

            streaming = asyncio.create_task(stream())
            await asyncio.wait_for(first_token.wait(), 30)
            draining = asyncio.create_task(client.post("/drain", json={"timeout": 60}))
            deadline = time.monotonic() + 10
            health = await client.get("/health")
            while health.status_code != 503 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                health = await client.get("/health")
            refused = await client.post("/v1/chat/completions", json={"messages": FRANCE})
            lines = await streaming
            report = (await draining).json()
            return lines, report, health, refused

    try:
        lines, report, health, refused = asyncio.run(run())
        worker.proc.send_signal(signal.SIGTERM)
        code = worker.exit_code(timeout=30)
    finally:
        stop_worker(worker)
    assert health.status_code == 503 and health.json()["status"] == "draining"
    error = assert_openai_error(refused, 503, "draining")
    assert error["type"] == "service_unavailable"
    assert completed_stream(lines) == ("length", 24), "the stream in flight runs to its end"
    assert report["drained"] is True and report["in_flight_at_start"] == 1 and report["remaining"] == 0
    assert report["seconds"] > 0
    assert code == 0, worker.log()


def test_sigterm_lets_the_stream_in_flight_finish_then_exits(model: Path, tmp_path: Path) -> None:
    worker = start_worker(tmp_path, model)

    async def run() -> list[str]:
        lines: list[str] = []
        async with worker.client() as client, client.stream("POST", "/v1/completions", json=long_story(16)) as response:
            async for line in response.aiter_lines():
                if line and not lines:
                    worker.proc.send_signal(signal.SIGTERM)  # the first token is out: the request is in flight
                if line:
                    lines.append(line)
        return lines

    try:
        lines = asyncio.run(run())
        code = worker.exit_code(timeout=30)
    finally:
        stop_worker(worker)
    assert completed_stream(lines) == ("length", 16)
    assert code == 0, worker.log()
    assert not worker.socket.exists()
    log = worker.log()
    assert "event=shutdown signal=SIGTERM drained=True in_flight_at_start=1 remaining=0" in log, log
    assert "event=exit" in log


def test_a_request_whose_body_still_arrives_at_a_sigterm_is_served_before_the_worker_exits(
        model: Path, tmp_path: Path) -> None:  # fmt: skip
    """A request is in flight from its receipt: the drain waits for one still reading its body (or compiling its
    grammar) as for one generating, instead of ending with none in flight and letting the server's stop cut it."""
    worker = start_worker(tmp_path, model)
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: engine\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body))  # fmt: skip
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(worker.socket))
            sock.sendall(head + body[:10])  # the headers and part of the body: the app is reading the rest
            wait_for(lambda: health(worker)["in_flight"] == 1, 30, "the request being read counted in flight")
            worker.proc.send_signal(signal.SIGTERM)
            wait_for(lambda: health(worker)["status"] == "draining", 30, "a drain after the SIGTERM")
            sock.sendall(body[10:])
            sock.settimeout(30)
            response = b""
            while chunk := sock.recv(65536):
                response += chunk
        code = worker.exit_code(timeout=30)
    finally:
        stop_worker(worker)
    status, _, rest = response.partition(b"\r\n")
    assert status == b"HTTP/1.1 200 OK", response[:300]
    answer = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert code == 0, worker.log()
    assert "event=shutdown signal=SIGTERM drained=True in_flight_at_start=1 remaining=0" in worker.log()


def test_bind_replaces_a_stale_socket_but_not_a_live_one_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()  # what a killed worker leaves behind: the file, nobody listening
    live = bind_unix_socket(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with pytest.raises(FileExistsError, match="another process"):
            bind_unix_socket(path)
    finally:
        live.close()
    regular = tmp_path / "notes.txt"
    regular.write_text("keep me")
    with pytest.raises(FileExistsError, match="not a socket"):
        bind_unix_socket(regular)
    assert regular.read_text() == "keep me"


def test_sigterm_during_start_up_exits_cleanly(model: Path, tmp_path: Path) -> None:
    """A supervisor that gives up on a starting engine gets a clean exit (0), not a kill by signal."""
    worker = launch_worker(tmp_path, model, max_num_seqs=2, max_model_len=256)
    proc, sock, log_path = worker.proc, worker.socket, worker.log_path
    # Signal handlers are in place once start-up has begun; torch's import alone takes longer than this wait.
    deadline = time.monotonic() + 60
    while "event=startup phase=begin" not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "event=ready" not in log_path.read_text(), "start-up finished before the signal: nothing was tested"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    out = log_path.read_text()
    assert proc.returncode == 0, out
    assert "event=exit reason=" in out and "during start-up" in out, out
    assert not sock.exists()


def test_sigterm_during_the_warm_up_is_not_lost(model: Path, tmp_path: Path) -> None:
    """A SIGTERM after the engine is built but before the worker serves (its warm-up) still stops it: it was
    once recorded and never acted on, and the supervisor waited drain_timeout + 10 s to kill the worker."""
    import subprocess

    worker = launch_worker(tmp_path, model, max_num_seqs=2, max_model_len=256)
    proc, sock, log_path = worker.proc, worker.socket, worker.log_path
    deadline = time.monotonic() + 120
    while "event=startup phase=engine " not in log_path.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, log_path.read_text()
        time.sleep(0.01)
    assert "event=ready" not in log_path.read_text(), "the warm-up was over before the signal: nothing was tested"
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the worker ignored a SIGTERM sent during its warm-up:\n{log_path.read_text()}")
    assert proc.returncode == 0, log_path.read_text()
    assert not sock.exists()
