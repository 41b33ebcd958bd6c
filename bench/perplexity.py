"""Perplexity of the demo model, bf16 vs each FP8 scheme, on a fixed English paragraph (CPU).

Two FP8 variants per scheme: weights-only (our reader's dequantized weights) and W8A8,
where each quantized Linear also rounds its input to FP8 the way the scheme says
(dynamic per token, or per token and group of 128). Compute runs in float32.

    python bench/perplexity.py [--out bench/results/perplexity.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from cache.checkpoint.demo import build_demo
from cache.checkpoint.reader import Checkpoint, read_checkpoint
from cache.checkpoint.schemes import FP8_BLOCK, FP8_MAX, Activations

PARAGRAPH = Path(__file__).parent / "data" / "paragraph.txt"


def fp8_round_activations(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """Quantize-dequantize activations to e4m3 with a dynamic scale per token (or per token-group)."""
    k = x.shape[-1]
    xf = x.float().reshape(-1, k)
    if group:
        pad = -k % group
        xf = torch.nn.functional.pad(xf, (0, pad)).reshape(xf.shape[0], -1, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    out = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
    return out.reshape(out.shape[0], -1)[:, :k].reshape(x.shape).to(x.dtype)


def perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    return float(torch.exp(loss))


def model_from(ckpt: Checkpoint, config) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(ckpt.dequantized_state_dict(torch.float32), strict=False)
    model.tie_weights()
    return model


def add_activation_rounding(model: torch.nn.Module, ckpt: Checkpoint) -> None:
    for name, module in model.named_modules():
        scheme = ckpt.schemes.get(name)
        if scheme is None or not scheme.quantized:
            continue
        group = FP8_BLOCK if scheme.activations is Activations.DYNAMIC_GROUP else None
        module.register_forward_pre_hook(lambda _m, args, g=group: (fp8_round_activations(args[0], g),))


def max_weight_error(ckpt: Checkpoint, source: dict[str, torch.Tensor]) -> float:
    deq = ckpt.dequantized_state_dict(torch.float32)
    worst = 0.0
    for module, scheme in ckpt.schemes.items():
        if scheme.quantized:
            w, d = source[f"{module}.weight"].float(), deq[f"{module}.weight"]
            worst = max(worst, float((d - w).abs().max() / w.abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "perplexity.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16_path = build_demo("bf16", progress=False)
    tokenizer = AutoTokenizer.from_pretrained(bf16_path)
    config = AutoConfig.from_pretrained(bf16_path)
    ids = tokenizer(PARAGRAPH.read_text().strip(), return_tensors="pt").input_ids
    source_ckpt = read_checkpoint(bf16_path)
    source = source_ckpt.dequantized_state_dict(torch.float32)
    rows = [{"scheme": "bf16", "variant": "reference", "ppl": perplexity(model_from(source_ckpt, config), ids)}]
    for scheme in ("fp8-block", "fp8-channel", "fp8-tensor"):
        ckpt = read_checkpoint(build_demo(scheme, progress=False))
        err = max_weight_error(ckpt, source)
        model = model_from(ckpt, config)
        rows.append({"scheme": scheme, "variant": "weights-only", "ppl": perplexity(model, ids), "max_rel_err": err})
        add_activation_rounding(model, ckpt)
        rows.append({"scheme": scheme, "variant": "W8A8", "ppl": perplexity(model, ids), "max_rel_err": err})
    result = {"tokens": int(ids.shape[1]), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['tokens']} tokens")
    print("| scheme | variant | perplexity | Δ nats vs bf16 | max rel. weight error |")
    print("|---|---|---|---|---|")
    base = rows[0]["ppl"]
    for r in rows:
        delta = torch.log(torch.tensor(r["ppl"] / base)).item()
        err = f"{r['max_rel_err']:.4f}" if "max_rel_err" in r else "–"
        print(f"| {r['scheme']} | {r['variant']} | {r['ppl']:.2f} | {delta:+.3f} | {err} |")


if __name__ == "__main__":
    main()
