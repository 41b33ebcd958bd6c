"""How far a random-weight llama3-8b-shaped model (2 layers) moves its logits under rounding, against a real bug.

    .venv/bin/python bench/synth_logit_sensitivity.py --out bench/results   # CPU, ~3 min

Sets the tolerance of the GPU prompt-length test (tests/test_gpu.py): the same plain-torch reference
(dequantized FP8 weights, activations rounded to e4m3 per token and group of 128 as the W8A8 kernels
do) computed in bf16 instead of fp32, and computed with attention that sees only its own 64-token
chunk (what a chunked-prefill bug would do). Relative L2 distance of the logits at several positions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cache.checkpoint.reader import read_checkpoint
from cache.checkpoint.synth import synth_checkpoint
from engine.native.kernels import quantize_per_token_group
from engine.native.model import ModelArgs, apply_rope, rms_norm, rope_inv_freq

POSITIONS = (10, 63, 64, 100, 150, 199)


def logits(path: Path, tokens: list[int], dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    ckpt = read_checkpoint(path)
    w = {k: v.to(dtype) for k, v in ckpt.dequantized_state_dict(torch.float32).items()}
    args = ModelArgs.from_config(ckpt.config)
    s, eps = args.shape, args.rms_norm_eps

    def linear(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_per_token_group(h.float())
        return (xq.float().view(h.shape[0], -1, 128) * xs.unsqueeze(-1)).view_as(h).to(dtype) @ weight.t()

    n = len(tokens)
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), rope_inv_freq(args))
    cos, sin = freqs.cos(), freqs.sin()
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window is not None:
        mask &= (pos[None, :] // window) == (pos[:, None] // window)
    x = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    for i in range(s.layers):
        p = f"model.layers.{i}"
        h = rms_norm(x, w[f"{p}.input_layernorm.weight"], eps)
        q = apply_rope(linear(h, w[f"{p}.self_attn.q_proj.weight"]).view(n, s.heads, s.head_dim), cos, sin)
        k = apply_rope(linear(h, w[f"{p}.self_attn.k_proj.weight"]).view(n, s.kv_heads, s.head_dim), cos, sin)
        v = linear(h, w[f"{p}.self_attn.v_proj.weight"]).view(n, s.kv_heads, s.head_dim)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=mask, enable_gqa=True)  # fmt: skip
        attn = attn.transpose(0, 1).reshape(n, -1)
        x = x + linear(attn, w[f"{p}.self_attn.o_proj.weight"])
        h = rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], eps)
        gate, up = linear(h, w[f"{p}.mlp.gate_proj.weight"]), linear(h, w[f"{p}.mlp.up_proj.weight"])
        x = x + linear(F.silu(gate) * up, w[f"{p}.mlp.down_proj.weight"])
    return (rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].t()).float()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = synth_checkpoint(Path(tmp) / "l2", "llama3-8b", "fp8-block", num_layers=2, progress=False)
        tokens = torch.randint(0, 128000, (200,), generator=torch.Generator().manual_seed(0)).tolist()
        reference = logits(path, tokens, torch.float32)
        variants = {"bf16": logits(path, tokens, torch.bfloat16),
                    "attention within 64-token chunks": logits(path, tokens, torch.float32, window=64)}  # fmt: skip
    result = {name: {p: float((v[p] - reference[p]).norm() / reference[p].norm()) for p in POSITIONS}
              for name, v in variants.items()}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "synth_logit_sensitivity.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
