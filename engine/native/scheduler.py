"""Continuous batching over a paged KV cache: every step mixes decode tokens with prompt chunks.

Each step has a budget of ``max_num_batched_tokens``. Running sequences come first, one decode
token each (or the rest of a prompt that an earlier step only began); waiting prompts then fill
what is left of the budget, a long one in chunks over several steps. A sequence takes cache
blocks as it grows; when none are free, the most recently admitted running sequence is
preempted: its blocks are freed and it waits again at the head of the queue, to be recomputed
(prompt and the tokens generated so far) when blocks return. Its output so far is kept, so the
client sees no difference.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.native.kv_cache import BlockAllocator
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

    @property
    def length(self) -> int:
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


@dataclass(frozen=True)
class Scheduled:
    """One sequence's share of a step: tokens computed..computed+count-1; sampled when they reach its end."""

    seq: Sequence
    start: int
    count: int

    @property
    def samples(self) -> bool:
        return self.start + self.count == self.seq.length


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
        budget = self.max_batched_tokens
        step: list[Scheduled] = []
        i = 0
        while i < len(self.running) and budget > 0:  # victims leave from the end of the list
            seq = self.running[i]
            count = min(seq.length - seq.computed, budget)
            while not self.allocator.grow(seq.blocks, seq.computed + count):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                step.append(Scheduled(seq, seq.computed, count))
                budget -= count
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            count = min(seq.length - seq.computed, budget)
            if not self.allocator.grow(seq.blocks, seq.computed + count):
                break
            self.waiting.popleft()
            self.running.append(seq)
            step.append(Scheduled(seq, seq.computed, count))
            budget -= count
        return step

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.blocks)
        seq.computed = 0
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (done, cancelled or failed) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.blocks)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
