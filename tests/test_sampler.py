"""The batched sampler: frequencies follow the distribution, top-k and top-p cut it, seeds repeat."""

from __future__ import annotations

import torch

from engine.native.sampler import sample
from engine.sampling_params import LOGPROB_FLOOR, SamplingParams

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


def test_a_drawn_batch_is_the_softmaxs_and_leaves_the_graphs_argmax_as_it_was() -> None:
    """``draw`` queues a batch's tokens and logprobs (the engine launches its next step before it reads them): the
    tokens stay on the logits' device for the next step's inputs, a greedy row's logprobs are the plain softmax's
    (its token the top entry, a forbidden token floored), and the argmax it was given (a CUDA graph's own output,
    read again by the graph's next replay) is not written into when a row of the batch is sampled."""
    import math

    from engine.native.sampler import draw

    torch.manual_seed(1)
    logits = torch.randn(6, 300) * 4
    logits[3, 7] = -float("inf")  # a token a grammar forbade
    params = [SamplingParams(temperature=0, logprobs=n) for n in (0, 1, 5, 20)]
    params += [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3, logprobs=2)]
    argmax = logits.argmax(dim=-1)
    given = argmax.clone()
    drawn = draw(logits, params, [[] for _ in params], [None] * 5 + [torch.Generator().manual_seed(3)], argmax)
    out = drawn.read()
    assert torch.equal(argmax, given)
    assert drawn.tokens.tolist() == out.tokens and out.tokens[:5] == given[:5].tolist()
    assert out.logprobs[4] is None and out.logprobs[5] is not None
    reference = torch.log_softmax(logits, dim=-1)
    for row in range(4):
        entry = out.logprobs[row]
        assert entry is not None and len(entry.top) == params[row].logprobs
        assert math.isclose(entry.logprob, float(reference[row].max()), abs_tol=1e-5)
        values, ids = reference[row].topk(params[row].logprobs or 1)
        assert [t for t, _ in entry.top] == ids.tolist()[: len(entry.top)]
        assert all(math.isclose(x, float(y), abs_tol=1e-5) for (_, x), y in zip(entry.top, values, strict=False))
    forbidden = draw(logits[3:4], [SamplingParams(temperature=0, logprobs=1)], [[]], [None],
                     torch.tensor([7])).read()  # fmt: skip
    assert forbidden.logprobs[0] is not None and forbidden.logprobs[0].logprob == LOGPROB_FLOOR
