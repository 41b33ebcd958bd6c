"""Requests survive the death of their engine: resumed on the replacement, byte for byte (CPU, bf16 demo).

`warmgate serve` with a standby; OpenAI clients stream greedy chats and completions (and some wait for
whole answers) while the active engine is killed with SIGKILL, again and again. Every answer must equal
the same request's answer in an undisturbed run. A poison request (the engine's test-only fault hook
exits the worker when it sees it) fails after the configured resumes while the others are served.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from processes import Gateway, start_gateway, wait_for

RESUMES = 3  # restart.request_resumes, left at its default
POISON = "poison-user"
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"]}}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]  # fmt: skip

CHATS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
         "Write a haiku about rain.", "What is 12 times 12?", "Describe a cat in one sentence.",
         "Give me a tip for learning Python.", "What do bees make?"]  # fmt: skip
TEXTS = ["The history of the printing press", "Once upon a time, in a small village,", "def fibonacci(n):",
         "The three laws of motion are", "My favourite recipe for bread is", "In 1969, the first humans",
         "A list of prime numbers: 2, 3, 5,", "The ocean covers most of"]  # fmt: skip


@pytest.fixture(scope="module")
def gateway(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("resume")
    # Steps of at most 256 tokens: after a kill the next engine prefills every resumed request (prompt + output,
    # 20 of them); in one 2048-token step that took over health_timeout on CI's loaded two cores, and the engine
    # was killed as hung, again and again.
    config = (f'model = "{demo_path("bf16")}"\nserved_model_name = "demo"\n\n'
              "[engine]\nmax_num_seqs = 20\nmax_model_len = 512\nmax_num_batched_tokens = 256\n\n"
              '[restart]\nstrategy = "overlap"\nstandby = 1\nhealth_interval = 0.5\nhealth_timeout = 30\n'
              "drain_timeout = 30\nqueue_timeout = 120\n")  # fmt: skip
    gw = start_gateway(root, config, env={"WARMGATE_TEST_CRASH_USER": POISON})
    yield gw
    gw.stop()


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=300, max_retries=0)


def _requests() -> list[tuple[str, dict[str, Any]]]:
    common = {"model": "demo", "temperature": 0, "max_tokens": 40}
    chats = [("chat", {**common, "messages": [{"role": "user", "content": c}]}) for c in CHATS]
    texts = [("text", {**common, "prompt": t, "extra_body": {"ignore_eos": True}}) for t in TEXTS]
    for i in range(1, len(CHATS), 2):  # every other one with logprobs: they resume too
        chats[i][1].update(logprobs=True, top_logprobs=2)
        texts[i][1].update(logprobs=2)
    for i in (2, 6):  # and structured outputs: the grammar goes on where it was
        chats[i][1]["response_format"] = ANSWER_FORMAT
    chats[4][1].update(tools=TOOLS, tool_choice="required")  # and a tool call, held back until the answer ends
    return chats + texts


WHOLE = [1, 5, 9, 13, 4]  # requests also asked for whole answers: with logprobs, and the tool call


def _scores(kind: str, logprobs: Any) -> list[tuple[str, float]]:
    """(token, logprob) of a choice's (or a chunk's) logprobs."""
    if logprobs is None:
        return []
    if kind == "chat":
        return [(e.token, e.logprob) for e in logprobs.content or []]
    return list(zip(logprobs.tokens or [], logprobs.token_logprobs or [], strict=True))


def _same(got: tuple[Any, ...], want: tuple[Any, ...]) -> bool:
    """The same answer: text, finish reason, usage and tokens exactly; logprobs within 1e-4 (a resumed request's
    tokens after the resume run on key-values its new engine computed in one prefill)."""
    if got[:3] != want[:3] or [t for t, _ in got[3]] != [t for t, _ in want[3]]:
        return False
    return all(abs(a - b) <= 1e-4 for (_, a), (_, b) in zip(got[3], want[3], strict=True))


def _stream(client: openai.OpenAI, kind: str, body: dict[str, Any], progress: list[int]) -> tuple[Any, ...]:
    """(text and tool calls, finish_reason, usage, logprobs) of a streamed request, checking that it is one
    well-formed stream."""
    options = {"stream": True, "stream_options": {"include_usage": True}}
    if kind == "chat":
        chunks = client.chat.completions.create(**body, **options)
    else:
        chunks = client.completions.create(**body, **options)
    pieces, finishes, ids, usage, scores, calls = [], [], set(), None, [], []
    for chunk in chunks:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            pieces.append(piece or "")
            if kind == "chat":  # a call comes whole, in the last chunk
                calls += [(c.function.name, c.function.arguments) for c in choice.delta.tool_calls or []]
            scores += _scores(kind, choice.logprobs)
            progress[0] += 1
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert len(ids) == 1 and len(finishes) == 1, (ids, finishes)
    return ("".join(pieces), calls), finishes[0], _counts(usage), scores


def _whole(client: openai.OpenAI, kind: str, body: dict[str, Any]) -> tuple[Any, ...]:
    if kind == "chat":
        response = client.chat.completions.create(**body)
        message = response.choices[0].message
        text = (message.content or "", [(c.function.name, c.function.arguments) for c in message.tool_calls or []])
    else:
        response = client.completions.create(**body)
        text = (response.choices[0].text, [])
    choice = response.choices[0]
    return text, choice.finish_reason, _counts(response.usage), _scores(kind, choice.logprobs)


def _counts(usage: Any) -> dict[str, Any] | None:
    """A usage's token counts. Its cached prompt tokens are left out: they depend on what the engine that computed
    the prompt had cached (a repeat of a request finds its prompt there), not on the answer."""
    if usage is None:
        return None
    counts = usage.model_dump()
    cached = counts.pop("prompt_tokens_details")["cached_tokens"]
    assert 0 <= cached < counts["prompt_tokens"], usage
    return counts


def _crashes(gateway: Gateway) -> int:
    return sum(r["reason"] == "crash" and r["ok"] for r in gateway.status()["restarts"])


def test_streams_and_whole_answers_survive_five_kills_byte_for_byte(gateway: Gateway) -> None:
    client = _client(gateway)
    requests = _requests()
    progress = [0]
    expected_stream = [_stream(client, kind, body, progress) for kind, body in requests]
    assert expected_stream[4][1] == "tool_calls", expected_stream[4]
    for i in WHOLE:  # a whole answer is the stream's, assembled (its usage counted by the relay)
        whole = _whole(client, *requests[i])
        assert _same(whole, expected_stream[i]), (whole, expected_stream[i])

    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def loop(i: int, streaming: bool) -> None:
        kind, body = requests[i]
        while not stop.is_set():
            try:
                got = _stream(client, kind, body, progress) if streaming else _whole(client, kind, body)
            except Exception as exc:
                failures.append(f"request {i}: {type(exc).__name__}: {exc}")
                continue
            want = expected_stream[i]
            if not _same(got, want):
                failures.append(f"request {i} ({'stream' if streaming else 'whole'}): {got!r} != {want!r}")
            served[0] += 1

    threads = [threading.Thread(target=loop, args=(i, True)) for i in range(16)]
    threads += [threading.Thread(target=loop, args=(i, False)) for i in WHOLE]
    resumes_before, crashes_before = gateway.metric("warmgate:request_resumes"), _crashes(gateway)
    for t in threads:
        t.start()
    try:
        for kill in range(5):
            seen = progress[0]
            # About 15 tokens per client between kills: a request lives through two or three of them.
            wait_for(lambda: progress[0] > seen + 300, 120, "no tokens streamed")  # noqa: B023
            pid = gateway.active_pid()
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: _crashes(gateway) > crashes_before + kill, 120, f"kill {kill + 1} was not recovered")  # noqa: B023
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    assert not failures, (len(failures), [f for f in failures if "!=" in f][:3] or failures[:3])
    assert served[0] >= 20
    resumed = gateway.metric("warmgate:request_resumes") - resumes_before
    assert resumed >= 5, f"only {resumed} requests were resumed over 5 kills"
    assert gateway.metric("warmgate:request_resume_failures") == 0


def test_a_poison_request_fails_after_its_resumes_and_the_others_are_served(gateway: Gateway) -> None:
    client = _client(gateway)
    crashes = _crashes(gateway)
    outcome: list[Any] = []

    def poison() -> None:
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 8, "user": POISON}
        outcome.append(httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=300))

    thread = threading.Thread(target=poison)
    thread.start()
    wait_for(lambda: _crashes(gateway) > crashes, 120, "the poison request did not kill its engine")
    # Requests sent from now on live through at most the poison's remaining RESUMES kills: all are served.
    kind, body = _requests()[0]
    answers = []
    others = [threading.Thread(target=lambda: answers.append(_whole(client, kind, body))) for _ in range(3)]
    for t in others:
        t.start()
    thread.join(timeout=300)
    for t in others:
        t.join(timeout=300)
    response = outcome[0]
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert "restart.request_resumes" in error["message"] and f"resumed {RESUMES} times" in error["message"], error
    assert _crashes(gateway) == crashes + RESUMES + 1  # it killed one engine per try, then the gateway gave up
    assert len(answers) == 3 and all(a[1] in ("stop", "length") and a[0] for a in answers), answers
    assert _whole(client, kind, body)[0] == answers[0][0]  # and the gateway serves on


def _sse(data: dict[str, Any], note: dict[str, Any] | None = None) -> bytes:
    """An internal SSE event without its blank line: the data line, and the engine's comment line when ``note``
    is given."""
    import json

    line = f"data: {json.dumps(data)}"
    return (line + (f"\n: warmgate {json.dumps(note)}" if note is not None else "")).encode()


def test_the_relay_state_of_a_request_follows_the_internal_stream() -> None:
    import json

    from app.relay.inflight import DONE, EngineStopped, InFlight, InvalidRequest
    from engine.chunks import sse
    from engine.internal_stream import held, token_note
    from engine.protocol import ChatCompletionChunk, Usage

    request = InFlight.of("/v1/chat/completions", {"messages": [], "stream": True, "warmgate_resume": {"id": "x"},
                                                   "stream_options": {"include_usage": True}})  # fmt: skip
    assert "warmgate_resume" not in json.loads(request.body())  # a client cannot forge one
    opening = b': warmgate {"prompt_ids":[1,2,3],"id":"chatcmpl-1","created":7,"model":"demo"}'
    role = _sse({"id": "chatcmpl-1", "choices": [{"delta": {"role": "assistant", "content": ""}}]})
    token = _sse({"id": "chatcmpl-1", "choices": [{"delta": {"content": "Hi"}}]}, {"ids": [42, 43], "chars": 2,
                                                                                    "cached": 2})  # fmt: skip
    assert request.take([opening, role]) == role + b"\n\n"
    assert request.take([token]) == token.split(b"\n")[0] + b"\n\n"  # the comment line never reaches the client
    progress = request.progress()
    assert (request.prompt_ids, progress.output_ids, progress.chars, request.started) == ([1, 2, 3], [42, 43], 2,
                                                                                          True)  # fmt: skip
    resume = json.loads(request.body())["warmgate_resume"]
    assert resume == {"id": "chatcmpl-1", "created": 7, "prompt_ids": [1, 2, 3], "output_ids": [42, 43], "chars": 2,
                      "started": True, "cached_tokens": 2}  # fmt: skip
    # Tokens with no text to show yet (a tool call's, held until the answer ends) are on record all the same; an
    # engine's opening after a resume is not a note.
    assert request.take([held(token_note([44, 45], 2, 0)).encode()[:-2], opening]) == b""
    assert request.progress().output_ids == [42, 43, 44, 45] and request.progress().chars == 2
    with pytest.raises(EngineStopped):
        request.take([_sse({"error": {"message": "stopped", "type": "service_unavailable", "code": "engine_stopped"}})])
    # The engine died after the last token's event, before the usage chunk and [DONE]: the relay ends it.
    last = _sse({"choices": [{"delta": {"content": "!"}, "finish_reason": "stop"}]}, {"ids": [2], "chars": 3,
                                                                                     "finish": "stop"})  # fmt: skip
    request.take([last])
    assert request.finish_seen and request.progress().output_ids == [42, 43, 44, 45, 2]  # parsed from where it was
    ending = request.ending()
    usage = json.loads(ending[6 : ending.index(b"\n\n")])
    assert ending.endswith(DONE) and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                                        "prompt_tokens_details": {"cached_tokens": 2}}  # fmt: skip
    assert usage["id"] == "chatcmpl-1" and usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    # The engine died after its usage chunk, before [DONE]: the relay ends the stream with [DONE] alone.
    engine_usage = sse(ChatCompletionChunk(id="chatcmpl-1", created=7, model="demo", choices=[], usage=Usage.of(3, 5)))
    assert request.take([engine_usage.encode()[:-2]]) == engine_usage.encode() and request.usage_sent
    assert request.ending() == DONE

    whole = InFlight.of("/v1/completions", {"prompt": "x"})
    events = [opening.replace(b"chatcmpl", b"cmpl"), _sse({"choices": [{"text": "Hel"}]}, {"ids": [5], "chars": 3}),
              _sse({"choices": [{"text": "lo", "finish_reason": "length"}]}, {"ids": [6], "chars": 5,
                                                                              "finish": "length"}),
              b"data: [DONE]"]  # fmt: skip
    assert whole.take(events) == b"" and whole.done  # a non-streaming client gets nothing until the end
    status, body = whole.response()
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2

    for bad, param in (({"stream": "yes please"}, "stream"), ({"stream": 1}, "stream"),
                       ({"stream": True, "stream_options": []}, "stream_options"),
                       ({"stream": True, "stream_options": {"include_usage": "no"}}, "stream_options")):  # fmt: skip
        with pytest.raises(InvalidRequest) as refused:
            InFlight.of("/v1/completions", {"prompt": "x", **bad})
        assert refused.value.param == param


def test_a_dead_engine_that_the_table_still_names_uses_up_no_resume(gateway: Gateway) -> None:
    """A request sent to an engine that is gone (nothing accepts on its socket) lost nothing there: it waits for
    the table to move on, however long the supervisor takes, and does not use up its resumes. Here the supervisor
    is stopped while the active engine dies, for longer than the request's resumes would last at one a second."""
    client = _client(gateway)
    kind, body = _requests()[1]
    expected = _whole(client, kind, body)
    wait_for(lambda: gateway.status()["standbys"], 120, "a standby was not ready")
    status = gateway.status()
    supervisor, crashes = status["supervisor"]["pid"], _crashes(gateway)
    answers: list[Any] = []
    os.kill(supervisor, signal.SIGSTOP)
    try:
        os.kill(next(e["pid"] for e in status["engines"] if e["id"] == status["active"]), signal.SIGKILL)
        thread = threading.Thread(target=lambda: answers.append(_whole(client, kind, body)))
        thread.start()
        thread.join(timeout=RESUMES + 3.0)  # a resume per MOVE_WAIT_S (1 s) would have failed it by now
        assert thread.is_alive() and not answers, answers
    finally:
        os.kill(supervisor, signal.SIGCONT)
    thread.join(timeout=120)
    assert len(answers) == 1 and _same(answers[0], expected), (answers, expected)
    wait_for(lambda: _crashes(gateway) > crashes, 60, "the dead engine was not replaced")


def test_three_choices_resume_each_from_its_own_tokens(gateway: Gateway) -> None:
    """n = 3, seeded and sampled: the active engine is killed while the choices stream; each choice goes on from
    its own tokens on the next engine (its seeded draws skipped), byte for byte as an undisturbed run, and the
    whole answer assembled by the relay equals the stream. The usage keeps what the killed engine found cached of
    the prompt (every full block: the undisturbed run computed it there), as the client would have had it."""
    client = _client(gateway)
    body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me about the sea."}], "n": 3,
            "temperature": 1.0, "seed": 21, "max_tokens": 60}  # fmt: skip

    def streamed(kill_after: int | None) -> tuple[dict[int, str], Any]:
        texts: dict[int, str] = {}
        seen, usage = 0, None
        for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
                seen += 1
                if kill_after is not None and seen == kill_after:
                    pid = gateway.active_pid()
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
        return texts, usage

    expected, _ = streamed(None)
    assert len(expected) == 3 and len(set(expected.values())) > 1
    wait_for(lambda: gateway.status()["standbys"], 120, "a standby was not ready")
    crashes = _crashes(gateway)
    texts, usage = streamed(40)  # about 13 tokens a choice before the kill
    assert texts == expected
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16
    wait_for(lambda: _crashes(gateway) > crashes, 60, "the killed engine was not replaced")
    whole = client.chat.completions.create(**body)
    assert {c.index: c.message.content for c in whole.choices} == expected
