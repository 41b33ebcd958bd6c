"""Structured outputs: an answer held to a JSON schema (or to any JSON), token by token, with xgrammar.

xgrammar was chosen over llguidance by the mask cost on the critical path of a decode step
(bench/grammar_masks.py, batch 64, the demo's 49,152-token vocabulary, a schema with strings, enums, an
array, a nested object and a pattern: 0.34 ms per step against 5.1 ms, median) and covers JSON Schema as
vLLM's default backend does. Compiling a schema takes milliseconds; compiled grammars are cached by their text.

The engine's server compiles a request's grammar (``Grammars.compile``, off the event loop) before it submits
the request, so a schema that cannot be compiled is a 400 and never reaches an engine. Each sequence follows its
grammar with a ``GrammarState``: before each sampling step it writes the tokens the grammar allows into its row
of a bitmask, and the sampled token advances it. A resumed request's state is rebuilt by replaying the tokens the
failed engine generated, so the answer goes on exactly where it stopped.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # neither is imported by the relays, which read the request models of engine/protocol.py
    import torch
    import xgrammar

    from engine.tokenizer import ChatTokenizer

CACHE_SIZE = 256  # compiled grammars kept (a schema's compiled form is tens of KB to a few MB)


class GrammarError(ValueError):
    """The request's grammar cannot be compiled (an invalid or unsupported schema); the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    """What an answer must be: any JSON object (``json_object``), JSON by a schema (``json_schema``), or text in
    which tagged parts follow schemas (``structural_tag``: xgrammar's, for tool calls)."""

    kind: Literal["json_object", "json_schema", "structural_tag"]
    schema: str | None = None  # the schema as JSON text, its keys in the client's order (properties are written
    # in that order): the cache key

    @classmethod
    def of_schema(cls, schema: dict[str, Any]) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.schema or ''}"


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar: what a sequence's GrammarState follows."""

    spec: GrammarSpec
    compiled: xgrammar.CompiledGrammar
    stop_ids: tuple[int, ...]  # what may follow a complete answer (ignore_eos goes on with them)


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary, and keeps the last CACHE_SIZE of them."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        import xgrammar

        self._xgr = xgrammar
        vocab, encoding = tokenizer.grammar_vocabulary(vocab_size)
        kind = {"byte_level": xgrammar.VocabType.BYTE_LEVEL, "byte_fallback": xgrammar.VocabType.BYTE_FALLBACK,
                "raw": xgrammar.VocabType.RAW}[encoding]  # fmt: skip
        info = xgrammar.TokenizerInfo(vocab, kind, vocab_size=vocab_size, stop_token_ids=stop_ids)
        self.vocab_size = vocab_size
        self._stop_ids = tuple(stop_ids)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec`` (GrammarError if it cannot be compiled). Thread-safe enough to call
        from a worker thread: the cache is touched only under the GIL, and a race compiles twice at worst."""
        cached = self._cache.get(spec.key)
        if cached is not None:
            self._cache.move_to_end(spec.key)
            return cached
        try:
            # Compact JSON (", " and ": " between items, no other whitespace): a small model given any whitespace
            # may write newlines until max_tokens instead of the JSON it was asked for. A schema is strict (no
            # property it does not name); json_object is any object.
            if spec.kind == "structural_tag":
                compiled = self._compiler.compile_structural_tag(spec.schema or "")
            else:
                schema, strict = (spec.schema, True) if spec.kind == "json_schema" else ('{"type": "object"}', False)
                compiled = self._compiler.compile_json_schema(schema or "{}", any_whitespace=False,
                                                              strict_mode=strict)  # fmt: skip
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"the JSON schema cannot be used: {_first_line(exc)}") from None
        grammar = Grammar(spec, compiled, self._stop_ids)
        self._cache[spec.key] = grammar
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar


class GrammarState:
    """One sequence's place in its grammar."""

    def __init__(self, grammar: Grammar, generated: list[int] | None = None) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(grammar.compiled)
        self._stop_ids = grammar.stop_ids
        for token in generated or ():  # a resumed request: replay what the failed engine generated
            if not self.accept(token):
                raise GrammarError(f"the resumed output does not follow its grammar (token {token})")

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into ``bitmask[row]``: after a complete answer (a request that
        ignores eos goes on), stop tokens only."""
        if not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(bitmask, row)
            return
        bitmask[row] = 0
        for token in self._stop_ids:
            word, bit = divmod(token, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the mask was not applied)."""
        if self._matcher.is_terminated():
            return token in self._stop_ids
        return bool(self._matcher.accept_token(token))

    @property
    def finished(self) -> bool:
        """The answer is complete (a stop token was accepted)."""
        return bool(self._matcher.is_terminated())


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    import xgrammar

    return xgrammar.allocate_token_bitmask(rows, vocab_size)  # type: ignore[no-any-return]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set to -inf, in place, what their grammars forbid in the logits of ``rows`` (``bitmask[row]`` filled for
    each of them)."""
    import xgrammar

    mask = bitmask[: logits.shape[0]].to(logits.device, non_blocking=True)
    xgrammar.apply_token_bitmask_inplace(logits, mask, vocab_size=logits.shape[1], indices=rows)


def _first_line(exc: Exception) -> str:
    """The library's message without its time stamp and source location ("[19:13:39] /project/x.cc:94: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return text.splitlines()[0][:300] if text else type(exc).__name__
