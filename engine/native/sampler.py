"""Next-token choice for a batch: penalties, temperature, top-k, top-p, per-request seeds; and the logprobs of
the distribution each token was drawn from, for the requests that ask."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.device import to_device
from engine.request_stream import TokenLogprobs
from engine.sampling_params import LOGPROB_FLOOR, SamplingParams


@dataclass(frozen=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprobs | None]  # per row: None where the request did not ask


class Drawn:
    """A batch's tokens and logprobs, queued on the device behind its logits: ``tokens`` is there for the next
    step's inputs at once, and ``read`` waits for the host's copy (one per tensor). Nothing in ``draw`` waits for
    the device, so the host can launch the next step before this one's tokens are known."""

    def __init__(self, tokens: torch.Tensor, wanted: list[int], tops: list[int], packed: torch.Tensor | None) -> None:
        self.tokens = tokens  # [B] int64, on the logits' device
        self._wanted, self._tops = wanted, tops
        cuda = tokens.device.type == "cuda"
        self._host = [t.to("cpu", non_blocking=cuda) for t in (tokens, packed) if t is not None]
        self._ready: torch.cuda.Event | None = None
        if cuda:  # waited for without spinning: the next step is already queued, so waking a little late costs
            self._ready = torch.cuda.Event(blocking=True)  # nothing, and the core is the HTTP loop's meanwhile
            self._ready.record()

    def read(self) -> Sampled:
        """The tokens and the asked logprobs, once the device made them."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens = self._host[0].tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if self._wanted:
            for row, entry in zip(self._wanted, _unpack(self._host[1], self._tops), strict=True):
                logprobs[row] = entry
        return Sampled(tokens, logprobs)


def apply_penalties(logits: torch.Tensor, outputs: list[list[int]], params: list[SamplingParams]) -> torch.Tensor:
    """OpenAI semantics: subtract presence once per seen token and frequency per occurrence."""
    rows = [i for i, p in enumerate(params) if p.presence_penalty or p.frequency_penalty]
    for i in rows:
        if not outputs[i]:
            continue
        counts = torch.bincount(to_device(outputs[i], logits.device), minlength=logits.shape[1]).float()
        p = params[i]
        logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of its max), int64 on x's device: split across many programs on CUDA
    (engine/native/triton_logprobs.py), torch's elsewhere."""
    if x.is_cuda and x.dtype == torch.float32 and x.stride(1) == 1:
        from engine.native.triton_logprobs import argmax

        return argmax(x)
    return x.argmax(dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], outputs: list[list[int]],
           generators: list[torch.Generator | None], argmax: torch.Tensor | None = None) -> Sampled:  # fmt: skip
    """``draw``, read at once."""
    return draw(logits, params, outputs, generators, argmax).read()


def draw(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    generators: list[torch.Generator | None],
    argmax: torch.Tensor | None = None,
) -> Drawn:
    """One token per row of ``logits`` [B, vocab] (float32), and the logprobs of the rows that ask, queued.

    ``argmax``: the rows' argmax when already computed (the CUDA-graph step's, on the device); not used when a
    penalty changes the logits. Sampled rows are drawn together: the exponential-race form of sampling (argmax
    of p / E, E ~ Exp(1), picks i with probability p_i) lets each seeded row draw its own noise from its own
    generator, with no per-row synchronization.
    """
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        logits, argmax = apply_penalties(logits, outputs, params), None
    chosen = argmax if argmax is not None else argmax_rows(logits)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    drawn: dict[int, torch.Tensor] = {}
    if rows:
        device = logits.device
        picked = [params[i] for i in rows]
        index = to_device(rows, device)
        x = logits.index_select(0, index) / to_device([p.temperature for p in picked], device).unsqueeze(1)
        vocab = x.shape[1]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in picked]
        if min(ks) < vocab:
            top = torch.topk(x, max(ks), dim=-1).values
            kth = top.gather(1, to_device(ks, device).unsqueeze(1) - 1)
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        if any(p.top_p < 1.0 for p in picked):
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            top_p = to_device([p.top_p for p in picked], device).unsqueeze(1)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            sorted_probs = sorted_probs.masked_fill(sorted_probs.cumsum(-1) - sorted_probs >= top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(1, order, sorted_probs)
        noise = torch.empty_like(probs)
        seeded = [j for j, i in enumerate(rows) if generators[i] is not None]
        if len(seeded) < len(rows):
            noise.exponential_()
        for j in seeded:
            noise[j].exponential_(generator=generators[rows[j]])
        chosen = chosen.clone()  # argmax may be the graph's own output
        chosen[index] = argmax_rows(probs / noise)
        drawn = dict(zip(rows, probs, strict=True))
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    tops = [params[i].logprobs or 0 for i in wanted]
    return Drawn(chosen, wanted, tops, _logprobs(logits, wanted, tops, chosen, drawn) if wanted else None)


def _logprobs(logits: torch.Tensor, wanted: list[int], tops: list[int], chosen: torch.Tensor,
              drawn: dict[int, torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """``_pack``'s rows for the ``wanted`` rows: each one's logprob of its ``chosen`` token and top alternatives,
    from ``drawn[row]`` (the probabilities a sampled row was drawn from, top-k and top-p applied, not yet
    normalized) or, for a greedy row, the softmax of its logits (a greedy token is the top entry)."""
    every = len(wanted) == logits.shape[0]
    index = None if every else to_device(wanted, logits.device)
    scores = logits if index is None else logits.index_select(0, index)
    sampled = [(j, drawn[i]) for j, i in enumerate(wanted) if i in drawn]
    if not sampled and scores.is_cuda and scores.dtype == torch.float32 and scores.is_contiguous():
        return _fused_greedy(scores, max(1, *tops))
    norm = torch.logsumexp(scores, dim=-1)
    if sampled:  # their distribution is the one they were drawn from: log p, normalized by log sum p
        scores = scores.clone() if scores is logits else scores
        for j, p in sampled:
            scores[j] = p.log()
            norm[j] = p.sum().log()
    tokens = chosen if index is None else chosen.index_select(0, index)
    return _pack(scores, norm, max(1, *tops), tokens.unsqueeze(1))


def _fused_greedy(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``_pack``'s rows for greedy rows on CUDA, from one read of the logits (engine/native/triton_logprobs.py:
    torch's logsumexp and topk read the [64, 128,256] logits of a step twice, 260 µs on the H200): a greedy
    token is its row's best, so its logprob is the first of the top k."""
    from engine.native.triton_logprobs import top_logprobs

    top = top_logprobs(scores, k, LOGPROB_FLOOR)
    return torch.cat([top[:, :1], top], dim=1)


def prompt_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Logprobs of ``tokens`` (the prompt's next tokens) in the rows of ``logits`` [n, vocab] (plain softmax), each
    with its ``top`` alternatives."""
    scores = logits.float()
    return _report(scores, torch.logsumexp(scores, dim=-1), tokens, [top] * len(tokens))


def _report(scores: torch.Tensor, norm: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """Row r's logprob of ``tokens[r]`` and its ``tops[r]`` best alternatives, where a row's log-probabilities are
    ``scores[r] - norm[r]``; one copy to the host."""
    index = to_device(tokens, scores.device).unsqueeze(1)
    return _unpack(_pack(scores, norm, max(tops, default=0), index), tops)


def _pack(scores: torch.Tensor, norm: torch.Tensor, k: int, index: torch.Tensor) -> torch.Tensor:
    """[rows, 1 + 2k] on the device, floored at LOGPROB_FLOOR: the logprob of each row's token at ``index``, its k
    best logprobs, their ids. Only these entries are normalized: the whole distribution is never written out (a
    batch of 64 rows of a 128k vocabulary is 33 MB a pass on the GPU)."""
    norm = norm.unsqueeze(1)
    values, ids = scores.topk(k, dim=-1) if k else (scores[:, :0], scores[:, :0].long())
    values = values - norm
    picked = scores.gather(1, index) - norm
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
