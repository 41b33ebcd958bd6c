"""Structured outputs in vLLM's engine, through warmgate's own grammars (engine/grammar.py): a logits processor.

vLLM's structured-output manager cannot serve here: it needs vLLM's tokenizer (warmgate runs vLLM with
``skip_tokenizer_init``), and it cannot resume a request: a resumed request's grammar would start again at
its beginning, in the middle of its answer. So vLLM's requests carry the key of a grammar registered here by
the engine (``SamplingParams.extra_args["warmgate_grammar"]``), with the tokens a resumed request already
generated, and this processor holds them to it: it replays those tokens, follows each request's output as vLLM
appends to it, and masks the logits of every step. vLLM runs in the worker's process, so the registry is
shared with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.grammar import Grammar, GrammarState, TokenMasks

if TYPE_CHECKING:
    import torch

KEY = "warmgate_grammar"  # in vLLM's SamplingParams.extra_args: the request's key in REGISTRY


@dataclass(frozen=True)
class Registered:
    grammar: Grammar
    generated: list[int] = field(default_factory=list)  # a resumed request's tokens from the failed engine


REGISTRY: dict[str, Registered] = {}  # request id -> its grammar, while vLLM has the request


@dataclass
class _Following:
    """One request in vLLM's batch: its grammar state and how much of vLLM's output list it has taken."""

    state: GrammarState
    output: list[int]  # vLLM's own list of the request's output tokens (it appends to it)
    taken: int = 0

    def catch_up(self) -> None:
        for token in self.output[self.taken :]:
            self.state.accept(token)
        self.taken = len(self.output)


def processor() -> type:
    """The logits processor class (built on first use: vLLM is imported only by its backend's workers)."""
    from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

    class GrammarLogitsProcessor(LogitsProcessor):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            self._rows: dict[int, _Following] = {}  # batch index -> the request there, if it has a grammar
            self._masks = TokenMasks(vllm_config.scheduler_config.max_num_seqs, pinned=is_pin_memory)

        def is_argmax_invariant(self) -> bool:
            return False

        def update_state(self, batch_update: BatchUpdate | None) -> None:
            if batch_update is not None:
                for index in batch_update.removed:
                    self._rows.pop(index, None)
                for index, params, _, output in batch_update.added:
                    key = (params.extra_args or {}).get(KEY) if params is not None else None
                    entry = REGISTRY.get(key) if key is not None else None
                    if entry is None:
                        self._rows.pop(index, None)
                        continue
                    # A request vLLM preempted comes back with its output so far: catch_up() replays it.
                    self._rows[index] = _Following(GrammarState(entry.grammar, entry.generated), output)
                for a, b, direction in batch_update.moved:
                    first, second = self._rows.pop(a, None), self._rows.pop(b, None)
                    if first is not None:
                        self._rows[b] = first
                    if direction == MoveDirectionality.SWAP and second is not None:
                        self._rows[a] = second
            for following in self._rows.values():
                following.catch_up()

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            if not self._rows:
                return logits
            rows = sorted(self._rows)
            self._masks.fill([self._rows[row].state for row in rows], rows)
            self._masks.apply(logits, rows)
            return logits

    return GrammarLogitsProcessor
