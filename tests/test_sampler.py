"""The batched sampler: frequencies follow the distribution, top-k and top-p cut it, seeds repeat."""

from __future__ import annotations

import torch

from engine.native.sampler import sample
from engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(params: SamplingParams, rows: int, generators=None) -> torch.Tensor:
    logits = PROBS.log().repeat(rows, 1)
    gens = generators or [None] * rows
    return torch.tensor(sample(logits, [params] * rows, [[] for _ in range(rows)], gens).tokens)


def test_frequencies_follow_the_distribution_and_top_k_top_p_cut_it() -> None:
    torch.manual_seed(0)
    counts = torch.bincount(_draw(SamplingParams(temperature=1.0), 20000), minlength=4) / 20000
    assert float((counts - PROBS).abs().max()) < 0.015, counts
    assert set(_draw(SamplingParams(temperature=1.0, top_k=2), 2000).tolist()) == {0, 1}
    assert set(_draw(SamplingParams(temperature=1.0, top_p=0.6), 2000).tolist()) == {0, 1}  # 0.5 < 0.6 <= 0.8
    hot = torch.bincount(_draw(SamplingParams(temperature=0.5), 20000), minlength=4) / 20000
    sharpened = PROBS**2 / (PROBS**2).sum()
    assert float((hot - sharpened).abs().max()) < 0.015, hot


def test_seeded_rows_repeat_and_greedy_rows_take_the_argmax() -> None:
    seeded = SamplingParams(temperature=1.0, seed=7)

    def run() -> list[int]:
        gens = [torch.Generator().manual_seed(7 + i) for i in range(64)]
        return _draw(seeded, 64, gens).tolist()

    assert run() == run()
    assert len(set(run())) > 1, "rows with different seeds draw differently"
    greedy_and_sampled = sample(PROBS.log().repeat(2, 1), [SamplingParams(temperature=0), seeded], [[], []],
                                [None, torch.Generator().manual_seed(1)]).tokens  # fmt: skip
    assert greedy_and_sampled[0] == 0


def test_logprobs_are_of_the_distribution_each_token_was_drawn_from() -> None:
    import math

    from engine.sampling_params import LOGPROB_FLOOR

    logits = PROBS.log().repeat(3, 1)
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, top_k=2, logprobs=3),
              SamplingParams(temperature=1.0)]  # fmt: skip
    out = sample(logits, params, [[], [], []], [None, None, None])
    greedy, cut, none = out.logprobs
    assert none is None
    assert greedy is not None and out.tokens[0] == 0 and greedy.top[0][0] == 0
    assert math.isclose(greedy.logprob, math.log(0.5), abs_tol=1e-6) and greedy.logprob == greedy.top[0][1]
    assert [t for t, _ in greedy.top] == [0, 1]
    assert cut is not None and [t for t, _ in cut.top[:2]] == [0, 1]  # top-k 2: renormalized over the two kept
    assert math.isclose(cut.top[0][1], math.log(0.5 / 0.8), abs_tol=1e-6)
    assert math.isclose(cut.top[1][1], math.log(0.3 / 0.8), abs_tol=1e-6)
    assert cut.top[2][1] == LOGPROB_FLOOR  # a token the sampler could not draw
    assert cut.logprob == dict(cut.top)[out.tokens[1]]


def test_greedy_logprobs_queued_before_the_wait_equal_those_computed_after_it() -> None:
    """engine/native/llm_engine.py queues a greedy batch's logprobs behind the step's logits (queue_logprobs);
    they must be what ``sample`` would have computed, row by row, and nothing is queued for a row that is sampled or
    penalized (its distribution is known only after the draw)."""
    import math

    from engine.native.sampler import queue_logprobs

    torch.manual_seed(1)
    logits = torch.randn(5, 300) * 4
    logits[3, 7] = -float("inf")  # a token a grammar forbade
    params = [SamplingParams(temperature=0, logprobs=n) for n in (0, 1, 5, 20)] + [SamplingParams(temperature=0)]
    queued = queue_logprobs(logits, list(enumerate(params)))
    assert queued is not None and queued.rows == [0, 1, 2, 3]
    early = queued.report()
    late = sample(logits, params, [[] for _ in params], [None] * len(params))
    assert late.logprobs[4] is None and 4 not in early
    for row in range(4):
        a, b = early[row], late.logprobs[row]
        assert b is not None and len(a.top) == len(b.top) == params[row].logprobs
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert all(math.isclose(x, y, abs_tol=1e-5) for (_, x), (_, y) in zip(a.top, b.top, strict=True))
    sampled = [*params[:2], SamplingParams(temperature=1.0, logprobs=2)]
    assert queue_logprobs(logits, list(enumerate(sampled))) is None
    assert queue_logprobs(logits, [(0, SamplingParams(temperature=0, logprobs=1, presence_penalty=0.5))]) is None
    assert queue_logprobs(logits, [(0, SamplingParams(temperature=0))]) is None
