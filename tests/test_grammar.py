"""A sequence's grammar state (engine/grammar.py): the tokens sampled for it are accepted when its next mask is
filled, in the thread that fills masks, and a token the grammar refuses stops the state instead of a mask."""

from __future__ import annotations

import pytest
import torch

from engine.grammar import Grammars, GrammarSpec, GrammarState, TokenMasks
from engine.tokenizer import ChatTokenizer

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
          "required": ["city", "zip"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def grammars(demo_path) -> Grammars:
    tokenizer = ChatTokenizer(demo_path("bf16"))
    return Grammars(tokenizer, tokenizer.vocab_size, [2])


def _allowed(row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def test_tokens_accepted_as_the_next_mask_is_filled_give_the_masks_of_tokens_accepted_at_once(grammars) -> None:
    grammar = grammars.compile(GrammarSpec.of_schema(SCHEMA))
    deferred, eager = GrammarState(grammar), GrammarState(grammar)
    masks = TokenMasks(4, pinned=False, threads=1)
    for step in range(12):
        masks.fill([deferred], [1])
        assert masks.bitmask is not None
        allowed = _allowed(masks.bitmask[1], grammar.vocab_size)
        token = allowed[(7 * step) % len(allowed)]  # a different allowed token each step
        assert eager.accept(token)
        deferred.pending.append(token)
        assert deferred.pending and deferred.refused is None
    masks.fill([deferred], [1])
    masks.fill([eager], [2])
    assert not deferred.pending and masks.bitmask is not None
    assert torch.equal(masks.bitmask[1], masks.bitmask[2]), "the same place in the grammar"


def test_a_pending_token_the_grammar_refuses_stops_the_state_and_its_row_allows_only_stop_tokens(grammars) -> None:
    grammar = grammars.compile(GrammarSpec.of_schema(SCHEMA))
    state = GrammarState(grammar)
    masks = TokenMasks(2, pinned=False, threads=1)
    masks.fill([state], [0])
    assert masks.bitmask is not None
    allowed = set(_allowed(masks.bitmask[0], grammar.vocab_size))
    forbidden = next(t for t in range(grammar.vocab_size) if t not in allowed)
    state.pending += [forbidden, 5]
    masks.fill([state], [0])
    assert state.refused == forbidden and not state.pending
    assert torch.equal(masks.bitmask[0], grammar.stop_mask)
