"""The OpenAI API that real clients use, through `warmgate serve` and the official client (CPU, the bf16 demo):
logprobs on chat and text completions, streamed and whole, against a reference forward pass (transformers)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from processes import Gateway, start_gateway

PROMPT = "The three primary colours are"
CHAT = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def gateway(demo_path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    root = tmp_path_factory.mktemp("openai-api")
    config = (f'model = "{demo_path("bf16")}"\nserved_model_name = "demo"\n\n'
              "[engine]\nmax_num_seqs = 8\nmax_model_len = 512\n\n"
              '[restart]\nstrategy = "overlap"\nstandby = 0\n')  # fmt: skip
    gw = start_gateway(root, config)
    yield gw
    gw.stop()


def _client(gateway: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_chat_logprobs_name_each_token_with_its_alternatives_streamed_and_whole(gateway: Gateway) -> None:
    client = _client(gateway)
    ask: dict[str, Any] = {"model": "demo", "messages": CHAT, "temperature": 0, "max_tokens": 24, "logprobs": True,
                           "top_logprobs": 3}  # fmt: skip
    whole = client.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content, choice
    entries = choice.logprobs.content
    assert bytes(b for e in entries for b in (e.bytes or [])).decode() == choice.message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        assert (best.token, best.logprob) == (entry.token, entry.logprob), entry  # greedy: the top-1 entry
        assert entry.logprob <= 0 and [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True)  # fmt: skip

    streamed: list[Any] = []
    text = []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            text.append(c.delta.content or "")
            if c.logprobs is not None:
                streamed += c.logprobs.content or []
    assert "".join(text) == choice.message.content
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-4) for a, b in zip(streamed, entries, strict=True))

    plain = client.chat.completions.create(model="demo", messages=CHAT, max_tokens=4)
    assert plain.choices[0].logprobs is None  # not asked, not given


def test_completion_logprobs_in_the_legacy_shape_streamed_and_whole(gateway: Gateway) -> None:
    client = _client(gateway)
    ask: dict[str, Any] = {"model": "demo", "prompt": PROMPT, "temperature": 0, "max_tokens": 20, "logprobs": 2}
    whole = client.completions.create(**ask)
    choice = whole.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset is not None
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top is not None and token in top and top[token] == logprob and len(top) <= 3
        assert logprob == max(top.values())  # greedy

    tokens, logprobs, offsets = [], [], []
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                logprobs += c.logprobs.token_logprobs or []
                offsets += c.logprobs.text_offset or []
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(logprobs, lp.token_logprobs, strict=True))


def test_logprobs_equal_a_reference_forward_pass(gateway: Gateway, demo_path) -> None:
    """Greedy logprobs against transformers in fp32 on the same checkpoint: the generated tokens' logprobs, and
    every top-5 alternative, within 1e-3."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_path("bf16")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    answer = _client(gateway).completions.create(model="demo", prompt=PROMPT, temperature=0, max_tokens=16,
                                                 logprobs=5, extra_body={"ignore_eos": True})  # fmt: skip
    lp = answer.choices[0].logprobs
    assert lp is not None and lp.token_logprobs and lp.top_logprobs
    prompt = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=16, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, min_new_tokens=16)  # fmt: skip
    generated = out.sequences[0, prompt.shape[1] :].tolist()
    assert tokenizer.decode(generated) == answer.choices[0].text
    for step, token in enumerate(generated):
        reference = torch.log_softmax(out.logits[step][0].float(), dim=-1)
        assert math.isclose(lp.token_logprobs[step], float(reference[token]), abs_tol=1e-3), step
        values, ids = reference.topk(5)
        expected = {tokenizer.decode([i]): float(v) for v, i in zip(values, ids, strict=True)}
        top = lp.top_logprobs[step]
        assert top is not None
        for text, value in expected.items():
            assert math.isclose(top[text], value, abs_tol=1e-3), (step, text, top)


def test_sampled_logprobs_are_of_the_distribution_each_token_was_drawn_from(gateway: Gateway) -> None:
    """After temperature and top-k: the five tokens top-k keeps carry all the probability."""
    answer = _client(gateway).chat.completions.create(model="demo", messages=CHAT, temperature=0.7, max_tokens=16,
                                                      logprobs=True, top_logprobs=5, seed=3,
                                                      extra_body={"top_k": 5})  # fmt: skip
    assert answer.choices[0].logprobs is not None
    for entry in answer.choices[0].logprobs.content or []:
        assert math.isclose(sum(math.exp(t.logprob) for t in entry.top_logprobs), 1.0, abs_tol=1e-4), entry
        assert entry.logprob in [t.logprob for t in entry.top_logprobs]


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("chat", {"logprobs": "yes please"}, "logprobs"),
    ("text", {"logprobs": 21}, "logprobs"),
    ("text", {"logprobs": -1}, "logprobs"),
    ("text", {"logprobs": [1]}, "logprobs"),
])  # fmt: skip
def test_logprobs_out_of_range_or_of_the_wrong_type_are_refused_by_name(
    gateway: Gateway, route: str, fields: dict[str, Any], param: str
) -> None:
    client = _client(gateway)
    with pytest.raises(openai.BadRequestError) as refused:
        if route == "chat":
            client.chat.completions.create(model="demo", messages=CHAT, max_tokens=2, extra_body=fields)
        else:
            client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, extra_body=fields)
    body = refused.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}  # fmt: skip
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Describe a person as JSON with their name, age and favourite colour."}]


def test_json_schema_answers_at_temperature_1_follow_the_schema_50_of_50(gateway: Gateway) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    client = _client(gateway)

    def ask(seed: int) -> Any:
        return client.chat.completions.create(model="demo", messages=ASK_PERSON, temperature=1.0, seed=seed,
                                              max_tokens=80, response_format=PERSON_FORMAT)  # type: ignore[arg-type]  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(50)))
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content or ""), PERSON)
    assert len({a.choices[0].message.content for a in answers}) > 10  # sampled, not one answer


def test_structured_outputs_streamed_whole_on_both_routes_and_as_any_object(gateway: Gateway) -> None:
    import jsonschema

    client = _client(gateway)
    whole = client.chat.completions.create(model="demo", messages=ASK_PERSON, temperature=0, max_tokens=80,
                                           response_format=PERSON_FORMAT)  # type: ignore[arg-type]  # fmt: skip
    text = whole.choices[0].message.content or ""
    jsonschema.validate(json.loads(text), PERSON)
    streamed = client.chat.completions.create(model="demo", messages=ASK_PERSON, temperature=0, max_tokens=80,
                                              response_format=PERSON_FORMAT, stream=True)  # type: ignore[arg-type]  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    completion = client.completions.create(model="demo", prompt="A person as JSON:", temperature=0, max_tokens=80,
                                           extra_body={"response_format": PERSON_FORMAT})  # fmt: skip
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    anything = client.chat.completions.create(model="demo", messages=ASK_PERSON, temperature=0, max_tokens=120,
                                              response_format={"type": "json_object"})  # fmt: skip
    choice = anything.choices[0]
    assert (choice.message.content or "").startswith("{"), choice
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)


@pytest.mark.parametrize(("response_format", "extra", "words"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, {}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}, {},
     "parenthesis"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}}}, {}, "missing"),
    ({"type": "json_schema"}, {}, "json_schema"),
    ({"type": "xml"}, {}, "type"),
])  # fmt: skip
def test_a_grammar_that_cannot_be_used_is_refused_with_a_400(gateway: Gateway, response_format: dict[str, Any],
                                                             extra: dict[str, Any], words: str) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway).chat.completions.create(model="demo", messages=CHAT, max_tokens=4,
                                                 extra_body={"response_format": response_format, **extra})  # fmt: skip
    body = refused.value.body
    assert isinstance(body, dict) and words in body["message"], body
    assert body.get("param") in ("response_format", None), body


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": CITY}}]  # fmt: skip
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _calls_of_stream(chunks: Any) -> tuple[dict[int, dict[str, str]], list[str]]:
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                merged = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                merged["id"] = call.id or merged["id"]
                merged["name"] += call.function.name or "" if call.function else ""
                merged["arguments"] += call.function.arguments or "" if call.function else ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return calls, finishes


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])  # fmt: skip
def test_a_required_or_named_tool_call_follows_its_schema_streamed_and_whole(gateway: Gateway, choice: Any) -> None:
    client = _client(gateway)
    ask: dict[str, Any] = {"model": "demo", "messages": WEATHER, "tools": TOOLS, "tool_choice": choice,
                           "temperature": 0, "max_tokens": 60}  # fmt: skip
    whole = client.chat.completions.create(**ask)
    answer = whole.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
    calls = answer.message.tool_calls or []
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    names = {t["function"]["name"] for t in TOOLS} if choice == "required" else {"get_time"}
    for call in calls:
        assert call.function.name in names and isinstance(json.loads(call.function.arguments)["city"], str), call
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    streamed, finishes = _calls_of_stream(chunks)
    assert finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == [
        (c.function.name, c.function.arguments) for c in calls]  # fmt: skip
    # Every token of the calls is counted: the whole answer's usage (the relay counts the tokens its engine's notes
    # carry) is the stream's (the engine's own count), each call at least a token of its name and one of its city.
    assert chunks[-1].usage is not None and whole.usage is not None
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens >= 2 * len(calls), whole.usage


def test_a_tool_round_trip_and_auto_answers(gateway: Gateway) -> None:
    """A call, its result given back (role tool), then an answer: rendered through the demo's chat template."""
    client = _client(gateway)
    first = client.chat.completions.create(model="demo", messages=WEATHER, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                           parallel_tool_calls=False, temperature=0, max_tokens=60)  # fmt: skip
    calls = first.choices[0].message.tool_calls or []
    assert len(calls) == 1, first  # parallel_tool_calls false: one call
    history = [*WEATHER, {"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
               {"role": "tool", "tool_call_id": calls[0].id, "content": '{"sky": "clear", "temp_c": 18}'}]  # fmt: skip
    answer = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
                                            max_tokens=40)  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls"), choice
    assert choice.message.content or choice.message.tool_calls, choice
    for call in choice.message.tool_calls or []:  # auto: a call, if the model makes one, follows its schema
        assert call.function.name in {"get_weather", "get_time"} and "city" in json.loads(call.function.arguments)
    none = client.chat.completions.create(model="demo", messages=WEATHER, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                          temperature=0, max_tokens=8)  # fmt: skip
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(("fields", "words"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "name"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"functions": [{"name": "f"}]}, "use tools"),
    ({"tools": [{"type": "retrieval"}]}, "type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "cannot be used"),
])  # fmt: skip
def test_tools_that_cannot_be_honoured_are_refused_with_a_400(gateway: Gateway, fields: dict[str, Any],
                                                              words: str) -> None:  # fmt: skip
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway).chat.completions.create(model="demo", messages=WEATHER, max_tokens=4, extra_body=fields)
    body = refused.value.body
    assert isinstance(body, dict) and words in body["message"], body


def test_echo_with_logprobs_scores_the_prompt_as_a_reference_forward_pass(gateway: Gateway, demo_path) -> None:
    """Evaluation harnesses score a text with echo + logprobs and max_tokens 0: every prompt token's logprob (the
    first one's null) equals transformers' in fp32 within 1e-3; with max_tokens > 0 the completion follows it, and
    the stream carries the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = demo_path("bf16")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    text = "The quick brown fox jumps over the lazy dog. Évidemment, 日本語 too."
    client = _client(gateway)
    scored = client.completions.create(model="demo", prompt=text, max_tokens=0, echo=True, logprobs=3)
    choice = scored.choices[0]
    assert choice.text == text and choice.finish_reason == "length", choice
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs and lp.top_logprobs and lp.tokens and lp.text_offset is not None
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == ids.shape[1]
    for i in range(1, ids.shape[1]):
        expected = float(reference[i - 1, ids[0, i]])
        assert math.isclose(lp.token_logprobs[i], expected, abs_tol=1e-3), (i, lp.tokens[i])
        top = lp.top_logprobs[i]
        assert top is not None and len(top) <= 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    ask: dict[str, Any] = {"model": "demo", "prompt": PROMPT, "max_tokens": 6, "echo": True, "logprobs": 1,
                           "temperature": 0}  # fmt: skip
    whole = client.completions.create(**ask).choices[0]
    plain = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0).choices[0]
    assert whole.text == PROMPT + plain.text
    assert whole.logprobs is not None and whole.logprobs.tokens and "".join(whole.logprobs.tokens) == whole.text
    pieces, tokens = [], []
    for chunk in client.completions.create(**ask, stream=True):
        for c in chunk.choices:
            pieces.append(c.text)
            tokens += c.logprobs.tokens or [] if c.logprobs else []
    assert "".join(pieces) == whole.text and tokens == whole.logprobs.tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="demo", prompt=PROMPT, max_tokens=0)  # nothing asked for


def _by_choice(chunks: Any, kind: str) -> tuple[dict[int, str], dict[int, str]]:
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for c in chunk.choices:
            piece = c.delta.content if kind == "chat" else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    return texts, finishes


def test_n_choices_and_prompt_lists_streamed_and_whole(gateway: Gateway) -> None:
    client = _client(gateway)
    ask: dict[str, Any] = {"model": "demo", "messages": CHAT, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 12}
    whole = client.chat.completions.create(**ask)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = {c.index: c.message.content for c in whole.choices}
    assert len(set(texts.values())) > 1, texts  # seeds differ per choice
    assert whole.usage is not None and whole.usage.completion_tokens == sum(
        len(c.logprobs.content or []) for c in client.chat.completions.create(**ask, logprobs=True).choices
        if c.logprobs)  # fmt: skip
    streamed, finishes = _by_choice(client.chat.completions.create(**ask, stream=True), "chat")
    assert streamed == texts and set(finishes) == {0, 1, 2}

    prompts = ["The sky is", "Grass is"]
    lists = client.completions.create(model="demo", prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in lists.choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):  # index = prompt * n + sample; greedy samples agree
        alone = client.completions.create(model="demo", prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        assert lists.choices[2 * i].text == lists.choices[2 * i + 1].text == alone
    assert lists.usage is not None and lists.usage.prompt_tokens == sum(
        client.completions.create(model="demo", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts)  # type: ignore[union-attr]  # fmt: skip
    ids = client.completions.create(model="demo", prompt=[[504, 3469, 314], [1, 2, 3]], max_tokens=4, temperature=0)
    assert [c.index for c in ids.choices] == [0, 1]
    streamed, _ = _by_choice(client.completions.create(model="demo", prompt=prompts, n=2, max_tokens=6,
                                                       temperature=0, stream=True), "text")  # fmt: skip
    assert streamed == {c.index: c.text for c in lists.choices}
    same = client.completions.create(model="demo", prompt="Hi", n=2, best_of=2, max_tokens=2)
    assert len(same.choices) == 2


def _prefix_cache_hits(gateway: Gateway) -> int:
    """The active engine's prefix-cache hits (tokens), from its /health."""
    status = gateway.status()
    engine = next(e for e in status["engines"] if e["id"] == status["active"])
    with httpx.Client(transport=httpx.HTTPTransport(uds=engine["socket"]), base_url="http://engine") as client:
        return int(client.get("/health").json()["prefix_cache_hits"])


def test_n_choices_prefill_their_prompt_once_and_usage_says_what_was_cached(gateway: Gateway) -> None:
    """The choices of one prompt share its KV blocks: choices after the first take every full block of the prompt
    from the prefix cache (they waited while the first computed them) instead of computing it again. The usage
    counts that prompt once, as its first choice found it (nothing cached); asked again, its full blocks were
    cached (``usage.prompt_tokens_details.cached_tokens``, as OpenAI and vLLM report it), whole and streamed."""
    client = _client(gateway)
    prompt = " ".join(f"w{i}" for i in range(60))  # no earlier request shares its blocks
    before = _prefix_cache_hits(gateway)
    answer = client.completions.create(model="demo", prompt=prompt, n=4, max_tokens=2, temperature=0)
    assert answer.usage is not None and len(answer.choices) == 4
    full = (answer.usage.prompt_tokens - 1) // 16 * 16  # the demo's blocks hold 16 positions
    assert full >= 64 and _prefix_cache_hits(gateway) - before == 3 * full
    assert answer.usage.prompt_tokens_details is not None and answer.usage.prompt_tokens_details.cached_tokens == 0

    again = client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0)
    streamed = [c.usage for c in client.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0,
                                                           stream=True, stream_options={"include_usage": True})
                if c.usage is not None]  # fmt: skip
    for usage in (again.usage, *streamed):
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens) == (answer.usage.prompt_tokens, full)
    assert len(streamed) == 1


@pytest.mark.parametrize(("fields", "words"), [
    ({"n": 17}, "less than or equal to 16"),
    ({"n": 0}, "greater than or equal to 1"),
    ({"prompt": ["a"] * 9, "n": 2}, "passes 16 choices"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"prompt": []}, "empty"),
    ({"prompt": [[]]}, "empty"),
])  # fmt: skip
def test_too_many_choices_or_empty_prompts_are_refused(gateway: Gateway, fields: dict[str, Any], words: str) -> None:
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        _client(gateway).completions.create(**body)
    error = refused.value.body
    assert isinstance(error, dict) and words in error["message"], error
