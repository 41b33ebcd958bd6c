"""The scheduler on its own: token budget, prompt chunks, block accounting, preemption and recompute."""

from __future__ import annotations

from engine.native.kv_cache import BlockAllocator, KVCacheSpec
from engine.native.scheduler import Scheduler, Sequence
from engine.sampling_params import SamplingParams


def _seq(name: str, length: int) -> Sequence:
    return Sequence(name, list(range(length)), SamplingParams(max_tokens=100), lambda event: None)


def _advance(step) -> None:
    """What the engine does after a forward: mark tokens computed, append a token where one was sampled."""
    for work in step:
        work.seq.computed = work.start + work.count
        if work.samples:
            work.seq.output.append(1)


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
    assert len(allocator.free) == 5
