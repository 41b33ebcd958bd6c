"""The memory plan's arithmetic (engine/memory_plan.py): one engine's KV cache from the device's memory, shared by
the weights, the engines on the device (active, standbys, one draining) and the KV caches of those that hold one
(active and draining: a standby's is reserved addresses until it is promoted); the defaults it picks; its
refusals."""

from __future__ import annotations

import pytest

from app.admin_text import status_text
from app.config import Settings
from cache.checkpoint.architecture import ModelShape
from engine.memory_plan import (
    CPU_MAX_NUM_SEQS,
    CUDA_MAX_NUM_SEQS,
    DEFAULT_MAX_MODEL_LEN,
    DeviceMemory,
    activation_bytes,
    plan,
    working_bytes,
)

GB = 10**9
KV_PER_TOKEN = 131_072  # llama3-8b in bf16: 32 layers x 2 x 8 kv heads x 128 x 2 bytes


def device(**changes: object) -> DeviceMemory:
    values: dict[str, object] = {"total": 140 * GB, "free": 120 * GB, "fraction": 0.9, "weights": 9 * GB,
                                 "shared_weights": True, "context": GB, "working": GB, "kv_share": 3,
                                 "engines": 3}  # fmt: skip
    return DeviceMemory(**{**values, **changes})  # type: ignore[arg-type]


def test_the_kv_budget_is_what_the_weights_and_the_engines_leave_divided_among_the_engines() -> None:
    # 0.9 x 140 = 126 GB; weights 9 once; 3 engines x 2 GB -> 111 GB left for 3 KV caches.
    assert device().kv_budget() == 37 * GB
    # Alone on the device it takes 126 - 9 - 2 = 115 GB; with only 100 GB free (another program holds the rest)
    # what is free, less the 1 GB it still needs to work in.
    assert device(kv_share=1, engines=1).kv_budget() == 115 * GB
    assert device(kv_share=1, engines=1, free=100 * GB).kv_budget() == 99 * GB
    # Each engine holding its own weights (read from disk) pays them once per engine.
    assert device(shared_weights=False).kv_budget() == (126 - 27 - 6) * GB // 3
    # A standby more leaves every engine less: its context and working memory, and a KV cache if it holds one.
    assert device(engines=4).kv_budget() < device().kv_budget()
    assert device(kv_share=4, engines=4).kv_budget() < device(engines=4).kv_budget()


def test_standbys_that_hold_no_kv_cache_leave_it_to_the_active_and_the_draining_engine() -> None:
    # Two standbys with reserved KV caches, overlap: 4 engines x 2 GB; 126 - 9 - 8 = 109 GB for 2 KV caches.
    reserved = device(kv_share=2, engines=4, reserved=True)
    assert reserved.kv_budget() == 109 * GB // 2
    # A reserved cache is committed at promotion, when the engine it replaces has given its memory back: what is
    # free while it starts (the others' caches held) does not cap it; what it needs to work in must be free now.
    assert device(kv_share=2, engines=4, reserved=True, free=10 * GB).kv_budget() == 109 * GB // 2
    assert device(kv_share=2, engines=4, free=10 * GB).kv_budget() == 9 * GB
    with pytest.raises(ValueError, match="free"):
        device(kv_share=2, engines=4, reserved=True, free=GB // 2).kv_budget()
    # A reserved cache's first stripe is mapped from the start (kv_memory.py): every engine holds it, standbys too,
    # so it counts in each engine's reserve: 4 x 0.25 GB less for the 2 KV caches.
    first = device(kv_share=2, engines=4, reserved=True, kv_first=GB // 4)
    assert first.engine_reserve == 2 * GB + GB // 4 and first.kv_budget() == (109 * GB - GB) // 2


def test_a_commit_leaves_room_for_two_engines_starts_within_what_the_plan_leaves() -> None:
    # 2 engines' reserve (context 1 GB + working 1 GB each) = 4 GB, within the 14 GB past the 0.9 fraction...
    assert device().commit_headroom == 4 * GB
    # ...and never more than what the plan leaves: 0.98 of 140 GB leaves 2.8 GB.
    assert device(fraction=0.98).commit_headroom == 140 * GB - int(140 * GB * 0.98)


def test_nothing_left_for_the_kv_cache_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_fraction=0\.1 of 140\.0 GB") as refused:
        device(fraction=0.1).kv_budget()
    assert "restart.standby" in str(refused.value)
    with pytest.raises(ValueError, match=r"0\.5 GB of 140\.0 GB free"):  # another program holds the device
        device(free=GB // 2).kv_budget()


def test_on_cuda_the_defaults_come_from_the_device() -> None:
    planned = plan(context=8192, kv_bytes_per_token=KV_PER_TOKEN, device_type="cuda", max_num_seqs=None,
                   max_model_len=None, kv_cache_cap=None, device=device())  # fmt: skip
    assert planned.max_num_seqs == CUDA_MAX_NUM_SEQS
    assert planned.kv_cache_bytes == 37 * GB
    assert planned.max_model_len == 8192  # 37 GB hold 282k tokens: 4 sequences of the whole context and more
    # kv_cache_bytes caps the plan; too small a cap for 4 full sequences falls back to 4,096 tokens.
    capped = plan(8192, KV_PER_TOKEN, "cuda", None, None, 3 * GB, device())
    assert capped.kv_cache_bytes == 3 * GB and capped.max_model_len == DEFAULT_MAX_MODEL_LEN
    # What the user set is kept (the model's context still bounds max_model_len).
    explicit = plan(8192, KV_PER_TOKEN, "cuda", 64, 100_000, None, device())
    assert explicit.max_num_seqs == 64 and explicit.max_model_len == 8192


def test_on_the_cpu_nothing_is_planned_from_the_machine() -> None:
    planned = plan(context=8192, kv_bytes_per_token=KV_PER_TOKEN, device_type="cpu", max_num_seqs=None,
                   max_model_len=None, kv_cache_cap=None, device=None)  # fmt: skip
    assert planned.max_num_seqs == CPU_MAX_NUM_SEQS and planned.max_model_len == DEFAULT_MAX_MODEL_LEN
    assert planned.kv_cache_bytes is None and planned.describe()["device"] is None
    assert plan(2048, KV_PER_TOKEN, "cpu", None, None, None, None).max_model_len == 2048


def test_an_engines_reserve_grows_with_its_step() -> None:
    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "vocab_size": 128256})  # fmt: skip
    assert activation_bytes(shape, 4096, 256) > activation_bytes(shape, 2048, 256) > activation_bytes(shape, 2048, 16)
    assert working_bytes(shape, 2048, 256) > activation_bytes(shape, 2048, 256)


@pytest.mark.parametrize(("backend", "standby", "strategy", "share", "engines"),
                         [("native", 0, "replace", 1, 1), ("native", 0, "overlap", 2, 2),
                          ("native", 1, "overlap", 2, 3), ("native", 2, "overlap", 2, 4),
                          ("native", 2, "replace", 1, 3), ("vllm", 2, "overlap", 4, 4),
                          ("vllm", 1, "replace", 2, 2)])  # fmt: skip
def test_the_engines_on_the_device_and_the_kv_caches_they_hold(backend: str, standby: int, strategy: str, share: int,
                                                               engines: int) -> None:  # fmt: skip
    """Active, standbys and one draining engine (overlap) are on the device; native standbys hold no KV cache."""
    settings = Settings.model_validate({"engine": {"backend": backend},
                                       "restart": {"standby": standby, "strategy": strategy}})  # fmt: skip
    assert (settings.kv_share, settings.engines_on_device) == (share, engines)
    config = settings.engine_config(settings.run_dir, settings.run_dir / "cache.sock")
    assert (config.kv_share, config.engines, config.reserve_kv) == (share, engines, True)


def test_the_status_shows_the_active_engines_plan() -> None:
    memory = {"max_num_seqs": 256, "max_model_len": 8192, "kv_cache_budget": 37 * GB, "kv_cache_bytes": 36 * GB,
              "kv_tokens": 274_000, "device": device().describe()}  # fmt: skip
    text = status_text({"active": 3, "engines": [{"id": 3, "state": "active", "memory": memory, "settings": {}}]})
    line = next(line for line in text.splitlines() if line.startswith("memory"))
    assert "max_num_seqs=256 max_model_len=8192" in line and "274000 tokens" in line and "3 engines" in line, line
    assert "3 KV caches" in line, line
