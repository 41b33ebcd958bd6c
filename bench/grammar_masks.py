"""Per-step token-mask cost of the two grammar libraries for structured outputs (xgrammar, llguidance), at a batch.

Each of ``--batch`` requests follows a JSON schema through ``--steps`` tokens: every step fills the batch's
bitmask (the cost on the critical path of a decode step) and each request takes a random allowed token. Reports
the schema's compile time and the mask time per step (median, p90) for each library, on the demo's tokenizer
(SmolLM2, 49,152 tokens) unless ``--model`` names another checkpoint.

    python bench/grammar_masks.py [--batch 64] [--steps 48] [--model DIR] [--out bench/results/grammar_masks.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# No "format": "email": inside an email's quoted local part (a random-weight model writes '"\"' and goes on),
# xgrammar took ~20 ms to fill one row's mask on this machine, where other rows take 3-30 us.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9._]{1,30}@[a-z0-9.]{1,30}$"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "address", "active"],
    "additionalProperties": False,
}  # fmt: skip


def _allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    bits = ((mask_row.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def _follow(matchers: list[Any], mask: torch.Tensor, vocab: int, steps: int, fill: Callable[[Any, int], Any],
            done: Callable[[Any], bool], take: Callable[[Any, int], Any]) -> list[float]:  # fmt: skip
    """``steps`` steps of the batch: fill every row's mask (timed, ms), then each unfinished matcher takes a random
    allowed token."""
    times = []
    rng = random.Random(0)
    for _ in range(steps):
        t = time.perf_counter()
        for i, m in enumerate(matchers):
            fill(m, i)
        times.append(1e3 * (time.perf_counter() - t))
        for i, m in enumerate(matchers):
            if not done(m):
                take(m, rng.choice(_allowed(mask[i], vocab)))
    return times


def run_llguidance(tokenizer_json: str, eos: int, vocab: int, batch: int, steps: int) -> dict[str, Any]:
    import llguidance
    import llguidance.torch as lt

    t = time.perf_counter()
    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    tokenizer_s = time.perf_counter() - t
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    t = time.perf_counter()
    matchers = [llguidance.LLMatcher(tok, grammar) for _ in range(batch)]
    compile_s = time.perf_counter() - t
    mask = lt.allocate_token_bitmask(batch, vocab)
    times = _follow(matchers, mask, vocab, steps, lambda m, i: lt.fill_next_token_bitmask(m, mask, i),
                    lambda m: m.is_stopped(), lambda m, token: m.consume_token(token))  # fmt: skip
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_ms": times}


def run_xgrammar(vocab_strings: list[str], special: set[int], eos: int, vocab: int, batch: int,
                 steps: int) -> dict[str, Any]:  # fmt: skip
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.grammar import load_xgrammar  # as the engine imports it

    xgr = load_xgrammar()
    t = time.perf_counter()
    encoded = ["" if i in special else s for i, s in enumerate(vocab_strings)]
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    tokenizer_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    mask = xgr.allocate_token_bitmask(batch, vocab)
    times = _follow(matchers, mask, vocab, steps, lambda m, i: m.fill_next_token_bitmask(mask, i),
                    lambda m: m.is_terminated(), lambda m, token: m.accept_token(token))  # fmt: skip
    return {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_ms": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from cache.checkpoint.demo import build_demo

        model = build_demo("bf16", progress=False)
    from tokenizers import Tokenizer

    tokenizer_json = (model / "tokenizer.json").read_text()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
    from engine.tokenizer import ChatTokenizer

    eos = ChatTokenizer(model).eos_token_ids[0]
    strings = [tokenizer.id_to_token(i) or "" for i in range(vocab)]
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    results = {
        "llguidance": run_llguidance(tokenizer_json, eos, vocab, args.batch, args.steps),
        "xgrammar": run_xgrammar(strings, special, eos, vocab, args.batch, args.steps),
    }
    rows = {}
    for name, r in results.items():
        times = sorted(r["mask_ms"][1:])  # the first step pays one-off costs
        rows[name] = {"tokenizer_s": round(r["tokenizer_s"], 3), "compile_s": round(r["compile_s"], 4),
                      "mask_ms_p50": round(statistics.median(times), 3),
                      "mask_ms_p90": round(times[int(0.9 * (len(times) - 1))], 3),
                      "first_step_ms": round(r["mask_ms"][0], 3)}  # fmt: skip
    report = {"batch": args.batch, "steps": args.steps, "vocab": vocab, "torch_threads": torch.get_num_threads(),
              "results": rows}  # fmt: skip
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
