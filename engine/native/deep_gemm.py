"""DeepGEMM's block-FP8 GEMM in the engine's CUDA graphs from 33 rows (kernels.DEEP_GEMM_SMALL_M), where it would
otherwise call cuBLAS' blockwise scaled_mm (above 64 rows) or its own Triton kernel (33-64).

DeepGEMM (deepseek-ai/DeepGEMM, the Python JIT of commit 03d0be3, which nvcc compiles for sm_90a) takes the same
operands as cuBLAS' blockwise kernel (fp8 activations with 1x128 scales laid out column-major, rows padded to 4; fp8
weights with 128x128 scales) and gave the same bits on the H100 for llama3-8b's four layer GEMMs at 64-2,048 rows
(bench/prefill_bound.py: largest difference 0.0). It is faster: 99 against 130 us for a layer's four GEMMs at 128
rows, 342 against 361 at 1,024, and 90.7 against the Triton kernel's 99.3 at 64 (bench/results/
gpu_h100_deep_gemm_s46.json). Its kernels are compiled per GEMM shape
and launch choice, which it picks from the rows: an engine builds those of its graphs' step sizes before capturing
them (``prepare``), in parallel, cached on disk by DeepGEMM (~6 s a kernel the first time, none after), and a step of
another size runs cuBLAS rather than wait for a compiler. Optional: without the package, nvcc or an sm_90 card, or
with WARMGATE_DEEP_GEMM=0, the engine uses cuBLAS alone.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from common.device import resolve_device
from common.events import log_event, log_warning

log = logging.getLogger("warmgate.engine")
COMPILE_THREADS = 16


class DeepGemm:
    """The DeepGEMM kernels built for one engine: its block-FP8 weights' shapes at its steps' row counts."""

    def __init__(self, module: Any, device: torch.device, sms: int) -> None:
        self.module = module
        self.device = device
        self.sms = sms  # the SMs DeepGEMM plans its launches for (its get_num_sms: all of the device's)
        self.built: set[tuple[int, int, Any]] = set()  # (N, K, DeepGEMM's launch choice for the rows)

    @classmethod
    def load(cls, device: torch.device) -> DeepGemm | None:
        """DeepGEMM for ``device``, or None where it cannot run there (not installed, no nvcc, not sm_90)."""
        if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            return None
        module = import_deep_gemm()
        if module is None:
            return None
        device = resolve_device(device)  # "cuda" -> cuda:N, the device DeepGEMM's launches go to
        return cls(module, device, torch.cuda.get_device_properties(device).multi_processor_count)

    def _choice(self, m: int, n: int, k: int) -> tuple[int, int, Any]:
        return n, k, self.module.jit_kernels.gemm.get_best_configs(m, n, k, 1, self.sms)

    def ready(self, m: int, n: int, k: int) -> bool:
        """A graph being captured can take its kernel at these sizes: built by ``prepare`` (no compiler on a step's
        path). Eager calls take cuBLAS: a DeepGEMM launch costs 77 us of Python (its descriptors, its code generated and
        hashed) against cuBLAS' 24 on the H100's host, more than the GEMM itself at 128 rows."""
        return torch.cuda.is_current_stream_capturing() and self._choice(m, n, k) in self.built

    def prepare(self, weights: list[tuple[torch.Tensor, torch.Tensor]], rows: list[int]) -> int:
        """Build (or load from DeepGEMM's disk cache) the kernel of each weight (fp8 [N, K], its scales) at each row
        count, one call per distinct launch choice, in parallel threads; returns the kernels built (one that fails to
        build is logged and left to cuBLAS). Each call runs once on zeros, at most COMPILE_THREADS at a time: their
        activations and outputs for llama3-8b's graphs up to 1,024 rows add up to 0.33 GB (worked out, not
        measured), within the working memory the plan keeps for the graphs captured next (0.74 GB of activations at
        1,024 tokens and 256 sequences, engine/memory_plan.py)."""
        calls: dict[tuple[int, int, Any], tuple[int, torch.Tensor, torch.Tensor]] = {}
        for w, s in weights:
            for m in rows:
                calls.setdefault(self._choice(m, *w.shape), (m, w, s))

        def build(call: tuple[int, torch.Tensor, torch.Tensor]) -> bool:
            m, w, s = call
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            x = torch.zeros(m, w.shape[1], device=self.device, dtype=torch.uint8).view(w.dtype)
            scales = torch.ones(w.shape[1] // 128, m, device=self.device).t()
            try:
                self.gemm(x, scales, w, s)
            except Exception as exc:  # nvcc failed, its cache dir is not writable, ...: cuBLAS at these sizes
                log_warning(log, "deep_gemm_build_failed", n=w.shape[0], k=w.shape[1], rows=m,
                            error=f"{type(exc).__name__}: {exc}"[:300])  # fmt: skip
                return False
            return True

        with ThreadPoolExecutor(max_workers=COMPILE_THREADS) as pool:
            built = [choice for choice, ok in zip(calls, pool.map(build, calls.values()), strict=True) if ok]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.built.update(built)
        return len(built)

    def gemm(self, xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        """bf16 [M, N] = (xq [M, K] x xs [M, K/128], strides (1, M) with M a multiple of 4) @ (w [N, K] x ws)^T."""
        out = torch.empty(xq.shape[0], w.shape[0], device=xq.device, dtype=torch.bfloat16)
        self.module.gemm_fp8_fp8_bf16_nt((xq, xs), (w, ws), out)
        return out


def import_deep_gemm() -> Any:
    """The deep_gemm module with its compiler found, or None (logged). Its import (torch's cpp_extension, CUDA's
    bindings) and nvcc's version check take 0.3-0.45 s of an engine's start on the H100, inside its ``deep_gemm``
    phase. The fork server cannot take them over: cpp_extension's import calls ``torch.cuda.is_available()``, after
    which torch refuses CUDA to every forked child (engine/fork_server.py's ``forks_can_use_cuda``)."""
    if os.environ.get("WARMGATE_DEEP_GEMM", "1") == "0":
        return None
    try:
        import deep_gemm  # type: ignore[import-not-found]
    except ModuleNotFoundError as exc:
        if exc.name != "deep_gemm":  # installed, but something it needs is not
            log_event(log, "deep_gemm_unavailable", reason=str(exc)[:200])
        return None
    try:
        deep_gemm.jit.get_nvcc_compiler()  # functools.cache'd by DeepGEMM for the process
    except Exception as exc:  # no CUDA_HOME (a TypeError inside), no nvcc, one too old: cuBLAS then
        log_event(log, "deep_gemm_unavailable", reason=f"no usable nvcc ({type(exc).__name__}: {exc})"[:200])
        return None
    return deep_gemm
