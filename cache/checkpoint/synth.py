"""`warmgate model synth`: random-weight checkpoints of real model shapes, for speed and memory only.

Weights are generated and quantized one layer at a time and streamed into shards, so
memory stays bounded by a shard even for a 70B shape. Never use these for quality claims.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from cache.checkpoint.architecture import ModelLayout
from cache.checkpoint.fp8 import quantize_weight
from cache.checkpoint.quant_config import write_config as quantization_config
from cache.checkpoint.quantize import IGNORED_LAYERS
from cache.checkpoint.schemes import WRITE_SCHEMES
from cache.checkpoint.writer import DEFAULT_SHARD_BYTES, ShardWriter, copy_tokenizer, staged_output, write_config

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "rms_norm_eps": 1e-5}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {**_LLAMA, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "tie_word_embeddings": True, "rope_theta": 100000.0, "max_position_embeddings": 8192},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
                   "attention_bias": False, "rms_norm_eps": 1e-6, "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
                   "rope_theta": 1000000.0, "max_position_embeddings": 40960},
    "llama3-8b": {**_LLAMA, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                  "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 8192},
    "llama3-70b": {**_LLAMA, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                   "tie_word_embeddings": False, "rope_theta": 500000.0, "max_position_embeddings": 8192},
}  # fmt: skip
INIT_STD = 0.02


def synth_checkpoint(
    out: str | Path,
    shape: str | dict[str, Any],
    scheme: str,
    *,
    num_layers: int | None = None,
    device: str = "cpu",
    tokenizer: Path | None = None,
    seed: int = 0,
    force: bool = False,
    progress: bool = True,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write a random checkpoint of a known shape (a SHAPES name or a config dict) in one of the write schemes."""
    if isinstance(shape, str) and shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if scheme not in WRITE_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(WRITE_SCHEMES)}")
    if tokenizer is not None and not (Path(tokenizer) / "tokenizer.json").is_file():
        # checked before the weights are made: a checkpoint without one is refused by `serve` only after it starts
        raise FileNotFoundError(f"{tokenizer}: no tokenizer.json to copy (--tokenizer takes a folder that holds one)")
    target = WRITE_SCHEMES[scheme]
    base = SHAPES[shape] if isinstance(shape, str) else shape
    config = {**base, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
              "warmgate_synthetic": True}  # fmt: skip
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    if target.quantized:
        config["quantization_config"] = quantization_config(target, IGNORED_LAYERS)
    layout = ModelLayout.from_config(config)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device, dtype=torch.float32) * INIT_STD).to(torch.bfloat16)

    out = Path(out)
    with staged_output(out, force=force) as tmp:
        writer = ShardWriter(tmp, shard_bytes)
        names = [n for n in layout.others if n not in layout.optional] + [f"{m}.weight" for m in layout.linears]
        # Layer order keeps each shard's tensors together, as a real export would.
        names.sort(key=_layer_order)
        for name in tqdm(names, desc=f"synth {config['model_type']} {scheme}", unit="tensor", disable=not progress):
            module = name.rpartition(".")[0]
            if module in layout.linears and name.endswith(".weight"):
                w = randn(*layout.linears[module])
                if target.quantized and module not in IGNORED_LAYERS:
                    q, s = quantize_weight(w, target.weight)
                    writer.add(name, q)
                    writer.add(f"{module}.weight_scale", s)
                else:
                    writer.add(name, w)
            elif name.endswith("norm.weight"):
                writer.add(name, torch.ones(layout.others[name], dtype=torch.bfloat16))
            elif name.endswith(".bias"):
                writer.add(name, torch.zeros(layout.others[name], dtype=torch.bfloat16))
            else:
                writer.add(name, randn(*layout.others[name]))
        writer.close()
        write_config(tmp, config)
        if tokenizer is not None:
            copy_tokenizer(Path(tokenizer), tmp)
            cover_vocabulary(tmp, config["vocab_size"])
    return out


def cover_vocabulary(out: Path, vocab_size: int) -> int:
    """Give the copied tokenizer a word (" tok49152", ...) for each id of the model's vocabulary it lacks, as a real
    checkpoint's tokenizer covers its model's. A random model samples any id, and an id its tokenizer does not know
    decodes to no text: a synthetic llama3-8b with the demo's 49,152-token tokenizer could stream text for 38% of
    its ids only, and a client's first text came 1.6 decode steps after its first token on average (a geometric
    wait). The words join the BPE vocabulary, which no merge reaches, so encoding is unchanged. Returns how many
    were added (none for a tokenizer that is not BPE or already covers the vocabulary).
    """
    path = out / "tokenizer.json"
    if not path.is_file():
        return 0
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return 0
    known = max([*vocab.values(), *(t["id"] for t in spec.get("added_tokens", []))]) + 1
    if known >= vocab_size:
        return 0
    decoder = str((spec.get("decoder") or {}).get("type"))
    space = {"ByteLevel": "\u0120", "Metaspace": "\u2581"}.get(decoder, "")  # how its words begin with a space
    for i in range(known, vocab_size):
        word = f"{space}tok{i}"
        if word in vocab:
            raise ValueError(f"{path}: cannot cover id {i}: {word!r} is in its vocabulary already")
        vocab[word] = i
    path.write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    return vocab_size - known


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    if len(parts) > 2 and parts[1] == "layers":
        return int(parts[2]) + 1, name
    return (0 if "embed" in name else 1_000_000), name
