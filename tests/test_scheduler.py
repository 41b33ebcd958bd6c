"""The scheduler on its own: token budget, prompt chunks, block accounting, preemption and recompute, and prefix
caching (shared blocks, waiting for a prefix being computed, eviction, preemption of a sequence whose blocks are
shared); the launch clock of late scheduling."""

from __future__ import annotations

import pytest

from engine.native.kv_cache import BlockAllocator, KVCacheSpec
from engine.native.llm_engine import LaunchClock
from engine.native.scheduler import Scheduler, Sequence
from engine.sampling_params import SamplingParams


def _seq(name: str, length: int, first: int = 0) -> Sequence:
    return Sequence(name, list(range(first, first + length)), SamplingParams(max_tokens=100), lambda event: None)


def _advance(step, scheduler: Scheduler | None = None) -> None:
    """What the engine does after a forward: mark tokens computed, append a token where one was sampled."""
    if scheduler is not None:
        scheduler.computed(step)
    for work in step:
        work.seq.computed = work.start + work.count
        if work.samples:
            work.seq.output.append(1)


def _caching(blocks: int, max_seqs: int = 8, budget: int = 64) -> Scheduler:
    """A scheduler with prefix caching over ``blocks`` usable blocks of 4 positions."""
    return Scheduler(BlockAllocator(KVCacheSpec(blocks + 1, 4, 1), prefix_caching=True), max_seqs, budget)


def _work(step) -> list[tuple[str, int, int]]:
    return [(w.seq.request_id, w.start, w.count) for w in step]


def test_prompts_are_chunked_by_the_budget_and_decodes_go_first() -> None:
    scheduler = Scheduler(BlockAllocator(KVCacheSpec(blocks=65, block_size=4, bytes_per_token=1)), 8, 16)
    a, b = _seq("a", 10), _seq("b", 30)
    scheduler.add(a)
    scheduler.add(b)
    step = scheduler.schedule()
    assert [(w.seq.request_id, w.start, w.count, w.samples) for w in step] == [("a", 0, 10, True), ("b", 0, 6, False)]
    _advance(step)
    step = scheduler.schedule()  # a decodes first, b's prompt goes on in the rest of the budget
    assert [(w.seq.request_id, w.start, w.count) for w in step] == [("a", 10, 1), ("b", 6, 15)]
    _advance(step)
    assert len(a.blocks) == 3 and len(b.blocks) == 6  # ceil(11 / 4), ceil(21 / 4)


def test_every_running_sequence_decodes_even_with_a_budget_below_their_number() -> None:
    scheduler = Scheduler(BlockAllocator(KVCacheSpec(blocks=65, block_size=4, bytes_per_token=1)), 6, 4)
    seqs = [_seq(f"s{i}", 1) for i in range(6)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(3):
        _advance(scheduler.schedule())
    assert all(len(seq.output) == 3 for seq in seqs)


def test_out_of_blocks_the_latest_sequence_is_preempted_and_recomputed() -> None:
    allocator = BlockAllocator(KVCacheSpec(blocks=6, block_size=4, bytes_per_token=1))  # 5 usable blocks: 20 tokens
    scheduler = Scheduler(allocator, 4, 64)
    first, second = _seq("first", 8), _seq("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    _advance(scheduler.schedule())  # 2 + 2 blocks, each sequence has 9 tokens now
    _advance(scheduler.schedule())  # each needs a third block: one is left, so `second` gives its two back
    assert scheduler.preemptions == 1 and second.computed == 0 and not second.blocks
    assert scheduler.running == [first] and list(scheduler.waiting) == [second]
    while first.length < 16:
        _advance(scheduler.schedule())
    scheduler.finish(first)
    step = scheduler.schedule()  # `second` comes back: prompt and output recomputed in one chunk
    assert [(w.seq.request_id, w.start, w.count, w.samples) for w in step] == [("second", 0, second.length, True)]
    scheduler.finish(second)
    assert allocator.free == 5


def test_a_prompt_that_shares_a_prefix_takes_its_cached_blocks_and_computes_the_rest() -> None:
    scheduler = _caching(32)
    first = _seq("first", 10)
    scheduler.add(first)
    _advance(scheduler.schedule(), scheduler)  # 10 prompt tokens: blocks 0-1 full and cached
    scheduler.finish(first)
    allocator = scheduler.allocator
    assert allocator.free == 32 and len(allocator.block_of) == 2
    again, longer = _seq("again", 10), _seq("longer", 13)  # the same prompt; one that goes on past it
    scheduler.add(again)
    scheduler.add(longer)
    step = scheduler.schedule()
    assert _work(step) == [("again", 8, 2), ("longer", 8, 5)]
    assert again.blocks[:2] == longer.blocks[:2] and allocator.refs[again.blocks[0]] == 2
    assert (allocator.queried_tokens, allocator.hit_tokens) == (10 + 10 + 13, 16)


def test_a_whole_prompt_in_the_cache_still_computes_its_last_token() -> None:
    scheduler = _caching(32)
    first = _seq("first", 8)
    scheduler.add(first)
    _advance(scheduler.schedule(), scheduler)
    held = list(first.blocks)
    scheduler.finish(first)
    again = _seq("again", 8)
    scheduler.add(again)
    assert _work(scheduler.schedule()) == [("again", 4, 4)]  # block 1 holds the last token: computed again
    assert again.blocks[0] == held[0] and again.blocks[1] != held[1]


def test_choices_of_one_prompt_wait_for_its_prefill_instead_of_computing_it_again() -> None:
    scheduler = _caching(64, budget=8)
    choices = [_seq(f"c{i}", 18) for i in range(3)]
    for seq in choices:
        scheduler.add(seq)
    # c0's prompt takes three steps of 8 tokens; c1 and c2 wait, their blocks being computed by c0.
    for expected in ([("c0", 0, 8)], [("c0", 8, 8)]):
        step = scheduler.schedule()
        assert _work(step) == expected
        _advance(step, scheduler)
    assert _work(scheduler.schedule()) == [("c0", 16, 2), ("c1", 16, 2), ("c2", 16, 2)]
    assert choices[1].blocks[:4] == choices[0].blocks[:4] == choices[2].blocks[:4]
    assert [len(set(s.blocks[4:])) for s in choices] == [1, 1, 1] and len({s.blocks[4] for s in choices}) == 3


def test_a_sequence_scoring_its_prompt_takes_no_cached_block() -> None:
    scheduler = _caching(32)
    first = _seq("first", 10)
    scheduler.add(first)
    _advance(scheduler.schedule(), scheduler)
    scoring = _seq("scoring", 10)
    scoring.prompt_logprobs = [None]  # it needs every prompt position's logits
    scheduler.add(scoring)
    assert _work(scheduler.schedule()) == [("first", 10, 1), ("scoring", 0, 10)]


def test_cached_blocks_are_evicted_oldest_first_when_free_ones_run_out() -> None:
    scheduler = _caching(6)
    allocator = scheduler.allocator
    a, b = _seq("a", 9, first=0), _seq("b", 9, first=100)  # 2 full blocks each, 3 blocks with the partial one
    for seq in (a, b):
        scheduler.add(seq)
        _advance(scheduler.schedule(), scheduler)
        scheduler.finish(seq)
    assert allocator.free == 6 and len(allocator.cached_free) == 4 and not allocator.plain[:0]
    c = _seq("c", 13, first=200)  # 4 blocks: the 2 plain ones, then a's two (released first), b's stay cached
    scheduler.add(c)
    _advance(scheduler.schedule(), scheduler)
    assert allocator.cached_prefix(a.hashes) == [] and len(allocator.cached_prefix(b.hashes)) == 2
    scheduler.finish(c)
    again = _seq("b again", 9, first=100)
    scheduler.add(again)
    assert _work(scheduler.schedule()) == [("b again", 8, 1)]
    assert again.blocks[:2] == allocator.cached_prefix(b.hashes)


def test_forgotten_prefixes_are_computed_again_and_their_blocks_are_free_for_anyone() -> None:
    """What a standby cached while its KV cache was a placeholder is forgotten when the real memory comes
    (engine/native/kv_memory.py): a prompt that shared it computes it again."""
    scheduler = _caching(6)
    allocator = scheduler.allocator
    a = _seq("a", 9)
    scheduler.add(a)
    _advance(scheduler.schedule(), scheduler)
    scheduler.finish(a)
    assert len(allocator.cached_prefix(a.hashes)) == 2 and allocator.free == 6
    allocator.forget_cached()
    assert allocator.cached_prefix(a.hashes) == [] and allocator.free == 6 and not allocator.cached_free
    again = _seq("a again", 9)
    scheduler.add(again)
    assert _work(scheduler.schedule()) == [("a again", 0, 9)]


def test_a_preempted_sequence_leaves_its_shared_blocks_to_the_other_and_takes_them_back() -> None:
    scheduler = _caching(7, max_seqs=4)
    allocator = scheduler.allocator
    first = _seq("first", 8)
    scheduler.add(first)
    _advance(scheduler.schedule(), scheduler)  # blocks 0-1 of the prompt, cached
    second = _seq("second", 8)
    scheduler.add(second)
    _advance(scheduler.schedule(), scheduler)  # second shares block 0, computes block 1's last token in its own
    shared = first.blocks[0]
    assert second.blocks[0] == shared and allocator.refs[shared] == 2
    while second.preemptions == 0:  # both grow until blocks run out: the latest, second, is preempted
        _advance(scheduler.schedule(), scheduler)
    assert allocator.refs[shared] == 1 and first.blocks[0] == shared and not second.blocks
    scheduler.finish(first)
    assert allocator.refs[shared] == 0 and shared in allocator.cached_free
    step = scheduler.schedule()  # second comes back through the cache: its own full blocks were cached too
    assert step[0].seq is second and step[0].start >= 4
    assert second.blocks[0] == shared and allocator.refs[shared] == 1


def test_a_block_whose_last_token_is_still_on_the_device_is_cached_once_the_token_is_read() -> None:
    """The engine launches a step before it reads the step before's tokens: a decode token's place is computed while
    the host does not know the token yet. The block it fills is not cached under a hash of tokens the host does not
    have; it is once the token is read. A sequence whose pending token is its last gets no step."""
    scheduler = _caching(8)
    seq = _seq("a", 7)
    seq.limit = 10
    scheduler.add(seq)
    step = scheduler.schedule()  # the prompt: positions 0-6, block 0 full
    scheduler.computed(step)
    seq.pending = 1  # its first token, drawn on the device
    step = scheduler.schedule()  # position 7 (its token pending), in block 1
    assert [(w.start, w.count, w.samples) for w in step] == [(7, 1, True)]
    scheduler.computed(step)
    seq.pending = 2  # the next token, drawn too
    hashes = seq.block_hashes(1, 4)
    assert scheduler.allocator.cached_prefix(hashes) == seq.blocks[:1]  # block 1 waits for position 7's token
    seq.output.append(42)  # read
    seq.pending = 1
    scheduler.remember(seq)
    assert scheduler.allocator.cached_prefix(seq.block_hashes(2, 4)) == seq.blocks[:2]
    seq.output.append(43)
    seq.pending = 1  # position 9's token is being drawn: the last one (limit 10)
    assert seq.length == seq.limit and scheduler.schedule() == []


def test_what_the_next_step_wants_leaves_cached_prefixes_out_and_stops_counting_at_the_limits() -> None:
    """Late scheduling waits for arrivals only while the next step has room: ``wanted`` counts each running
    sequence's rest and each waiting one's prompt past its cached prefix, until max_num_seqs or the budget."""
    scheduler = _caching(32, max_seqs=4, budget=30)
    first = _seq("first", 10)
    scheduler.add(first)
    _advance(scheduler.schedule(), scheduler)  # blocks 0-1 (8 tokens) cached; first decodes now
    assert scheduler.wanted() == (1, 1)
    scheduler.add(_seq("shares", 13))  # its first 8 tokens are first's: 5 to compute
    scheduler.add(_seq("fresh", 6, first=100))
    assert scheduler.wanted() == (3, 1 + 5 + 6)
    for i in range(3):  # past the budget: the rest of the queue is not counted
        scheduler.add(_seq(f"long{i}", 20, first=200 + 20 * i))
    assert scheduler.wanted() == (6, 0)  # past max_num_seqs: nothing counted
    scheduler.max_num_seqs = 8
    assert scheduler.wanted() == (6, 1 + 5 + 6 + 20)


def test_the_launch_clock_expects_the_least_time_of_a_recent_step_as_large_or_a_quarter_smaller() -> None:
    """Late scheduling's deadline (engine/native/llm_engine.py): from the step's start, the device's least time on a
    recent step of as many tokens or up to a quarter fewer (a lower bound), less the host's longest recent launch
    and a margin; none while no such step or launch is known."""
    clock = LaunchClock()
    assert clock.deadline(100, 10.0) is None
    for tokens, seconds in ((100, 0.020), (80, 0.015), (76, 0.014), (120, 0.001), (70, 0.002), (100, 0.018)):
        clock.ran(tokens, seconds)
    assert clock.deadline(100, 10.0) is None  # no launch timed yet
    clock.launched(0.002)
    clock.launched(0.001)
    # 100, 80 and 76 tokens count; 120 (more) and 70 (over a quarter fewer) do not
    assert clock.deadline(100, 10.0) == pytest.approx(10.0 + 0.014 - 0.002 - LaunchClock.MARGIN_S)
    assert clock.deadline(60, 10.0) is None
    for _ in range(LaunchClock.STEPS):  # older steps are forgotten
        clock.ran(100, 0.030)
    assert clock.deadline(100, 10.0) == pytest.approx(10.0 + 0.030 - 0.002 - LaunchClock.MARGIN_S)
