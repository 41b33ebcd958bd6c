"""Continuous batching over a paged KV cache: every step mixes decode tokens with prompt chunks.

Each step has a budget of ``max_num_batched_tokens``. Running sequences come first, one decode
token each (or the rest of a prompt that an earlier step only began); waiting prompts then fill
what is left of the budget, a long one in chunks over several steps. A sequence takes cache
blocks as it grows; when none are free, the most recently admitted running sequence is
preempted: its blocks are freed and it waits again at the head of the queue, to be recomputed
(prompt and the tokens generated so far) when blocks return. Its output so far is kept, so the
client sees no difference. While more blocks are on their way (a promoted standby's KV cache committed stripe
by stripe), a sequence short of blocks waits for them instead: nothing is evicted and recomputed for a gap of
milliseconds.

With prefix caching (engine/native/kv_cache.py), a sequence admitted takes the cached blocks of its longest
cached prefix of full blocks and computes only the rest (at least its last token, whose logits it samples
from). A waiting sequence whose next block another running sequence is computing right now waits for it
instead of computing it too: the n choices of one prompt, or a burst of requests with one system prompt,
prefill the shared part once.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.native.kv_cache import BlockAllocator, block_hashes
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarState
    from engine.request_stream import TokenEvent, TokenLogprobs


@dataclass(eq=False)  # identity: the scheduler looks sequences up in its lists every step
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    is_cancelled: Callable[[], bool] = lambda: False
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)  # the block table
    computed: int = 0  # leading tokens whose keys and values are in the cache
    preemptions: int = 0
    grammar: GrammarState | None = None  # where the answer is in its grammar (structured outputs)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # collected by position while it is prefilled
    hashes: list[bytes] = field(default_factory=list)  # of its full blocks so far, each chained to the one before
    remembered: int = 0  # leading blocks the prefix cache was told about
    # Its prompt's tokens that were cached at its first admission (usage's cached_tokens): None until admitted, then
    # reported once, on its first event (``LLMEngine``); a preempted sequence admitted again does not count again.
    cached_tokens: int | None = None
    limit: int = sys.maxsize  # the length at which it ends (prompt + max_tokens, or the engine's max_model_len)
    # Tokens drawn on the device and not yet read (a step's tokens are read once the next step is launched), and
    # the row of the latest among the tokens its step drew: the next step's input, copied on the device.
    pending: int = 0
    pending_row: int = -1
    finished: bool = False

    @property
    def length(self) -> int:
        """Its tokens, the pending ones included."""
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def known(self) -> int:
        """Its tokens the host has read."""
        return len(self.prompt) + len(self.output)

    def token_at(self, i: int) -> int:
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        if start >= n:
            return self.output[start - n : end - n]
        return self.prompt[start:] + self.output[: end - n]

    def block_hashes(self, blocks: int, block_size: int) -> list[bytes]:
        """Its prefix hashes, at least those of its first ``blocks`` full blocks (each computed once)."""
        have = len(self.hashes)
        if blocks > have:
            tokens = self.token_slice(have * block_size, blocks * block_size)
            self.hashes += block_hashes(self.hashes[-1] if self.hashes else b"", tokens, block_size)
        return self.hashes


class Scheduled:
    """One sequence's share of a step: tokens computed..computed+count-1; sampled when they reach its end (as it
    stands when the step is scheduled: ``samples`` is read before the step's token is appended). A plain class
    with slots: one is made per sequence per step, on the step loop's path."""

    __slots__ = ("count", "samples", "seq", "start")

    def __init__(self, seq: Sequence, start: int, count: int) -> None:
        self.seq, self.start, self.count = seq, start, count
        self.samples = start + count == seq.length


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_num_seqs: int, max_batched_tokens: int) -> None:
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        # Room for a decode token of every running sequence, or those behind the budget would starve.
        self.max_batched_tokens = max(max_batched_tokens, max_num_seqs)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is preempted first
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Scheduled]:
        """This step's work: decode tokens and prompt chunks within the token budget, blocks allocated."""
        budget, preempted = self.max_batched_tokens, self.preemptions
        step: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:  # victims leave from the end of the list
            seq = self.running[i]
            length = seq.length
            # Nothing to compute until its tokens on the device are read: its prompt is in the cache and only scored
            # (nothing is drawn), or its last token is being drawn (no step would draw one after it).
            if seq.computed >= length or (seq.pending > 0 and length >= seq.limit):
                i += 1
                continue
            count = min(length - seq.computed, budget)
            while not self.allocator.grow(seq.blocks, seq.computed + count):
                if self.allocator.incoming():  # blocks are on their way: it waits a step for them, evicting no one
                    break
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                step.append(Scheduled(seq, seq.computed, count))
                budget -= count
            if i < len(self.running) and self.running[i] is seq:  # not preempted: on to the next
                i += 1
        if self.preemptions > preempted:  # blocks ran short: no one new comes in (nor does a victim come back)
            return step
        in_flight = self._in_flight() if self.allocator.prefix_caching and self.waiting else set()
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            if cached is not None and self._next_in_flight(seq, len(cached), in_flight):
                deferred.append(self.waiting.popleft())  # its prefix is being computed: it takes it next step
                continue
            if cached:
                self.allocator.share(seq.blocks, cached)
                seq.computed = len(cached) * self.allocator.block_size
                seq.remembered = len(cached)
            count = min(seq.length - seq.computed, budget)
            if not self.allocator.grow(seq.blocks, seq.computed + count):
                self.allocator.release(seq.blocks)
                seq.computed = seq.remembered = 0
                break
            if cached is not None:
                self.allocator.queried_tokens += seq.length
                self.allocator.hit_tokens += seq.computed
                in_flight.update(self._computing(seq))
            if seq.cached_tokens is None:
                seq.cached_tokens = min(seq.computed, len(seq.prompt))
            self.waiting.popleft()
            self.running.append(seq)
            step.append(Scheduled(seq, seq.computed, count))
            budget -= count
        self.waiting.extendleft(reversed(deferred))  # in their order, still ahead of the rest
        return step

    def computed(self, step: list[Scheduled]) -> None:
        """The step is on the device: its tokens are (in stream order) in the cache, and the blocks it filled are
        cached prefixes, once their tokens are known (``remember``)."""
        for work in step:
            work.seq.computed = work.start + work.count
            self.remember(work.seq)

    def remember(self, seq: Sequence) -> None:
        """Tell the prefix cache about the sequence's blocks that are computed, full, and whose tokens the host
        knows (a block whose last token is still pending is remembered once that token is read)."""
        size = self.allocator.block_size
        if seq.computed // size <= seq.remembered:  # no block filled since (most calls: twice a step a sequence)
            return
        full = min(seq.computed, seq.known) // size
        if full > seq.remembered and self.allocator.prefix_caching and not seq.finished:
            hashes = seq.block_hashes(full, size)  # a decode step fills one block in block_size
            for i in range(seq.remembered, full):
                self.allocator.remember(seq.blocks[i], hashes[i])
        seq.remembered = max(seq.remembered, full)

    def _cached_prefix(self, seq: Sequence) -> list[int] | None:
        """The cached blocks a sequence about to be admitted can take (None: it takes none, it scores its prompt,
        whose every position's logits it needs, or it still holds blocks); its last token is always computed."""
        if not self.allocator.prefix_caching or seq.blocks or seq.prompt_logprobs is not None:
            return None
        usable = self._usable(seq)
        return self.allocator.cached_prefix(seq.block_hashes(usable, self.allocator.block_size)[:usable])

    def _usable(self, seq: Sequence) -> int:
        """Full blocks a sequence could take from the cache: all but its last token's."""
        return (seq.length - 1) // self.allocator.block_size

    def _next_in_flight(self, seq: Sequence, cached: int, in_flight: set[bytes]) -> bool:
        """The first block the sequence could take but did not find cached is one a running sequence computes."""
        return cached < self._usable(seq) and seq.hashes[cached] in in_flight

    def _computing(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks of ``seq`` it has yet to compute."""
        size = self.allocator.block_size
        full = seq.length // size
        return seq.block_hashes(full, size)[seq.computed // size : full]

    def _in_flight(self) -> set[bytes]:
        """Hashes of the full blocks the running sequences have yet to compute (their prompts, mostly)."""
        return {h for seq in self.running if seq.length - seq.computed > 1 for h in self._computing(seq)}

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.computed = seq.remembered = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (done, cancelled or failed) and free its blocks (a step still on the device may write
        into them: steps run in order on one stream, so the next sequence to take them writes after it)."""
        seq.finished = True
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.blocks)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def wanted(self) -> tuple[int, int]:
        """What the next step would take with no limits: its sequences, and its tokens (each running sequence's rest,
        a decode token or its prompt's, and each waiting one's prompt past its cached prefix), counted only until
        they reach max_num_seqs or max_batched_tokens (a long queue is not walked)."""
        seqs = len(self.running) + len(self.waiting)
        if seqs >= self.max_num_seqs:
            return seqs, 0
        tokens = sum(max(1, seq.length - seq.computed) for seq in self.running)
        for seq in self.waiting:
            if tokens >= self.max_batched_tokens:
                break
            tokens += self.uncached(seq)
        return seqs, tokens

    def uncached(self, seq: Sequence) -> int:
        """Tokens a waiting sequence would compute if admitted now (its prefix hashes are computed here, once)."""
        cached = self._cached_prefix(seq)
        return seq.length - len(cached or ()) * self.allocator.block_size
