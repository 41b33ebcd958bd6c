"""Next-token choice for a batch: penalties, temperature, top-k, top-p, per-request seeds; and the logprobs of
the distribution each token was drawn from, for the requests that ask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request_stream import TokenLogprobs
from engine.sampling_params import LOGPROB_FLOOR, SamplingParams


@dataclass(frozen=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: None where the request did not ask


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
    logprobs: list[TokenLogprobs | None] | None = None,
) -> Sampled:
    """One token per row of ``logits`` [B, vocab] (float32).

    ``argmax``: the rows' argmax when already known (the CUDA-graph step computes it); not used when a
    penalty changes the logits. ``logprobs``: the rows' logprobs when already known (``QueuedLogprobs``).
    Sampled rows are drawn together, with one copy back to the host: the
    exponential-race form of sampling (argmax of p / E, E ~ Exp(1), picks i with probability p_i) lets
    each seeded row draw its own noise from its own generator, with no per-row synchronization.
    """
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        logits, argmax = apply_penalties(logits, outputs, params), None
    chosen = argmax if argmax is not None else logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return Sampled(chosen, logprobs if logprobs is not None else _logprobs(logits, params, chosen))
    device = logits.device
    picked = [params[i] for i in rows]
    x = logits[rows] / torch.tensor([p.temperature for p in picked], device=device).unsqueeze(1)
    vocab = x.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in picked]
    if min(ks) < vocab:
        top = torch.topk(x, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor(ks, device=device).unsqueeze(1) - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in picked):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        top_p = torch.tensor([p.top_p for p in picked], device=device).unsqueeze(1)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
    noise = torch.empty_like(probs)
    seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
    if len(seeded) < len(rows):
        noise.exponential_()
    for j in seeded:
        noise[j].exponential_(generator=generators[rows[j]])
    for i, token in zip(rows, (probs / noise).argmax(dim=-1).tolist(), strict=True):
        chosen[i] = token
    if logprobs is not None:
        return Sampled(chosen, logprobs)
    return Sampled(chosen, _logprobs(logits, params, chosen, dict(zip(rows, probs, strict=True))))


@dataclass(frozen=True)
class QueuedLogprobs:
    """Logprobs of greedy rows, queued on the device behind the step's logits before the engine waits for the step
    (``queue_logprobs``): read after the wait with one copy, where computing them then cost a handful of device
    calls, each a chance for the HTTP loop to keep the GIL, while the device idled."""

    rows: list[int]  # the logits' rows reported
    tops: list[int]  # alternatives per row
    packed: torch.Tensor  # _pack's rows

    def report(self) -> dict[int, TokenLogprobs]:
        """Each row's logprobs."""
        return dict(zip(self.rows, _unpack(self.packed, self.tops), strict=True))


def queue_logprobs(logits: torch.Tensor, asking: list[tuple[int, SamplingParams]]) -> QueuedLogprobs | None:
    """Queue the logprobs of the rows that ask (row, its params) in ``logits`` (which may not be computed yet),
    when each of them is greedy without penalties (their distribution is the plain softmax of the logits as they
    are); None otherwise, or when none asks: ``sample`` computes them once it has drawn."""
    asking = [(row, p) for row, p in asking if p.logprobs is not None]
    if not asking or any(not p.greedy or p.presence_penalty or p.frequency_penalty for _, p in asking):
        return None
    rows, tops = [row for row, _ in asking], [p.logprobs or 0 for _, p in asking]
    scores = logits if len(rows) == logits.shape[0] else logits[rows]
    # A greedy row's token is its argmax: its logprob is the top entry's.
    return QueuedLogprobs(rows, tops, _pack(scores, torch.logsumexp(scores, dim=-1), max(1, *tops)))


def _logprobs(logits: torch.Tensor, params: list[SamplingParams], chosen: list[int],
              drawn: dict[int, torch.Tensor] | None = None) -> list[TokenLogprobs | None]:  # fmt: skip
    """Each asking row's token logprob and top alternatives: from ``drawn[row]`` (the probabilities a sampled row
    was drawn from, top-k and top-p applied, not yet normalized) or, for a greedy row, the softmax of its logits.
    One copy to the host for the whole batch."""
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    out: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return out
    scores = logits if len(wanted) == len(params) else logits[wanted]
    norm = torch.logsumexp(scores, dim=-1)
    sampled = [(j, drawn[i]) for j, i in enumerate(wanted) if drawn and i in drawn]
    if sampled:  # their distribution is the one they were drawn from: log p, normalized by log sum p
        scores = scores.clone() if scores is logits else scores
        for j, p in sampled:
            scores[j] = p.log()
            norm[j] = p.sum().log()
    reported = _report(scores, norm, [chosen[i] for i in wanted], [params[i].logprobs or 0 for i in wanted])
    for i, entry in zip(wanted, reported, strict=True):
        out[i] = entry
    return out


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Logprobs of ``tokens`` (the prompt's next tokens) in the rows of ``logits`` [n, vocab] (plain softmax), each
    with its ``top`` alternatives."""
    scores = logits.float()
    return _report(scores, torch.logsumexp(scores, dim=-1), tokens, [top] * len(tokens))


def _report(scores: torch.Tensor, norm: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """Row r's logprob of ``tokens[r]`` and its ``tops[r]`` best alternatives, where a row's log-probabilities are
    ``scores[r] - norm[r]``; one copy to the host."""
    index = torch.tensor(tokens, device=scores.device).unsqueeze(1)
    return _unpack(_pack(scores, norm, max(tops, default=0), index), tops)


def _pack(scores: torch.Tensor, norm: torch.Tensor, k: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """[rows, 1 + 2k] on the device, floored at LOGPROB_FLOOR: the logprob of each row's token at ``index`` (None:
    its top entry's), its k best logprobs, their ids. Only these entries are normalized: the whole distribution is
    never written out (a batch of 64 rows of a 128k vocabulary is 33 MB a pass on the GPU)."""
    norm = norm.unsqueeze(1)
    values, ids = scores.topk(k, dim=-1) if k else (scores[:, :0], scores[:, :0].long())
    values = values - norm
    picked = scores.gather(1, index) - norm if index is not None else values[:, :1]
    return torch.cat([picked, values, ids.to(scores.dtype)], dim=1).clamp_(min=LOGPROB_FLOOR)


def _unpack(packed: torch.Tensor, tops: list[int]) -> list[TokenLogprobs]:
    """``_pack``'s rows on the host (one copy), row r with its ``tops[r]`` best alternatives."""
    k = (packed.shape[1] - 1) // 2
    return [TokenLogprobs(row[0], tuple((int(row[1 + k + t]), row[1 + t]) for t in range(n)))
            for row, n in zip(packed.tolist(), tops, strict=True)]  # fmt: skip


def skip_draws(generator: torch.Generator, steps: int, vocab: int, device: torch.device) -> None:
    """Advance a request's generator past the noise ``sample`` drew for ``steps`` tokens (one row each)."""
    row = torch.empty(vocab, device=device)
    for _ in range(steps):
        row.exponential_(generator=generator)
