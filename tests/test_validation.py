"""Checkpoints warmgate cannot serve are refused with one line naming the layer and the field."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from cache.checkpoint.reader import read_checkpoint
from cache.checkpoint.schemes import Activations, WeightKind
from cache.checkpoint.synth import synth_checkpoint
from cache.errors import (
    CheckpointError,
    CorruptCheckpoint,
    InvalidTensor,
    MissingTensor,
    UnexpectedTensor,
    UnsupportedArchitecture,
    UnsupportedQuantization,
)

# A small Llama: 320 = 2.5 x 128 gives partial blocks; untied, so lm_head is a (skipped) Linear.
TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "max_position_embeddings": 512,
}  # fmt: skip
Q = "model.layers.0.self_attn.q_proj"
GATE = "model.layers.1.mlp.gate_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Callable[[str], Path]:
    root = tmp_path_factory.mktemp("tiny")
    made: dict[str, Path] = {}

    def get(scheme: str) -> Path:
        if scheme not in made:
            made[scheme] = synth_checkpoint(root / scheme, TINY, scheme, progress=False)
        return made[scheme]

    return get


def test_tiny_checkpoints_are_accepted(tiny) -> None:
    for scheme in ("bf16", "fp8-block", "fp8-channel", "fp8-tensor"):
        ckpt = read_checkpoint(tiny(scheme))
        assert ckpt.schemes["lm_head"].weight is WeightKind.UNQUANTIZED
        assert ckpt.schemes[GATE].weight.value == ("unquantized" if scheme == "bf16" else scheme)
    assert read_checkpoint(tiny("fp8-block")).tensors[f"{GATE}.weight_scale"].shape == (3, 2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights_args(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        config["quantization_config"]["config_groups"]["group_0"]["weights"].update(fields)

    return edit


def _edit_input_args(value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(config: dict[str, Any]) -> None:
        group = config["quantization_config"]["config_groups"]["group_0"]
        group["input_activations"] = value if value is None else {**group["input_activations"], **value}

    return edit


def _edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file))


@dataclass
class Fault:
    name: str
    base: str  # scheme of the tiny checkpoint to break
    config: Callable[[dict[str, Any]], None] | None = None
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None
    raw: Callable[[Path], None] | None = None
    error: type[CheckpointError] = UnsupportedQuantization
    layer: str = Q
    field: str = ""


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["quantization_config"].__setitem__(key, value)


def _truncate(path: Path) -> None:
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 1000])


def _garbage_header(path: Path) -> None:
    file = path / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:40] = b"\x00not json at all{{{{{{{{{{{{{{{{"
    file.write_bytes(bytes(data))


FAULTS = [
    Fault("block 64x64", "fp8-block", _edit_weights_args(block_structure=[64, 64]),
          field="weights.block_structure=[64, 64]"),
    Fault("block 128x64", "fp8-block", _edit_weights_args(block_structure=[128, 64]),
          field="weights.block_structure=[128, 64]"),
    Fault("int8 weights", "fp8-channel", _edit_weights_args(type="int"), field="weights.type='int'"),
    Fault("int4 packed", "fp8-channel", lambda c: (
        _edit_weights_args(num_bits=4, type="int", strategy="group", group_size=128)(c),
        _set("format", "pack-quantized")(c)), field="weights.num_bits=4"),
    Fault("nvfp4", "fp8-tensor", lambda c: (
        _edit_weights_args(num_bits=4, strategy="tensor_group", group_size=16)(c),
        _set("format", "nvfp4-pack-quantized")(c)), field="weights.num_bits=4"),
    Fault("mxfp4 method", "fp8-tensor", _set("quant_method", "mxfp4"), layer="quantization_config",
          field="quant_method='mxfp4'"),
    Fault("static per-token activations", "fp8-channel", _edit_input_args({"dynamic": False}),
          field="input_activations.strategy='static per-token'"),
    Fault("asymmetric weights", "fp8-tensor", _edit_weights_args(symmetric=False), field="weights.symmetric=False"),
    Fault("unknown format", "fp8-block", _set("format", "marlin-24"), field="format='marlin-24'"),
    Fault("weight-only fp8", "fp8-channel", _edit_input_args(None), field="input_activations=None"),
    Fault("fp8 kv cache", "fp8-block", _set("kv_cache_scheme", {"num_bits": 8, "type": "float"}),
          layer="quantization_config", field="kv_cache_scheme"),
    Fault("block activations not 128", "fp8-block", _edit_input_args({"group_size": 64}),
          field="input_activations.group_size=64"),
    Fault("truncated safetensors", "fp8-block", raw=_truncate, error=CorruptCheckpoint, layer="model.safetensors",
          field="truncated"),
    Fault("corrupt header", "fp8-block", raw=_garbage_header, error=CorruptCheckpoint, layer="model.safetensors",
          field="malformed safetensors header"),
    Fault("missing scale", "fp8-block", tensors=lambda t: t.pop(f"{GATE}.weight_scale"), error=MissingTensor,
          layer=GATE, field="'weight_scale'"),
    Fault("zero point present", "fp8-channel", tensors=lambda t: t.__setitem__(
        f"{Q}.weight_zero_point", torch.zeros(256, 1, dtype=torch.int8)), error=UnexpectedTensor,
        field="'weight_zero_point'"),
    Fault("scale shape of 64x64 blocks", "fp8-block", tensors=lambda t: t.__setitem__(
        f"{GATE}.weight_scale", torch.ones(5, 4)), error=InvalidTensor, layer=GATE, field="weight_scale.shape=[5, 4]"),
    Fault("fp8 layer stored in bf16", "fp8-tensor", tensors=lambda t: t.__setitem__(
        f"{Q}.weight", t[f"{Q}.weight"].to(torch.bfloat16)), error=InvalidTensor, field="weight.dtype=BF16"),
    Fault("zero scale", "fp8-channel", tensors=lambda t: t[f"{GATE}.weight_scale"].__setitem__(7, 0.0),
          error=InvalidTensor, layer=GATE, field="weight_scale has 1 non-finite or non-positive"),
    Fault("nan scale", "fp8-block", tensors=lambda t: t[f"{Q}.weight_scale"].__setitem__((0, 0), float("nan")),
          error=InvalidTensor, field="weight_scale has 1 non-finite"),
    Fault("unsupported architecture", "bf16", lambda c: c.__setitem__("model_type", "gpt2"),
          error=UnsupportedArchitecture, layer="config.json", field="model_type='gpt2'"),
    Fault("wrong hidden size", "bf16", lambda c: c.__setitem__("hidden_size", 512), error=InvalidTensor,
          layer="model.embed_tokens", field="weight.shape=[512, 256]"),
]  # fmt: skip


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_bad_checkpoint_is_refused_with_layer_and_field(tiny, tmp_path: Path, fault: Fault) -> None:
    path = _copy(tiny(fault.base), tmp_path / "bad")
    if fault.config:
        _edit_config(path, fault.config)
    if fault.tensors:
        _edit_tensors(path, fault.tensors)
    if fault.raw:
        fault.raw(path)
    with pytest.raises(fault.error) as caught:
        read_checkpoint(path)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(fault.layer) or fault.layer in message, message
    assert fault.field in message, message


def test_static_per_tensor_activations_need_and_accept_input_scale(tiny, tmp_path: Path) -> None:
    path = _copy(tiny("fp8-tensor"), tmp_path / "static")
    _edit_config(path, _edit_input_args({"strategy": "tensor", "dynamic": False}))
    with pytest.raises(MissingTensor, match="input_scale"):
        read_checkpoint(path)
    linears = [n for n in read_checkpoint(tiny("fp8-tensor")).schemes if n != "lm_head"]
    _edit_tensors(path, lambda t: t.update({f"{n}.input_scale": torch.tensor([0.05]) for n in linears}))
    scheme = read_checkpoint(path).schemes[Q]
    assert scheme.weight is WeightKind.FP8_TENSOR and scheme.activations is Activations.STATIC_TENSOR


def _check_cli(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.cli", "model", "check", str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_check_cli_prints_summary_or_one_line_error(tiny, tmp_path: Path) -> None:
    ok = _check_cli(tiny("fp8-block"))
    assert ok.returncode == 0, ok.stderr
    assert "model.layers.*.mlp.gate_proj" in ok.stdout and "fp8-block 128x128" in ok.stdout
    assert "lm_head" in ok.stdout and "unquantized" in ok.stdout

    bad = _copy(tiny("fp8-block"), tmp_path / "bad")
    _edit_config(bad, _edit_weights_args(block_structure=[64, 64]))
    refused = _check_cli(bad)
    assert refused.returncode == 2 and refused.stdout == ""
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and Q in lines[0] and "weights.block_structure=[64, 64]" in lines[0]
    assert "supported: [[128, 128]]" in lines[0]

    missing = _check_cli(tmp_path / "nowhere")
    assert missing.returncode == 2 and "no config.json" in missing.stderr
