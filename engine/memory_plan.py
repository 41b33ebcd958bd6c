"""How big an engine is: its sequences, its longest sequence and its KV cache, planned from the device.

On CUDA, ``engine.gpu_memory_fraction`` of the device's memory is the budget of everything the gateway puts
there: the weights (once, in the cache process, when the engines attach them; once per engine when each
reads its own), for every engine on the device (the active one, the standbys, one still draining after an
overlap restart: ``EngineConfig.engines``, set by the gateway) what it needs besides its KV cache (CUDA context,
activations, graph pools: ``engine_reserve``), and the KV caches of the engines that hold one at the same moment
(``EngineConfig.kv_share``): the active one and the draining one. A standby holds none: its KV cache is reserved
addresses until it is promoted (engine/native/kv_memory.py). What is left, divided by ``kv_share``, is one
engine's KV cache; ``kv_cache_bytes`` caps it. vLLM sizes its KV cache the same way from
``gpu_memory_utilization``; it has no standbys to share the device with.

An engine that allocates its KV cache at start (not reserved) also takes no more than is free then, less its
working memory; a reserved one commits its cache when it is promoted, once the engine it replaces has given
its memory back.

On the CPU nothing is planned from the machine's memory: the KV cache holds ``max_num_seqs`` sequences of
``max_model_len`` tokens, or what ``kv_cache_bytes`` holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cache.checkpoint.architecture import ModelShape

CUDA_MAX_NUM_SEQS = 256  # vLLM's default on GPUs
CPU_MAX_NUM_SEQS = 16
DEFAULT_MAX_MODEL_LEN = 4096  # when the model's context is longer than the KV cache holds a few of
FULL_LENGTH_SEQS = 4  # the model's whole context is the default when the KV cache holds this many such sequences
GRAPH_POOL_BYTES = 256 << 20  # decode and mixed-step graphs share one pool: their activations at the largest step
# A CUDA context with its loaded kernels (torch, cuBLAS, Triton) and the small tensors an engine keeps, outside the
# KV cache. Measured on the H200 (docs/benchmarks.md, nvidia-smi per process): an attached engine with a 512 MB KV
# cache grew by 1.48 GB (max_num_seqs 4), one with an 8 GB KV cache held 8,888 MiB (max_num_seqs 64): about 1 GB
# and 1.3 GB besides the KV cache. The working memory (working_bytes) is counted apart, so this errs high.
CONTEXT_BYTES = 1 << 30


def default_max_num_seqs(device_type: str) -> int:
    return CUDA_MAX_NUM_SEQS if device_type == "cuda" else CPU_MAX_NUM_SEQS


def working_bytes(shape: ModelShape, max_batched_tokens: int, max_num_seqs: int) -> int:
    """One engine's device memory besides its CUDA context, its KV cache and the weights: activations and graphs."""
    return GRAPH_POOL_BYTES + activation_bytes(shape, max_batched_tokens, max_num_seqs)


def activation_bytes(shape: ModelShape, max_batched_tokens: int, max_num_seqs: int) -> int:
    """A step's largest activations, bf16: per token the hidden state, the residual, q/k/v and the attention
    output (about 8 hidden-sized rows) and the MLP's gate, up and product (3 intermediate-sized rows), with
    their FP8 copies; per sequence its logits in fp32 and the sampler's copies of them (4 vocab-sized rows)."""
    per_token = 2 * (8 * shape.hidden + 3 * shape.intermediate) + 8 * shape.hidden + 2 * shape.intermediate
    return max_batched_tokens * per_token + max_num_seqs * 4 * 4 * shape.vocab


@dataclass(frozen=True)
class DeviceMemory:
    """What shares one device, in bytes."""

    total: int  # the device's memory
    free: int  # free on the device as this engine plans (its context and the weights already there)
    fraction: float  # of the total the gateway may use (engine.gpu_memory_fraction)
    weights: int  # the model's weights on the device
    shared_weights: bool  # one copy for all engines (attached from the cache); else each engine holds its own
    working: int  # one engine's activations and graph pools (working_bytes)
    kv_share: int  # engines holding a KV cache on the device at once
    engines: int  # engines on the device at once (standbys too)
    reserved: bool = False  # this engine's KV cache is committed when it is promoted, not allocated now
    context: int = CONTEXT_BYTES  # one engine's CUDA context
    kv_first: int = 0  # a reserved KV cache's first stripe, held from the start (kv_memory.py): standbys hold it too

    @property
    def commit_headroom(self) -> int:
        """What a KV commit leaves free (kv_memory.py): room for two engines' starts (the standbys, rebuilt side by
        side) within what the plan leaves of the device. Engines past the plan (a second draining one, after
        restarts in a row) then make a commit wait for memory instead of taking what every other engine's
        allocations need."""
        return min(self.total - int(self.total * self.fraction), 2 * self.engine_reserve)

    @property
    def engine_reserve(self) -> int:
        """One engine's memory besides its KV cache and the weights (a reserved cache's first stripe counted here:
        a standby holds it too)."""
        return self.context + self.working + self.kv_first

    def kv_budget(self) -> int:
        """One engine's KV cache: its share of the plan, or what is free if something else took memory the plan
        counted on (another program, or engines outside this gateway). ValueError, saying what takes the memory,
        when nothing is left for it."""
        weights = self.weights * (1 if self.shared_weights else self.engines)
        left = int(self.total * self.fraction) - weights - self.engines * self.engine_reserve
        if left <= 0:
            raise ValueError(
                f"no device memory left for the KV cache: gpu_memory_fraction={self.fraction} of {_gb(self.total)} "
                f"holds the weights ({_gb(weights)}) and {self.engines} engine(s) of {_gb(self.engine_reserve)} "
                "besides their KV caches (the active one, the standbys, one draining); raise gpu_memory_fraction "
                "or lower restart.standby"
            )
        free = self.free - self.working
        if free <= 0:
            raise ValueError(f"no device memory left for the KV cache: {_gb(self.free)} of {_gb(self.total)} free "
                             f"and this engine needs {_gb(self.working)} besides its KV cache")  # fmt: skip
        share = left // self.kv_share
        return share if self.reserved else min(share, free)

    def describe(self) -> dict[str, Any]:
        return {"device_bytes": self.total, "free_bytes": self.free, "gpu_memory_fraction": self.fraction,
                "weights_bytes": self.weights, "shared_weights": self.shared_weights,
                "engine_reserve_bytes": self.engine_reserve, "kv_share": self.kv_share, "engines": self.engines,
                "reserved": self.reserved}  # fmt: skip


@dataclass(frozen=True)
class MemoryPlan:
    max_num_seqs: int
    max_model_len: int
    kv_cache_bytes: int | None  # the KV cache's budget; None: max_num_seqs sequences of max_model_len
    device: DeviceMemory | None  # None: not planned from the device (CPU)

    def describe(self) -> dict[str, Any]:
        device = self.device.describe() if self.device else None
        return {"max_num_seqs": self.max_num_seqs, "max_model_len": self.max_model_len,
                "kv_cache_budget": self.kv_cache_bytes, "device": device}  # fmt: skip


def plan(context: int, kv_bytes_per_token: int, device_type: str, max_num_seqs: int | None,
         max_model_len: int | None, kv_cache_cap: int | None, device: DeviceMemory | None) -> MemoryPlan:  # fmt: skip
    """The plan for settings (None: the default) on a device (``device``: its memory, CUDA only)."""
    seqs = max_num_seqs or default_max_num_seqs(device_type)
    budget = kv_cache_cap
    if device is not None:
        budget = device.kv_budget() if kv_cache_cap is None else min(kv_cache_cap, device.kv_budget())
    if max_model_len is not None:
        length = min(max_model_len, context)
    elif budget is not None and budget // kv_bytes_per_token >= FULL_LENGTH_SEQS * context:
        length = context
    else:
        length = min(context, DEFAULT_MAX_MODEL_LEN)
    return MemoryPlan(seqs, length, budget, device)


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
