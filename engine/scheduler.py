"""Continuous batching: sequences wait, get a KV slot, run, and leave between decode steps."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.kv_cache import KVCache
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm_engine import TokenEvent


@dataclass
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    is_cancelled: Callable[[], bool] = lambda: False
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)
    slot: int = -1

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.output)


class Scheduler:
    """Running sequences hold slots 0..B-1 in order; a finished one's slot is refilled by the last."""

    def __init__(self, kv: KVCache, max_batched_tokens: int) -> None:
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admit(self) -> list[Sequence]:
        """Give free slots to waiting sequences, within the prefill token budget (always at least one)."""
        admitted: list[Sequence] = []
        budget = self.max_batched_tokens
        while self.waiting and len(self.running) < self.kv.spec.slots:
            seq = self.waiting[0]
            if admitted and len(seq.prompt) > budget:
                break
            self.waiting.popleft()
            budget -= len(seq.prompt)
            seq.slot = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence) -> None:
        if seq.slot < 0:  # still waiting
            self.waiting.remove(seq)
            return
        last = self.running.pop()
        if last is not seq:
            self.kv.move(last.slot, seq.slot, last.length)
            last.slot = seq.slot
            self.running[seq.slot] = last
        seq.slot = -1

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
