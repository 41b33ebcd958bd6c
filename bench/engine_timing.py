"""Timing helpers shared by the engine benchmarks (CPU and GPU)."""

from __future__ import annotations

import time

import torch


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_step_seconds(engine, prompts: list[list[int]], params) -> float:
    """Mean wall time of the engine's scheduler steps once every sequence is decoding (sampling included)."""
    from engine.native.scheduler import Sequence

    for i, prompt in enumerate(prompts):
        engine.scheduler.add(Sequence(f"b{i}", prompt, params, lambda event: None))
    engine._step()  # prefill every prompt (and the first decode step)
    assert not engine.scheduler.waiting, "the batch must fit in one prefill step"
    sync()
    t = time.perf_counter()
    n = 0
    while len(engine.scheduler.running) == len(prompts):
        engine._step()
        n += 1
    sync()
    seconds = (time.perf_counter() - t) / n
    while not engine.scheduler.idle:
        engine._step()
    return seconds
