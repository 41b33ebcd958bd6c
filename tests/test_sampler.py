"""The batched sampler: frequencies follow the distribution, top-k and top-p cut it, seeds repeat."""

from __future__ import annotations

import torch

from engine.native.sampler import sample
from engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])


def _draw(params: SamplingParams, rows: int, generators=None) -> torch.Tensor:
    logits = PROBS.log().repeat(rows, 1)
    gens = generators or [None] * rows
    return torch.tensor(sample(logits, [params] * rows, [[] for _ in range(rows)], gens))


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
                                [None, torch.Generator().manual_seed(1)])  # fmt: skip
    assert greedy_and_sampled[0] == 0
