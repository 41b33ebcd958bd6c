"""The device cost of a greedy batch's logprobs (engine/native/sampler.py's _logprobs): torch.topk and
torch.logsumexp over [64, vocab] float32 logits, against a two-stage top-k (the best k of each run of 256 ids,
then the best k of those) and, on CUDA, the fused Triton kernel (engine/native/triton_logprobs.py: log-sum-exp and
top k in one read), which must give the same entries. Microseconds per call, 50 calls after 3 warm-ups.

    python bench/topk_check.py          # on the device machine: PYTHONPATH=/tmp/site:$PWD python3 bench/topk_check.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CHUNK = 256


def two_stage(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = scores.shape
    runs = width // CHUNK
    values, ids = scores.view(rows, runs, CHUNK).topk(k, dim=-1)
    best, where = values.view(rows, runs * k).topk(k, dim=-1)
    return best, (where // k) * CHUNK + ids.view(rows, runs * k).gather(1, where)


def per_call_us(fn: Callable[[], object], cuda: bool) -> float:
    for _ in range(3):
        fn()
    if cuda:
        torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(50):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return round((time.perf_counter() - began) / 50 * 1e6, 1)


def main() -> None:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    for width in (49152, 128256):
        x = torch.randn(64, width, device=device) * 3
        x[5, : width - 3] = -float("inf")  # a row a grammar masked: 3 tokens allowed
        full = x.isfinite().sum(1)
        for k in (1, 5, 20):
            a, b = x.topk(k, dim=-1), two_stage(x, k)
            same = torch.equal(a.values, b[0]) and torch.equal(a.indices[full >= k], b[1][full >= k])
            times = {"topk": per_call_us(lambda k=k: x.topk(k, dim=-1), cuda),
                     "two_stage": per_call_us(lambda k=k: two_stage(x, k), cuda),
                     "logsumexp": per_call_us(lambda: torch.logsumexp(x, -1), cuda)}  # fmt: skip
            if cuda:
                from engine.native.triton_logprobs import top_logprobs

                fused = top_logprobs(x, k, -9999.0)
                same = same and torch.equal(fused[full >= k, k:].long(), a.indices[full >= k])
                times["fused_lse_topk"] = per_call_us(lambda k=k: top_logprobs(x, k, -9999.0), cuda)
            print(f"width {width} k {k}: equal {same}; us per call {times}")


if __name__ == "__main__":
    main()
