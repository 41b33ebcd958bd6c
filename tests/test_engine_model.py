"""The native engine against transformers: same greedy tokens, FP8 logits, batch invariance, model variants."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from processes import serve_activated, wait_for

from cache.checkpoint.reader import read_checkpoint
from cache.checkpoint.synth import SHAPES, synth_checkpoint
from cache.processors.native import FP8_DEQUANT, LinearRecipe
from common.proctitle import ENGINE_THREAD_NAME
from engine.config import EngineConfig
from engine.native.kernels import UnknownKernel, kernel_for
from engine.native.kv_cache import BlockAllocator, KVCache, KVCacheSpec
from engine.native.llm_engine import LLMEngine
from engine.native.model import ModelArgs, Transformer
from engine.native.model_runner import ModelRunner
from engine.native.scheduler import Scheduled, Sequence
from engine.sampling_params import SamplingParams
from engine.weights import DiskWeights

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(demo_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(demo_path("bf16") / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p).ids for p in PROMPTS]


def _engine(path: Path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{"model": path, "max_num_seqs": 8, "max_model_len": 256, **kw}))


def _hf_greedy(model, ids: list[int], n: int = 32) -> list[int]:
    with torch.no_grad():
        # No eos: like ignore_eos (min_new_tokens would instead mask eos out of the logits).
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def _reference_model(path: Path, ckpt_path: Path | None = None):
    """transformers' Llama in fp32 holding the (dequantized) weights of ``ckpt_path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).eval()
    model.load_state_dict(read_checkpoint(ckpt_path or path).dequantized_state_dict(torch.float32), strict=False)
    model.tie_weights()
    return model


def _prompt_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits of every prompt position, from one eager forward through the engine's paged cache."""
    seq = Sequence("logits", ids, GREEDY, lambda event: None)
    allocator = engine.scheduler.allocator
    assert allocator.grow(seq.blocks, len(ids))
    try:
        return engine.model.logits(engine.runner.hidden_states([Scheduled(seq, 0, len(ids))]))
    finally:
        allocator.release(seq.blocks)


def test_bf16_demo_greedy_matches_transformers(demo_path, prompt_ids) -> None:
    # Both sides compute in float32 (the engine's CPU default) on the same bf16 weights.
    path = demo_path("bf16")
    ours = _engine(path).generate(prompt_ids, GREEDY)
    reference = _reference_model(path)
    for prompt, got in zip(prompt_ids, ours, strict=True):
        assert got == _hf_greedy(reference, prompt)


def test_fp8_block_demo_logits_and_greedy_match_dequantized_reference(demo_path, prompt_ids) -> None:
    path = demo_path("fp8-block")
    engine = _engine(path)
    reference = _reference_model(demo_path("bf16"), path)
    for ids in prompt_ids:
        with torch.no_grad():
            ours = _prompt_logits(engine, ids)
            ref = reference(torch.tensor([ids])).logits[0]
        rel = float((ours - ref).norm() / ref.norm())
        assert rel < 1e-2, rel
    for prompt, got in zip(prompt_ids, engine.generate(prompt_ids, GREEDY), strict=True):
        assert got == _hf_greedy(reference, prompt)


@pytest.mark.parametrize("scheme", ["fp8-channel", "fp8-tensor"])
def test_other_fp8_schemes_match_their_dequantized_reference(demo_path, prompt_ids, scheme: str) -> None:
    path = demo_path(scheme)
    reference = _reference_model(demo_path("bf16"), path)
    got = _engine(path).generate(prompt_ids[:2], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert got == [_hf_greedy(reference, p, 16) for p in prompt_ids[:2]]


def test_batch_invariance_and_slot_compaction(demo_path, tokenizer) -> None:
    engine = _engine(demo_path("bf16"))
    texts = [*PROMPTS, "A", "In 1969, the first humans to walk on the Moon were", "List three fruits:"]
    ids = [tokenizer.encode(t).ids for t in texts]
    target = 3
    alone = engine.generate([ids[target]], GREEDY)[0]
    batch = engine.generate(ids, GREEDY)
    assert batch[target] == alone
    # Different max_tokens make sequences leave mid-batch, so slots are compacted under the others.
    mixed = [SamplingParams(max_tokens=4 + 4 * i, temperature=0, ignore_eos=True) for i in range(len(ids))]
    outs = _generate_each(engine, ids, mixed)
    for i, out in enumerate(outs):
        assert out == batch[i][: mixed[i].max_tokens]


def _generate_each(engine: LLMEngine, ids: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    from engine.native.scheduler import Sequence

    outputs: list[list[int]] = [[] for _ in ids]
    for i, (prompt, p) in enumerate(zip(ids, params, strict=True)):

        def emit(event, out=outputs[i]):
            if event.token_id is not None:
                out.append(event.token_id)

        engine.scheduler.add(Sequence(f"r{i}", prompt, p, emit))
    while not engine.scheduler.idle:
        engine._step()
    return outputs


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_prefix_caching_changes_no_greedy_token(demo_path, tokenizer, kv_cache_dtype: str) -> None:
    """Prompts sharing a long prefix (a system prompt, then questions of every length), some twice, with the
    cache on (the prefix computed once, then taken from the cache) and off: the same greedy tokens; with the KV
    cache in the compute dtype and in fp8."""
    path = demo_path("bf16")
    system = tokenizer.encode("You are a helpful assistant who answers briefly and precisely. " * 4).ids
    prompts = [system + tokenizer.encode(q).ids for q in ["Why is the sky blue?", "Name a prime.", "2+2=",
               "Write one line about the sea and the wind and the rain."]]  # fmt: skip
    prompts += prompts[:2]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = _engine(path, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype).generate(prompts, greedy)
    on = _engine(path, kv_cache_dtype=kv_cache_dtype)
    allocator = on.scheduler.allocator
    assert on.generate(prompts, greedy) == expected  # at once: the first computes the prefix, the rest wait for it
    assert allocator.hit_tokens >= (len(prompts) - 1) * (len(system) // 16 * 16)
    assert on.generate(prompts[::-1], greedy) == expected[::-1]  # later: every prefix from the cache
    assert on.kv_blocks_free == on.kv_blocks_total
    # A cache of 10 blocks (160 positions) for 4 sequences of ~75 tokens: sequences are preempted while they share
    # blocks, and cached prefixes are evicted for others; the answers stay the same.
    tight = _engine(path, max_num_seqs=4, max_model_len=128, kv_cache_bytes=11 * 16 * on.kv.spec.bytes_per_token,
                    kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    assert tight.kv_blocks_total == 10
    assert tight.generate(prompts, greedy) == expected
    assert tight.num_preemptions > 0 and tight.scheduler.allocator.hit_tokens > 0
    assert tight.kv_blocks_free == tight.kv_blocks_total


def test_an_fp8_kv_cache_holds_a_token_in_a_quarter_of_the_cpus_bytes_and_answers_close_to_it(
    demo_path, prompt_ids
) -> None:
    """kv_cache_dtype = "fp8": keys and values in float8 e4m3, a byte each against fp32's four on the CPU, so the
    same KV budget holds four times the tokens (the memory plan sees it); the greedy answers are the fp32 cache's
    for their first tokens (the demo model, whose keys and values fit e4m3's range)."""
    path = demo_path("bf16")
    auto = _engine(path)
    fp8 = _engine(path, kv_cache_dtype="fp8", kv_cache_bytes=auto.kv.spec.total_bytes)
    assert (auto.kv.k.dtype, fp8.kv.k.dtype, fp8.kv.v.dtype) == (torch.float32, torch.float8_e4m3fn,
                                                                  torch.float8_e4m3fn)  # fmt: skip
    assert (auto.memory["kv_cache_dtype"], fp8.memory["kv_cache_dtype"]) == ("float32", "float8_e4m3fn")
    assert fp8.kv.spec.bytes_per_token * 4 == auto.kv.spec.bytes_per_token
    assert fp8.kv_blocks_total == 4 * (auto.kv_blocks_total + 1) - 1  # the same bytes (the null block included)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    answers = zip(auto.generate(prompt_ids, greedy), fp8.generate(prompt_ids, greedy), strict=True)
    assert all(a[:2] == b[:2] for a, b in answers)  # they part after 3-21 tokens (bench/kv_cache_dtype.py)


def test_a_step_of_questions_after_a_cached_prefix_tells_attention_the_blocks_they_share(
    demo_path, tokenizer, caplog
) -> None:
    """The runner tells the attention kernel how many first positions every sequence of a step holds in the same
    blocks (the kernel then walks them once for the rows of several sequences): a cached system prompt's whole
    blocks for questions after it, and for their decode steps; none once a sequence of its own is in the step, or
    under SHARED_MIN positions. The engine's step trace says it, with each step's launch on the host's monotonic
    clock."""
    import re
    import time

    from attention_cases import record_shared_prefixes

    from engine.native.model_runner import SHARED_MIN

    engine = _engine(demo_path("bf16"), max_model_len=512)
    told = record_shared_prefixes(engine)
    system = tokenizer.encode("You are a helpful assistant who answers briefly and precisely. " * 30).ids
    assert len(system) >= SHARED_MIN + 16
    shared = len(system) // 16 * 16
    questions = [system + tokenizer.encode(q).ids for q in ["Why is the sky blue?", "Name a prime.", "2+2="]]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine.generate(questions[:1], params)  # computes the prefix: one sequence, sharing with no one
    assert [shared_ for _, _, shared_ in told] == [0, 0, 0]
    told.clear()
    engine.stats.trace(time.perf_counter())  # as an activation does: the next steps logged one by one
    before = time.monotonic()
    with caplog.at_level("INFO", logger="warmgate.engine"):
        engine.generate(questions, params)  # the three questions' rows over the cached prefix, then decode steps
    after = time.monotonic()
    assert told[0][0] == 3 and told[0][1] > 3 and told[0][2] == shared
    traced = [r.getMessage() for r in caplog.records if "event=step_after_activation" in r.getMessage()]
    assert len(traced) == len(told), traced
    fields = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in traced]
    assert [(int(f["seqs"]), int(f["tokens"]), int(f["shared"])) for f in fields] == told, traced
    assert before <= float(fields[0]["launched_at"]) <= after, (before, traced[0], after)
    assert [shared_ for seqs, rows, shared_ in told[1:] if seqs == rows == 3] == [shared] * (len(told) - 1)  # decode
    told.clear()
    engine.generate([questions[1], tokenizer.encode("Something else entirely, " * 20).ids], params)
    assert told[0][0] == 2 and told[0][2] == 0  # a sequence of its own in the step

    engine = _engine(demo_path("bf16"), max_model_len=512)
    told = record_shared_prefixes(engine)
    few = [system[: SHARED_MIN - 16] + tokenizer.encode(q).ids for q in ["Why?", "Who?"]]
    engine.generate(few[:1], params)
    told.clear()
    engine.generate(few, params)
    assert told[0][0] == 2 and told[0][2] == 0  # 240 shared positions: walked a sequence at a time


def test_steps_overlap_and_a_steps_events_reach_the_loop_once_the_step_after_next_is_launched(
    demo_path, prompt_ids, monkeypatch
) -> None:
    """The engine thread launches step N+1 before it reads step N's tokens (the device takes them from step N's
    own, on the device), and hands step N's events to the event loop once step N+2 is launched; when no step
    follows, at once: every stream gets every token, in order, the same as one step at a time (``generate`` of a
    fresh engine is the reference: same tokens by batch invariance). The step statistics see the device's time
    in the steps and the host's between them."""
    import asyncio

    from engine.native import llm_engine

    monkeypatch.setattr(llm_engine, "STATS_INTERVAL", 1e9)  # one window: no reset while the test runs
    engine = _engine(demo_path("bf16"))
    run, at_launch = engine.runner.run, []

    def recording_run(step, every_token=frozenset(), drawn=None):
        # (sequences, events waiting to be handed over, tokens of the step before not read yet)
        at_launch.append((len(step), len(engine._outbox._events), sum(work.seq.pending for work in step)))
        return run(step, every_token, drawn)

    engine.runner.run = recording_run
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    stats = engine.stats
    before = (stats.steps, stats.device, stats.span, stats.spanned_device)  # its start-up's steps

    async def generate() -> list[list[int]]:
        streams = [engine.submit(ids, params) for ids in prompt_ids[:3]]
        engine.start()  # after the three are queued: the first step takes them all
        return [[event.token_id async for event in stream if event.token_id is not None] for stream in streams]

    try:
        served = asyncio.run(generate())
    finally:
        engine.stop()
    assert served == _engine(demo_path("bf16")).generate(prompt_ids[:3], params)
    # Step 0 prefills the three prompts; step 1 is launched before step 0's tokens are read (3 pending), and
    # so is every step after it; from step 2 on, the events of the step before the last wait at each launch.
    # Six tokens each: step 5 draws the last, and no step 6 is launched for a token nobody would read.
    assert at_launch == [(3, 0, 0), (3, 0, 3)] + [(3, 3, 3)] * 4
    assert not engine._outbox._events and not engine._launched and not engine._drawn
    steps, device, span, spanned = (now - then for now, then in zip(
        (stats.steps, stats.device, stats.span, stats.spanned_device), before, strict=True))  # fmt: skip
    assert steps == 6 and device > 0
    # Six steps, each but the last launched on before it was read: five spans, each holding its step's device time
    # and more (on the CPU the forward runs on the thread that launches it).
    assert 0 < spanned < device and spanned < span


@pytest.mark.parametrize("late", [True, False])
def test_a_request_that_arrives_while_a_long_step_runs_joins_the_next_step_with_late_scheduling(
    demo_path, prompt_ids, late: bool
) -> None:
    """On a GPU the engine thread schedules step N+1 while the device runs step N. With ``late_scheduling``, when
    step N is expected to run long (the clock's least time for a step of its size), the thread waits to schedule
    N+1 until shortly before N ends, taking in what arrives meanwhile: a request that arrives once step N is running
    has its prompt computed in N+1, not N+2. Here the runner is taken for an asynchronous one and the clock told
    that a one-token step takes a minute; the second request arrives as the thread reads the first one's prompt
    step, while its first decode step "runs". (The CPU's steps are done when the call returns: the wait ends at the
    arrival.) Its tokens are those it gets alone."""
    import threading

    engine = _engine(demo_path("bf16"), late_scheduling=late)
    engine.runner.asynchronous = True
    engine.clock.steps.clear()  # the warm-up's steps
    engine.clock.ran(1, 60.0)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run, computing, tokens, finished, sent = engine.runner.run, [], {}, threading.Event(), threading.Event()

    def recording_run(step, every_token=frozenset(), drawn=None):
        computing.append([work.seq.request_id for work in step if work.start < len(work.seq.prompt)])
        return run(step, every_token, drawn)

    def sink(events) -> None:
        for stream, event in events:
            tokens.setdefault(stream.request_id, []).extend([event.token_id] if event.token_id is not None else [])
            if stream.request_id == "second" and event.finish_reason is not None:
                finished.set()

    complete = engine._complete

    def completing(landed) -> None:
        complete(landed)
        if not sent.is_set():  # the first prompt step's tokens are read: the first decode step is on the device
            sent.set()
            engine.submit(prompt_ids[1], params, "second", sink=sink)

    engine.runner.run, engine._complete = recording_run, completing
    engine.submit(prompt_ids[0], params, "first", sink=sink)
    engine.start()
    try:
        assert finished.wait(120)
    finally:
        engine.stop()
    assert computing[:4] == ([["first"], [], ["second"], []] if late else [["first"], [], [], ["second"]])
    assert (engine.stats.holds > 0) == late
    assert tokens["second"] == _engine(demo_path("bf16")).generate([prompt_ids[1]], params)[0]


def test_the_engine_thread_carries_its_os_name(demo_path) -> None:
    """/proc tells the step loop's CPU time apart from the HTTP loop's by its OS name (bench/serve_load.py's
    per-thread figures, issue 25's step-loop budget per token)."""
    engine = _engine(demo_path("bf16"))
    engine.start()
    try:
        assert engine._thread is not None
        comm = Path(f"/proc/self/task/{engine._thread.native_id}/comm").read_text().strip()
    finally:
        engine.stop()
    assert comm == ENGINE_THREAD_NAME


def test_an_activation_asked_while_the_engine_serves_is_answered_between_steps(demo_path, prompt_ids,
                                                                              monkeypatch) -> None:  # fmt: skip
    """The supervisor's activation (engine/native/kv_memory.py: commit a reserved KV cache's first stripes, the rest
    in the background) runs on the engine thread once no step is on the device, and the blocks of the stripes
    committed later reach the scheduler while it serves. On the CPU the stripes are bookkeeping (the kernel commits
    memory lazily); small ones here, so that the requests need blocks of the later ones."""
    import engine.native.kv_memory as kv_memory

    per_block = 2 * 30 * 16 * 3 * 64 * 4  # the demo: 30 layers, 3 KV heads of 64, fp32 on the CPU
    monkeypatch.setattr(kv_memory, "STRIPE_BYTES", 4 * per_block)
    monkeypatch.setattr(kv_memory, "FIRST_BYTES", 4 * per_block)
    monkeypatch.setattr(kv_memory, "MAX_STRIPE_BYTES", 4 * per_block)
    engine = _engine(demo_path("bf16"), reserve_kv=True)
    memory, allocator = engine.kv.memory, engine.scheduler.allocator
    assert len(memory.stripes) > 8 and not memory.committed
    added: list[tuple[int, int]] = []
    add = allocator.add
    allocator.add = lambda first, end: (added.append((first, end)), add(first, end))[1]  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    long = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [ids * 2 for ids in prompt_ids[:4]]  # 4 x (2 x 8-13 + 16) tokens: more blocks than the first stripe

    async def serve() -> tuple[list[list[int]], float, list[list[int]]]:
        streams = [engine.submit(ids, params) for ids in prompt_ids[:3]]
        engine.start()
        activated = asyncio.wrap_future(engine.activate(5.0))
        served = [[event.token_id async for event in stream if event.token_id is not None] for stream in streams]
        seconds = await asyncio.wait_for(activated, 30)
        later = [engine.submit(ids, long) for ids in prompts]
        return served, seconds, [[e.token_id async for e in stream if e.token_id is not None] for stream in later]

    try:
        served, seconds, later = asyncio.run(serve())
    finally:
        engine.stop()
    reference = _engine(demo_path("bf16"))
    assert served == reference.generate(prompt_ids[:3], params) and seconds >= 0.0
    assert later == reference.generate(prompts, long)
    assert memory.committed and added == memory.stripes[1:]  # every later stripe, once, in order
    assert allocator.free == engine.kv_blocks_total


SLOW_STRIPE_S = 0.2


def test_sequences_short_of_blocks_wait_for_the_stripes_on_their_way_instead_of_evicting_each_other(
        demo_path, prompt_ids, monkeypatch) -> None:  # fmt: skip
    """A promoted standby serves on its KV cache's first stripe while the others are committed: sequences that
    outgrow it wait (the step loop sleeps, no busy loop) for the next stripe's blocks instead of preempting the
    youngest, which would recompute it for a gap of milliseconds; the answers are an ordinary engine's. Once no more
    blocks are coming, a sequence short of them evicts another again (the scheduler's incoming flag is cleared)."""
    import time as _time

    import engine.native.kv_memory as kv_memory

    per_block = 2 * 30 * 16 * 3 * 64 * 4  # the demo: 30 layers, 3 KV heads of 64, fp32 on the CPU
    for name in ("STRIPE_BYTES", "FIRST_BYTES", "MAX_STRIPE_BYTES"):
        monkeypatch.setattr(kv_memory, name, 4 * per_block)
    engine = _engine(demo_path("bf16"), reserve_kv=True, kv_cache_bytes=40 * per_block)  # 10 stripes
    memory, scheduler = engine.kv.memory, engine.scheduler
    assert len(memory.stripes) == 10
    commit_next = memory.commit_next

    def short() -> bool:  # a running sequence needs a block, and none is free
        allocator = scheduler.allocator
        return not allocator.free and any(allocator.needed(s.blocks, s.length) for s in list(scheduler.running))

    def slow_commit(timeout, waiting=lambda: None):
        # Each stripe once a sequence is short of blocks (an engine that evicts never is; the commit thread polls:
        # a failure here would end the thread, not the test, so no wait_for), then SLOW_STRIPE_S later: the fault
        # injected, a stripe as slow as one after a crash while the driver tears the dead engine down, the window
        # in which a busy loop would show.
        deadline = _time.monotonic() + 3
        while not memory.committed and not short() and _time.monotonic() < deadline:
            _time.sleep(0.005)
        _time.sleep(SLOW_STRIPE_S)
        return commit_next(timeout, waiting)

    memory.commit_next = slow_commit  # type: ignore[method-assign]
    schedules = 0
    schedule = scheduler.schedule

    def counted():
        nonlocal schedules
        schedules += 1
        return schedule()

    scheduler.schedule = counted  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [ids * 2 for ids in prompt_ids[:4]]  # 4 x (2 x 8-13 + 24) tokens: more blocks than the first stripe

    try:
        served = serve_activated(engine, prompts, params, activate_timeout=5.0)
        waited, steps = scheduler.preemptions, schedules
        del memory.commit_next  # the rest at full speed
        wait_for(lambda: not scheduler.allocator.incoming(), 10, "the last stripe committed")
    finally:
        engine.stop()
    assert served == _engine(demo_path("bf16")).generate(prompts, params)
    assert waited == 0
    assert steps < 300, steps  # ~50 steps; a busy loop would schedule thousands of times in each slow stripe
    assert memory.committed and not scheduler.allocator.incoming()  # every stripe in: a shortage evicts again


def test_overlapped_steps_feed_each_sequence_its_own_last_token(demo_path) -> None:
    """tests/overlap_check.py on the CPU, with the demo (its GPU twin is in tests/test_gpu.py)."""
    from overlap_check import check_overlapped_steps

    check_overlapped_steps(_engine(demo_path("bf16")))


def test_a_token_its_grammar_refuses_ends_the_request_with_an_error_and_the_batch_goes_on(
    demo_path, tokenizer, monkeypatch
) -> None:
    """A sampled token waits in its sequence's grammar state until the sequence's next mask is filled; if the
    grammar refuses it there (the masks were not applied: a bug, simulated here), the request ends with an error
    event naming the token at its next step, and the request beside it in the batch gets every token it would
    have got alone."""
    import asyncio

    from engine.grammar import Grammars, GrammarSpec, TokenMasks
    from engine.tokenizer import ChatTokenizer

    monkeypatch.setattr(TokenMasks, "apply", lambda self, logits, rows: None)
    path = demo_path("bf16")
    engine = _engine(path)
    grammars = Grammars(ChatTokenizer(path), engine.vocab_size, engine.eos_token_ids)
    schema = {"type": "object", "properties": {"zq": {"type": "integer"}}, "required": ["zq"]}
    held = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, grammar=grammars.compile(
        GrammarSpec.of_schema(schema)))  # fmt: skip
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = tokenizer.encode("The capital of France is").ids  # greedy goes on with words, never with "{"

    async def run() -> list[list]:
        streams = [engine.submit(ids, held), engine.submit(ids, free)]
        engine.start()
        return [[event async for event in stream] for stream in streams]

    try:
        held_events, free_events = asyncio.run(run())
    finally:
        engine.stop()
    first, last = held_events[0], held_events[-1]
    assert len(held_events) == 2 and first.token_id is not None and first.finish_reason is None
    assert last.finish_reason == "error" and last.error == f"token {first.token_id} does not follow the grammar"
    alone = _engine(path).generate([ids], free)[0]
    assert [e.token_id for e in free_events if e.token_id is not None] == alone and free_events[-1].finish_reason


def test_stops_on_eos_and_max_tokens(demo_path, tokenizer) -> None:
    from engine.tokenizer import model_eos_ids

    engine = _engine(demo_path("bf16"))
    chat = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    out = engine.generate([tokenizer.encode(chat).ids], SamplingParams(max_tokens=64, temperature=0))[0]
    assert out[-1] == 2 and 2 not in out[:-1] and len(out) < 64
    assert model_eos_ids({"eos_token_id": [2, 7]}, Path("/nonexistent")) == [2, 7]
    short = engine.generate([tokenizer.encode(chat).ids], SamplingParams(max_tokens=3, temperature=0))[0]
    assert short == out[:3]


def test_sampling_seed_top_k_and_penalties(demo_path, prompt_ids) -> None:
    engine = _engine(demo_path("bf16"))
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
    a = engine.generate(prompt_ids[:1], seeded)[0]
    assert engine.generate(prompt_ids[:1], seeded)[0] == a
    other = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True)
    assert engine.generate(prompt_ids[:1], other)[0] != a
    top1 = SamplingParams(max_tokens=12, temperature=0.7, top_k=1, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert engine.generate(prompt_ids[:1], top1) == engine.generate(prompt_ids[:1], greedy)
    repeated = engine.generate(prompt_ids[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    penalized = SamplingParams(
        max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0, ignore_eos=True
    )
    fresh = engine.generate(prompt_ids[:1], penalized)[0]
    assert len(set(fresh)) > len(set(repeated)), "penalties must discourage repeats"


def test_bad_requests_and_unknown_kernels(demo_path) -> None:
    engine = _engine(demo_path("bf16"))
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 250], GREEDY)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(UnknownKernel, match="fp8-magic"):
        kernel_for(LinearRecipe("fp8-magic", "fp8-block", "none", 1, 1, 1, 1))
    assert kernel_for(LinearRecipe(FP8_DEQUANT, "fp8-block", "none", 1, 1, 1, 1)) is not None


TINY = {"hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 512}  # fmt: skip
VARIANTS = {
    "llama3-rope-scaling": {**SHAPES["llama3-8b"], **TINY, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}},
    "qwen2-qkv-bias": {**SHAPES["llama3-8b"], **TINY, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                       "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "qwen3-qk-norm": {**SHAPES["qwen3-0.6b"], **TINY},
    "mistral": {**SHAPES["llama3-8b"], **TINY, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": None},
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_variants_match_transformers(tmp_path: Path, variant: str) -> None:
    from transformers import AutoModelForCausalLM

    path = synth_checkpoint(tmp_path / variant, VARIANTS[variant], "bf16", progress=False)
    # Random weights are tiny (std 0.02); biases and norms get random values too so they matter.
    ckpt = read_checkpoint(path)
    gen = torch.Generator().manual_seed(0)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    for name in tensors:
        if name.endswith((".bias", "norm.weight")):
            tensors[name] = (1 + 0.5 * torch.randn(tensors[name].shape, generator=gen)).to(torch.bfloat16)
    save_file(tensors, str(path / "model.safetensors"))
    assert ckpt.layout.shape.model_type == VARIANTS[variant]["model_type"]

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    loaded = DiskWeights(path).load(torch.device("cpu"), torch.float32)
    args = ModelArgs.from_config(loaded.config)
    model = Transformer(args, loaded.weights)
    kv = KVCache(args.shape, KVCacheSpec.plan(args.shape, torch.float32, 1, 512, None, 16), torch.float32, model.device)
    runner = ModelRunner(model, kv, max_seqs=1, max_tokens=512, max_model_len=512, cuda_graphs=False)
    seq = Sequence("v", torch.randint(0, 256, (300,), generator=gen).tolist(), GREEDY, lambda event: None)
    ids = torch.tensor(seq.prompt)  # past 64 positions: llama3 scaling matters
    assert BlockAllocator(kv.spec).grow(seq.blocks, 301)
    with torch.no_grad():
        ours = model.logits(runner.hidden_states([Scheduled(seq, 0, 300)]))
        ref = reference(ids[None]).logits[0]
        assert float((ours - ref).abs().max()) < 1e-3 * float(ref.abs().max())
        seq.output.append(int(ids[-1]))  # one decode step on top of the cached prompt
        step = model.logits(runner.hidden_states([Scheduled(seq, 300, 1)]))
        ref_step = reference(torch.cat([ids, ids[-1:]])[None]).logits[0, -1]
        assert float((step[0] - ref_step).abs().max()) < 1e-3 * float(ref_step.abs().max())


def test_graphs_are_captured_with_the_garbage_collector_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """capture_all keeps Python's cyclic collector off while it captures (a collection could destroy another
    engine's graphs mid-capture and invalidate it, as pytorch/pytorch#161037 describes), and turns it back on
    after, a failed capture included. The captures themselves need CUDA: recorded here, not made."""
    import gc

    class Runner:  # what capture_all reads of a ModelRunner
        mixed_sizes, decode_sizes, shared_decode_sizes, capture_parts = [96], [1, 8], [8], {}

        def __init__(self, fail_at: tuple[str, int] | None = None) -> None:
            self.captured: list[tuple[tuple[str, int], bool]] = []
            self.fail_at = fail_at

        def _capture(self, key: tuple[str, int], warm_up: bool) -> None:
            self.captured.append((key, gc.isenabled()))
            if key == self.fail_at:
                raise RuntimeError("capture failed")

        def _upload_graph(self, key: tuple[str, int]) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    assert gc.isenabled()
    runner = Runner()
    ModelRunner.capture_all(runner)  # type: ignore[arg-type]
    assert runner.captured == [(("mixed", 96), False), (("decode", 8), False), (("shared", 8), False),
                               (("decode", 1), False)]  # fmt: skip
    assert gc.isenabled()
    failing = Runner(fail_at=("decode", 8))
    with pytest.raises(RuntimeError, match="capture failed"):
        ModelRunner.capture_all(failing)  # type: ignore[arg-type]
    assert [enabled for _, enabled in failing.captured] == [False, False] and gc.isenabled()


@pytest.mark.parametrize("budget", [100, 512, 1000, 2048, 8192])
def test_every_mixed_step_replays_a_graph_it_fills_by_two_thirds_above_512_tokens(budget: int) -> None:
    """A mixed step replays the smallest graph that holds it and computes its padding rows in full: above 512 tokens,
    where a step's time grows with its rows, no step leaves more than a third of its graph's rows empty; the largest
    graph is the budget, capped at MAX_MIXED_GRAPH_TOKENS (larger steps run eagerly)."""
    from engine.native.model_runner import MAX_MIXED_GRAPH_TOKENS, mixed_buckets

    sizes = mixed_buckets(budget)
    assert sizes == sorted(set(sizes)) and sizes[-1] == min(budget, MAX_MIXED_GRAPH_TOKENS)
    for tokens in range(1, sizes[-1] + 1):
        graph = next(s for s in sizes if s >= tokens)
        if tokens > 512:
            assert graph - tokens < graph / 3, (tokens, graph)


def test_block_fp8_rows_are_padded_where_a_library_gemm_may_take_them() -> None:
    """Above 32 rows (DeepGEMM's bound, under cuBLAS' 64) the norms pad a block-FP8 layer's quantized rows to 4, the
    layout both libraries take; DeepGEMM is built for the graphs' sizes above 32 rows only, and never on the CPU."""
    from cache.processors.native import FP8_BLOCK_SCALED_MM
    from engine.native.deep_gemm import DeepGemm
    from engine.native.kernels import DEEP_GEMM_SMALL_M, cublas_sized, deep_gemm_rows, quantized_rows

    assert DEEP_GEMM_SMALL_M == 32
    wide = LinearRecipe(FP8_BLOCK_SCALED_MM, "fp8-block", "dynamic-per-token-group-128", 4096, 4096, 4096, 4096)
    narrow = LinearRecipe(FP8_BLOCK_SCALED_MM, "fp8-block", "dynamic-per-token-group-128", 640, 640, 640, 640)
    assert cublas_sized(wide) and not cublas_sized(narrow)  # 5 scale blocks: cuBLAS refuses it
    assert [quantized_rows(wide, m) for m in (1, 31, 32, 33, 45, 48, 64, 65, 1001)] == [1, 31, 32, 36, 48, 48, 64,
                                                                                          68, 1004]  # fmt: skip
    assert [quantized_rows(narrow, m) for m in (33, 45, 65)] == [33, 45, 65]
    assert deep_gemm_rows([1, 2, 16, 24, 32, 48, 50, 64, 128, 1024]) == [48, 52, 64, 128, 1024]
    assert DeepGemm.load(torch.device("cpu")) is None


def test_deep_gemm_leaves_a_kernel_that_fails_to_build_to_cublas(caplog: pytest.LogCaptureFixture) -> None:
    """DeepGemm.prepare builds one kernel per distinct launch choice and keeps only those that built: a failing one
    (nvcc's error, an unwritable cache) is logged, its sizes left to cuBLAS, and the engine starts. DeepGEMM itself
    needs nvcc and an sm_90 card, so a stand-in module plays it here (tests/test_gpu.py runs the real one)."""
    from types import SimpleNamespace

    from engine.native.deep_gemm import DeepGemm

    calls: list[tuple[int, int, int]] = []

    def get_best_configs(m: int, n: int, k: int, groups: int, sms: int) -> tuple[int, int]:
        return (64 if m <= 64 else 128, sms)  # DeepGEMM's block_m, as it picks it from the rows

    def gemm_fp8_fp8_bf16_nt(lhs: tuple[torch.Tensor, torch.Tensor], rhs: tuple[torch.Tensor, torch.Tensor],
                             out: torch.Tensor) -> None:  # fmt: skip
        calls.append((lhs[0].shape[0], *rhs[0].shape))
        if rhs[0].shape[0] == 256 and lhs[0].shape[0] > 64:
            raise AssertionError("Failed to compile kernel.cu")

    module = SimpleNamespace(jit_kernels=SimpleNamespace(gemm=SimpleNamespace(get_best_configs=get_best_configs)),
                             gemm_fp8_fp8_bf16_nt=gemm_fp8_fp8_bf16_nt)  # fmt: skip
    deep = DeepGemm(module, torch.device("cpu"), sms=132)
    weights = [(torch.zeros(n, 256, dtype=torch.float8_e4m3fn), torch.ones(n // 128, 2)) for n in (256, 512)]
    with caplog.at_level("WARNING"):
        assert deep.prepare(weights, [48, 64, 128, 1024]) == 3
    assert sorted(calls) == [(48, 256, 256), (48, 512, 256), (128, 256, 256), (128, 512, 256)]  # one a choice
    assert deep.built == {(256, 256, (64, 132)), (512, 256, (64, 132)), (512, 256, (128, 132))}
    assert "event=deep_gemm_build_failed" in caplog.text and "Failed to compile" in caplog.text
