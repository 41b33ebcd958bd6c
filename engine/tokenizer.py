"""Tokenizer and chat template for the engine, read from a checkpoint without importing transformers.

The `tokenizers` package loads tokenizer.json and jinja2 renders the chat template the way
transformers does, so prompts match token for token while start-up stays well under a second.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Special tokens transformers hands to every chat template (from its special_tokens_map).
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _byte_of_char() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class ChatTemplateError(ValueError):
    """The chat template is missing or refused the messages (a raise_exception in the template)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters, which changes what the model sees; transformers overrides it too.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses, with its globals and filters."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as a serialized AddedToken.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTokenizer:
    """Encode, decode and apply the chat template of one checkpoint directory."""

    _loaded: ClassVar[dict[tuple[Path, int], ChatTokenizer]] = {}  # ``load``'s, by directory and tokenizer.json's mtime

    @classmethod
    def load(cls, path: Path | str) -> ChatTokenizer:
        """The checkpoint's tokenizer, loaded once per process: the fork server loads the one a worker will use
        before it forks (engine/fork_server.py), and the worker finds it loaded (0.36 s of its start-up on two
        cores for the demo's; more for a 128k vocabulary)."""
        path = Path(path).resolve()
        try:
            key = (path, (path / "tokenizer.json").stat().st_mtime_ns)
        except OSError:
            return cls(path)  # its own error message
        tokenizer = cls._loaded.get(key)
        if tokenizer is None:
            tokenizer = cls._loaded[key] = cls(path)
        return tokenizer

    def __init__(self, path: Path | str) -> None:
        path = Path(path)
        self.path = path
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (the engine reads the tokenizer from the checkpoint)")
        self._tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        self.special_tokens: dict[str, str] = {}
        for name in _TEMPLATE_TOKENS:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens[name] = content
        self.eos_token_ids = self._find_eos_ids(_read_json(path / "generation_config.json"))
        self._token_bytes: dict[int, bytes] = {}

        # transformers prefers a chat_template.jinja file over the copy in tokenizer_config.json.
        template_file = path / "chat_template.jinja"
        source = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        self.chat_template: str | None = source if isinstance(source, str) else None
        self._template = compile_chat_template(source) if isinstance(source, str) else None

    def _find_eos_ids(self, generation_config: dict[str, Any]) -> list[int]:
        ids: list[int] = []
        configured = generation_config.get("eos_token_id")
        if isinstance(configured, int):
            ids.append(configured)
        elif isinstance(configured, list):
            ids.extend(i for i in configured if isinstance(i, int))
        eos = self.special_tokens.get("eos_token")
        eos_id = self._tokenizer.token_to_id(eos) if eos is not None else None
        if eos_id is not None and eos_id not in ids:
            ids.append(eos_id)
        return ids

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (its vocabulary string's length bounds it)."""
        return max((len(token) for token in self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of a plain prompt; special tokens only where the tokenizer's post-processor adds them."""
        return self._ids(text, add_special_tokens=True)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # The batch path without offsets: the same ids as Tokenizer.encode, which also works out every token's
        # character offsets while holding the GIL; this one releases the GIL (two threads encode at once) and takes
        # ~0.7 of the time: SmolLM2's tokenizer on a 1,757-token chat, 1.70 ms against 2.36 on this CI machine.
        return self._tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text the chat template makes of the messages."""
        if self._template is None:
            raise ChatTemplateError(f"the model at {self.path} has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"chat template error: {exc}") from exc

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat."""
        return self.encode_rendered(self.render_chat(messages, add_generation_prompt))

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat: the template writes its own special tokens, so none are added."""
        return self._ids(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of the token ids."""
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a token may hold part of a UTF-8 character), as logprobs report it."""
        cached = self._token_bytes.get(token_id)
        if cached is None:
            cached = self._token_bytes[token_id] = self._bytes_of(token_id)
        return cached

    def token_text(self, token_id: int) -> str:
        """One token's text (a partial UTF-8 character shows as U+FFFD), as logprobs name it."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:  # an id of the model's padded vocabulary that no token has
            return b""
        if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        if (byte := _BYTE_FALLBACK.fullmatch(piece)) is not None:  # sentencepiece's <0xNN>
            return bytes([int(byte.group(1), 16)])
        return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def grammar_vocabulary(self, size: int) -> tuple[list[str] | list[bytes], Literal["byte_level", "byte_fallback",
                                                                                       "raw"]]:  # fmt: skip
        """Every id below ``size`` as a grammar library reads it, and how it is encoded: the tokenizer's own strings
        for byte-level and byte-fallback vocabularies (the library decodes them: one C call here, 0.07 s for 49k
        tokens, where decoding them in Python took 0.9 s of GIL from the engine's thread), else each token's bytes.
        Special tokens (and ids no token has) are empty: a grammar never allows them inside an answer. Ids past
        the tokenizer's own (a model's vocabulary padded to a round size: 128,256 for 49,152 tokens in the
        synthetic checkpoints) are left out (engine/grammar.py's TokenMasks)."""
        special = self.special_token_ids
        size = min(size, self._tokenizer.get_vocab_size(with_added_tokens=True))
        if self._byte_level or self._byte_fallback:
            strings = [""] * size
            for piece, i in self._tokenizer.get_vocab(with_added_tokens=True).items():
                if i < size and i not in special:
                    strings[i] = piece
            return strings, "byte_level" if self._byte_level else "byte_fallback"
        return [b"" if i in special else self.token_bytes(i) for i in range(size)], "raw"

    @functools.cached_property
    def _byte_fallback(self) -> bool:
        return "ByteFallback" in json.dumps(json.loads(self._tokenizer.to_str()).get("decoder"))

    @functools.cached_property
    def special_token_ids(self) -> set[int]:
        """Ids of the special (control) tokens: they have no text of an answer."""
        return {i for i, token in self._tokenizer.get_added_tokens_decoder().items() if token.special}

    @functools.cached_property
    def _byte_level(self) -> bool:
        return type(self._tokenizer.decoder).__name__ == "ByteLevel"

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        """A decoder that turns a stream of token ids into text deltas."""
        return IncrementalDecoder(self._tokenizer, skip_special_tokens)


class IncrementalDecoder:
    """Feed token ids one at a time and get the new text; text ending in a partial UTF-8 character waits.

    tokenizers' DecodeStream does it in one call per token: it decodes a short window (the tokens since the
    previous emit plus a few before), which keeps spaces and multi-byte characters that span tokens right, at
    constant cost per token (0.5-0.8 µs a token here, where two window decodes from Python took 1.3-1.7). The
    window's offsets are kept here too, for ``flush``, which DecodeStream does not have.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # end of what has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """The text this token completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        text = self._stream.step(self._tokenizer, token_id)
        if text:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return text
        return ""

    def flush(self) -> str:
        """Whatever is still held back (the stream ended, complete or not)."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(prefix) :]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def model_eos_ids(config: dict[str, Any], model_dir: Path) -> list[int]:
    """eos ids from config.json and generation_config.json (either may hold an int or a list)."""
    ids: list[int] = []
    sources = [config]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        value = src.get("eos_token_id")
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and token not in ids:
                ids.append(token)
    if not ids:
        raise ValueError(f"{model_dir}: no eos_token_id in config.json or generation_config.json")
    return ids
