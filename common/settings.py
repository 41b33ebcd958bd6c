"""Engine settings: one definition, used by the gateway (its config file, admin overrides) and by the workers.

The gateway validates ``[engine]`` (and every admin override) with this model; each worker gets the
same fields plus its model and the cache's socket (engine/config.py's EngineConfig extends this).
Unknown keys are refused, naming the key, so a typo never passes silently.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    backend: Annotated[
        Literal["native", "vllm"],
        Field(
            description="native: warmgate's own engine; vllm: vLLM's engine on the same cache "
            "(pip install 'warmgate[vllm]')"
        ),
    ] = "native"
    device: Annotated[
        str,
        Field(
            pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$",
            description="auto: CUDA when torch sees a GPU, else the CPU (common/device.py); or cpu, cuda, cuda:1",
        ),
    ] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(
            description="compute dtype; auto: native fp32 on CPU and bf16 on CUDA, vllm bf16 everywhere (its CPU "
            "kernels are bf16 kernels)"
        ),
    ] = "auto"
    max_num_seqs: Annotated[
        int | None, Field(ge=1, description="sequences an engine runs at once; none: 256 on CUDA, 16 on the CPU")
    ] = None
    max_model_len: Annotated[
        int | None,
        Field(
            ge=16,
            description="longest sequence (prompt + output); none: the model's context if the KV cache holds 4 "
            "such sequences, else min(model's context, 4096)",
        ),
    ] = None
    gpu_memory_fraction: Annotated[
        float,
        Field(
            gt=0,
            le=1,
            description="of the GPU's memory, what the weights, every engine's working memory (the active one, the "
            "standbys, one draining) and the KV caches of the active and the draining one may use (a standby "
            "commits its KV cache when promoted); the KV cache is sized from it (CUDA only)",
        ),
    ] = 0.9
    kv_cache_bytes: Annotated[
        int | None,
        Field(
            ge=1,
            description="cap on one engine's KV cache; none: planned from gpu_memory_fraction on CUDA, "
            "max_num_seqs full-length sequences on the CPU",
        ),
    ] = None
    # 1,024: on the H200 (llama3-8b FP8) a 1,024-token step costs a little under half a 2,048-token one (15.8 against
    # 33.3 ms a graph), so prefill throughput holds while waiting prompts and decodes go every ~16 ms instead of ~33:
    # against 2,048, 64 streams' TTFT p50 121 -> 82 ms, 128 streams' 150 -> 93, the cached prefix wave's 118-119 -> 85
    # and 109 (docs/benchmarks.md, 2026-12-04).
    kv_cache_dtype: Annotated[
        Literal["auto", "fp8"],
        Field(
            description="what the KV cache keeps keys and values in; auto: the compute dtype; fp8: float8 e4m3 with "
            "a scale of 1, as vLLM's kv_cache_dtype=fp8 without calibrated scales (a byte a value, half of bf16's: "
            "twice the tokens in the same memory; on an H100 it served 64-128 streams 3% faster and 1,150-token "
            "prompts 4% faster, one stream 1% slower; values rounded to 3 mantissa bits, so outputs differ from "
            "auto's); the vllm backend "
            "passes it to vLLM",
        ),
    ] = "auto"
    max_num_batched_tokens: Annotated[
        int, Field(ge=16, description="tokens per scheduler step (prompt chunks + decode tokens)")
    ] = 1024
    block_size: Annotated[int, Field(ge=1, le=256, description="KV cache positions per block")] = 16
    cuda_graphs: Annotated[bool, Field(description="capture CUDA graphs at start-up (CUDA only)")] = True
    enable_prefix_caching: Annotated[
        bool, Field(description="reuse the KV cache blocks of prompt prefixes already computed (vLLM's name)")
    ] = True
    late_scheduling: Annotated[
        bool,
        Field(
            description="native, CUDA: a step with room is scheduled shortly before the device is expected to end "
            "the one before it, so that requests arriving meanwhile join it rather than the step after (engine/native/"
            "llm_engine.py, LaunchClock); false: as soon as the step before it is launched",
        ),
    ] = True
    front_processes: Annotated[
        int,
        Field(
            ge=0,
            le=16,
            description="native: processes that serve the engine API (parsing, text, SSE) apart from the process that "
            "steps the engine, sharing its socket (engine/front.py); 0: one process serves and steps",
        ),
    ] = 1  # two or four did not change the cached prefix wave or decode on the H200 (docs/benchmarks.md, 2026-12-04)
    default_max_tokens: Annotated[
        int, Field(ge=1, description="max_tokens of a request that sets none (less if the context is shorter)")
    ] = 256
    weights: Annotated[
        Literal["ipc", "ipc-or-disk", "disk"],
        Field(
            description="ipc: the cache's weights or fail; ipc-or-disk: the cache's when there is one, else the "
            "checkpoint; disk: the checkpoint"
        ),
    ] = "ipc-or-disk"
