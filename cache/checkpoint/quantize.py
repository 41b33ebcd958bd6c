"""`warmgate model quantize`: an unquantized checkpoint -> a compressed-tensors FP8 W8A8 checkpoint."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from cache.checkpoint.fp8 import quantize_weight
from cache.checkpoint.quant_config import write_config as quantization_config
from cache.checkpoint.reader import read_checkpoint
from cache.checkpoint.schemes import WRITE_SCHEMES
from cache.checkpoint.writer import ShardWriter, copy_tokenizer, staged_output, write_config
from cache.errors import CheckpointError

# Embeddings and lm_head stay unquantized: they dominate quality loss and are not GEMM-bound.
IGNORED_LAYERS = ["lm_head"]


def quantize_checkpoint(src: str | Path, out: str | Path, scheme: str, *, force: bool = False,
                        progress: bool = True) -> Path:  # fmt: skip
    """Quantize every Linear layer of ``src`` (except lm_head) to ``scheme`` and write to ``out``."""
    if scheme not in WRITE_SCHEMES or not WRITE_SCHEMES[scheme].quantized:
        raise ValueError(f"unknown FP8 scheme {scheme!r}; choose one of fp8-block, fp8-channel, fp8-tensor")
    target = WRITE_SCHEMES[scheme]
    ckpt = read_checkpoint(src)
    already = sorted({s.describe() for s in ckpt.schemes.values() if s.quantized})
    if already:
        raise CheckpointError(
            f"source is already quantized ({', '.join(already)}); quantize an unquantized checkpoint",
            path=str(src), field="quantization_config", value=already, supported="bf16/fp16/fp32 weights",
        )  # fmt: skip
    out = Path(out)
    with staged_output(out, force=force) as tmp:
        writer = ShardWriter(tmp)
        for name in tqdm(list(ckpt.tensors), desc=f"quantize {scheme}", unit="tensor", disable=not progress):
            module, _, leaf = name.rpartition(".")
            if ckpt.layout.ignored(name):
                continue
            if leaf == "weight" and module in ckpt.layout.linears and module not in IGNORED_LAYERS:
                q, s = quantize_weight(ckpt.tensor(name), target.weight)
                writer.add(name, q)
                writer.add(f"{module}.weight_scale", s)
            else:
                writer.add(name, ckpt.tensor(name))
        writer.close()
        config = dict(ckpt.config)
        config["quantization_config"] = quantization_config(target, IGNORED_LAYERS)
        write_config(tmp, config)
        copy_tokenizer(ckpt.path, tmp)
    return out
