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

    # native: warmgate's own engine; vllm: vLLM's engine on the same cache (pip install 'warmgate[vllm]').
    backend: Literal["native", "vllm"] = "native"
    # auto: CUDA when torch sees a GPU, else the CPU (common/device.py); or cpu, cuda, cuda:1
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")] = "auto"
    # auto: native fp32 on CPU and bf16 on CUDA; vllm bf16 everywhere (its CPU kernels are bf16 kernels)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_num_seqs: Annotated[int, Field(ge=1)] = 16
    max_model_len: Annotated[int | None, Field(ge=16)] = None  # default: min(model's context, 4096)
    kv_cache_bytes: Annotated[int | None, Field(ge=1)] = None  # cap on KV memory; fewer sequences fit if it binds
    max_num_batched_tokens: Annotated[int, Field(ge=16)] = 2048  # tokens per scheduler step (chunks + decode)
    block_size: Annotated[int, Field(ge=1, le=256)] = 16  # KV cache positions per block
    cuda_graphs: bool = True
    default_max_tokens: Annotated[int, Field(ge=1)] = 256
    # ipc: the cache's weights or fail; ipc-or-disk: the cache's when there is one, else the checkpoint; disk.
    weights: Literal["ipc", "ipc-or-disk", "disk"] = "ipc-or-disk"
