"""The engine's tokenizer: transformers' chat template token for token, streaming detokenization, no transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PROMPT

from engine.tokenizer import ChatTemplateError, ChatTokenizer

IM_END = 2
CONVERSATIONS = [
    [{"role": "user", "content": PROMPT}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": PROMPT}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a French pastry."},
        {"role": "assistant", "content": "A croissant, or a pain au chocolat."},
        {"role": "user", "content": "Et au Japon ? 日本のお菓子は？"},
    ],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
]


@pytest.fixture(scope="module")
def paths(demo_path) -> Path:
    return demo_path("bf16")


@pytest.fixture(scope="module")
def tokenizer(paths: Path) -> ChatTokenizer:
    return ChatTokenizer(paths)


@pytest.fixture(scope="module")
def hf_tokenizer(paths: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(paths)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system+user", "multi-turn", "ends-assistant"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_ids_match_transformers(tokenizer, hf_tokenizer, messages, add_generation_prompt) -> None:
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True
    )["input_ids"]
    assert tokenizer.apply_chat_template(messages, add_generation_prompt) == expected
    assert tokenizer.render_chat(messages, add_generation_prompt) == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


@pytest.mark.parametrize("text", ["The capital of France is", "  two spaces, café – 日本 🎉", "<|im_start|>user"])
def test_encode_and_decode_match_transformers(tokenizer, hf_tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)


def test_eos_ids_and_special_tokens(tokenizer) -> None:
    assert tokenizer.eos_token_ids == [IM_END]
    assert tokenizer.special_tokens["eos_token"] == "<|im_end|>"
    assert tokenizer.decode([*tokenizer.encode("Paris."), IM_END]) == "Paris."


def test_incremental_decoding_concatenates_to_the_full_decode(tokenizer) -> None:
    text = "Le café – 日本の寿司 🍣 est naïve, n'est-ce pas?"
    ids = [*tokenizer.encode(text), IM_END]
    decoder = tokenizer.incremental_decoder()
    deltas = [decoder.add(token) for token in ids]
    assert "".join(deltas) + decoder.flush() == tokenizer.decode(ids) == text
    # Byte-level BPE splits the CJK and emoji characters across tokens: those steps wait for the whole character.
    assert "" in deltas[:-1], "expected at least one token that completes no character"
    assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_flush_returns_a_trailing_partial_character(tokenizer) -> None:
    ids = tokenizer.encode("🍣")  # three tokens for four bytes: without the last one the character is incomplete
    decoder = tokenizer.incremental_decoder()
    first = [decoder.add(token) for token in ids[:-1]]
    held = decoder.flush()
    assert "".join(first) + held == tokenizer.decode(ids[:-1])
    assert held.endswith("\ufffd"), "the stream ended mid-character: what is left is shown, not lost"


def test_template_raise_exception_and_tojson(tmp_path: Path, paths: Path) -> None:
    shutil.copy(paths / "tokenizer.json", tmp_path / "tokenizer.json")
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('the first message must be from the user') }}"
        "{% endif %}{{ messages | tojson }}{% if add_generation_prompt %}{{ eos_token }}{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": template}))
    tok = ChatTokenizer(tmp_path)
    messages = [{"role": "user", "content": "<b>café</b> & co"}]
    # transformers' tojson keeps HTML characters and non-ASCII as they are (jinja's would escape them).
    assert tok.render_chat(messages) == json.dumps(messages, ensure_ascii=False) + "<|im_end|>"
    assert tok.eos_token_ids == [IM_END], "without generation_config.json the eos token comes from the config"
    with pytest.raises(ChatTemplateError, match="first message must be from the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_chat_template_jinja_file_wins_and_no_template_is_a_clear_error(tmp_path: Path, paths: Path) -> None:
    shutil.copy(paths / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from the config"}))
    (tmp_path / "chat_template.jinja").write_text("from the file")
    assert ChatTokenizer(tmp_path).render_chat([]) == "from the file"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_loading_imports_neither_transformers_nor_torch(paths: Path) -> None:
    code = (
        "import sys; from engine.tokenizer import ChatTokenizer; "
        f"t = ChatTokenizer({str(paths)!r}); t.apply_chat_template([{{'role': 'user', 'content': 'hi'}}]); "
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
