"""Next-token choice for a batch: penalties, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, outputs: list[list[int]], params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI semantics: subtract presence once per seen token and frequency per occurrence."""
    rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    for i in rows:
        if not outputs[i]:
            continue
        counts = torch.bincount(torch.tensor(outputs[i], device=logits.device), minlength=logits.shape[1]).float()
        p = params[i]
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    generators: list[torch.Generator | None],
    argmax: list[int] | None = None,
) -> list[int]:
    """One token per row of ``logits`` [B, vocab] (float32).

    ``argmax``: the rows' argmax when already known (the CUDA-graph decode computes it); not
    used when a penalty changes the logits.
    """
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        logits, argmax = apply_penalties(logits, outputs, params), None
    chosen = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k:
            kth = torch.topk(row, min(p.top_k, row.shape[0])).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        chosen[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return chosen
