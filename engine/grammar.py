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
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # neither is imported by the relays, which read the request models of engine/protocol.py
    from types import ModuleType

    import torch
    import xgrammar

    from engine.tokenizer import ChatTokenizer

CACHE_SIZE = 256  # compiled grammars kept (a schema's compiled form is tens of KB to a few MB)


def load_xgrammar() -> ModuleType:
    """xgrammar, imported with tvm-ffi's optional torch DLPack extension switched off. At import, that extension
    asks torch whether CUDA is available, which marks every later fork of the process unable to use CUDA: the
    fork server imports xgrammar for its engines, and on the H200 each of them then died at start-up with
    "Cannot re-initialize CUDA in forked subprocess". It would also JIT-build a C++ extension on first import."""
    os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import xgrammar

    return xgrammar


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
    stop_mask: torch.Tensor  # the same as a bitmask row
    vocab_size: int  # the tokens its masks cover: the tokenizer's (a model's padding ids are never allowed)


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary, and keeps the last CACHE_SIZE of them."""

    def __init__(self, tokenizer: ChatTokenizer, vocab_size: int, stop_ids: list[int]) -> None:
        xgrammar = load_xgrammar()

        self._xgr = xgrammar
        vocab, encoding = tokenizer.grammar_vocabulary(vocab_size)
        kind = {"byte_level": xgrammar.VocabType.BYTE_LEVEL, "byte_fallback": xgrammar.VocabType.BYTE_FALLBACK,
                "raw": xgrammar.VocabType.RAW}[encoding]  # fmt: skip
        # Masks cover the tokenizer's ids only. Told of a model's padding ids (vocab_size=128,256 for 49,152
        # tokens), xgrammar cleared each of them in every mask that allows most tokens (inside a JSON string):
        # 144 us a fill instead of 12 on this machine's CPU.
        self.vocab_size = len(vocab)
        stop_ids = [token for token in stop_ids if token < self.vocab_size]
        info = xgrammar.TokenizerInfo(vocab, kind, vocab_size=self.vocab_size, stop_token_ids=stop_ids)
        self._stop_ids = tuple(stop_ids)
        self._stop_mask = xgrammar.allocate_token_bitmask(1, self.vocab_size)[0].zero_()
        for token in stop_ids:
            word, bit = divmod(token, 32)
            self._stop_mask[word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32: bit 31 is the sign
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def cached(self, spec: GrammarSpec) -> Grammar | None:
        """The compiled grammar of ``spec`` if it is in the cache (no compiling)."""
        cached = self._cache.get(spec.key)
        if cached is not None:
            self._cache.move_to_end(spec.key)
        return cached

    def compile(self, spec: GrammarSpec) -> Grammar:
        """The compiled grammar of ``spec`` (GrammarError if it cannot be compiled). Thread-safe enough to call
        from a worker thread: the cache is touched only under the GIL, and a race compiles twice at worst."""
        cached = self.cached(spec)
        if cached is not None:
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
        grammar = Grammar(spec, compiled, self._stop_ids, self._stop_mask, self.vocab_size)
        self._cache[spec.key] = grammar
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return grammar


class GrammarState:
    """One sequence's place in its grammar. The tokens sampled for it may wait in ``pending`` until its next mask
    is filled (``catch_up``, in the thread that fills masks, beside the device's forward)."""

    def __init__(self, grammar: Grammar, generated: list[int] | None = None) -> None:
        xgrammar = load_xgrammar()

        self.matcher = xgrammar.GrammarMatcher(grammar.compiled)
        self.grammar = grammar
        self.finished = False  # the answer is complete (a stop token was accepted at its end)
        self.pending: list[int] = []  # sampled, not accepted yet
        self.refused: int | None = None  # a pending token the grammar did not allow (the mask was not applied)
        for token in generated or ():  # a resumed request: replay what the failed engine generated
            if not self.accept(token):
                raise GrammarError(f"the resumed output does not follow its grammar (token {token})")

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (the mask was not applied)."""
        if self.finished:
            return token in self.grammar.stop_ids
        accepted = bool(self.matcher.accept_token(token))
        if accepted and token in self.grammar.stop_ids:  # only a stop token ends an answer
            self.finished = bool(self.matcher.is_terminated())
        return accepted

    def catch_up(self) -> None:
        """Accept the pending tokens; the first one refused stops the state (``refused``)."""
        for token in self.pending:
            if self.refused is None and not self.accept(token):
                self.refused = token
        self.pending.clear()


class TokenMasks:
    """The token masks of a batch's rows that follow grammars, one bitmask row each (``rows`` at most): filled
    before the rows are sampled, then applied to their logits (what a grammar forbids becomes -inf, and so do the
    ids past the tokenizer's in a model's padded vocabulary).

    The grammars still open are filled all at once by xgrammar's batch matcher, on its own threads (``threads``;
    default half the machine's cores) without the GIL; a complete answer (a request that ignores eos goes on) gets
    its stop tokens only. Filled one matcher at a time, 64 rows deep inside long JSON strings took 85 ms a step on
    the H200's host, ten times the decode step they ran beside."""

    def __init__(self, rows: int, pinned: bool, threads: int | None = None) -> None:
        xgrammar = load_xgrammar()

        self._xgr = xgrammar
        self._rows = rows
        self._pinned = pinned  # the filled masks in pinned memory: their copy to the GPU waits for nothing
        self.bitmask: torch.Tensor | None = None  # sized by the first grammar's vocabulary (one per engine)
        self.vocab_size = 0
        self._batch = xgrammar.BatchGrammarMatcher(threads or "auto")
        self._on_device: torch.Tensor | None = None  # the masks as the logits' device reads them, model-wide

    def fill(self, states: list[GrammarState], rows: list[int]) -> None:
        """Row ``rows[j]`` of the bitmask: what ``states[j]`` allows next, once it has accepted its pending tokens
        (a state that refused one gets the stop tokens: its row is not used)."""
        if self.bitmask is None and states:
            self.vocab_size = states[0].grammar.vocab_size
            self.bitmask = self._xgr.allocate_token_bitmask(self._rows, self.vocab_size)
            if self._pinned:
                self.bitmask = self.bitmask.pin_memory()
        assert self.bitmask is not None
        open_states, open_rows = [], []
        for state, row in zip(states, rows, strict=True):
            state.catch_up()
            if state.finished or state.refused is not None:
                self.bitmask[row].copy_(state.grammar.stop_mask)
            else:
                open_states.append(state.matcher)
                open_rows.append(row)
        if open_states:
            self._batch.batch_fill_next_token_bitmask(open_states, self.bitmask, open_rows)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Set to -inf, in place, what their grammars forbid in the logits of ``rows`` (filled by ``fill``).

        One copy and one kernel: the filled words go into a mask as wide as the model's vocabulary, whose words past
        the tokenizer's stay zero (a padding id is never allowed). A copy from pageable memory and the padding ids
        masked apart cost the engine's thread two waits for the GPU per step."""
        import torch

        from common.device import to_device

        assert self.bitmask is not None
        n = logits.shape[0]
        if self._on_device is None:
            words = -(-logits.shape[1] // 32)
            self._on_device = torch.zeros(self._rows, words, dtype=torch.int32, device=logits.device)
        self._on_device[:n, : self.bitmask.shape[1]].copy_(self.bitmask[:n], non_blocking=True)
        indices = to_device(rows, logits.device)  # from a list, xgrammar would copy them from pageable memory
        self._xgr.apply_token_bitmask_inplace(logits, self._on_device[:n], vocab_size=logits.shape[1], indices=indices)


def _first_line(exc: Exception) -> str:
    """The library's message without its time stamp and source location ("[19:13:39] /project/x.cc:94: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return text.splitlines()[0][:300] if text else type(exc).__name__
