"""Shared fixtures: the real demo checkpoints (built once per machine, reused), the gpu marker, and how
pytest-xdist shares tests out (`make test` runs ``--dist loadgroup``)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

PROMPT = "What is the capital of France?"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _holds_a_module_resource(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Fail loudly where pytest-xdist's loadgroup cannot group (it renames grouped tests' node ids, which some pytest
    versions ignore: pytest-dev/pytest-xdist#1386): ungrouped, module resources would start on several workers."""
    if not session.config.getoption("loadgroup", default=False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(f"pytest-xdist did not group {item.nodeid} (--dist loadgroup): see pyproject.toml")


def _holds_a_module_resource(item: pytest.Item) -> bool:
    """Whether the test uses a module-scoped fixture with a teardown (an engine, a gateway it started).

    Those tests run on one xdist worker, so the resource starts once; every other test is shared out on its
    own, so one long file does not keep one worker busy while the others are idle.
    """
    definitions = getattr(item, "_fixtureinfo", None)
    if definitions is None:
        return False
    return any(
        fixture.scope == "module" and inspect.isgeneratorfunction(fixture.func)
        for chain in definitions.name2fixturedefs.values()
        for fixture in chain
    )


@pytest.fixture(scope="session")
def demo_path():
    """Build (or reuse) the demo checkpoint in a scheme: the same call `warmgate model demo` makes."""
    from cache.checkpoint.demo import build_demo

    built: dict[str, Path] = {}

    def get(scheme: str = "bf16") -> Path:
        if scheme not in built:
            built[scheme] = build_demo(scheme, progress=False)
        return built[scheme]

    return get


def chat_greedy(model, tokenizer, prompt: str = PROMPT, max_new_tokens: int = 48) -> tuple[str, list[int]]:
    """Greedy chat reply with transformers; returns (text including special tokens, new token ids)."""
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :].tolist()
    return tokenizer.decode(new), new
