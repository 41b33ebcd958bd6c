"""CUDA virtual memory management (the driver's cuMem* calls, through NVIDIA's cuda-bindings), the few pieces
both users share: the cache's arenas (cache/arena.py: one allocation exported as a file descriptor, mapped by
every engine) and an engine's KV cache held as reserved addresses until it serves (engine/native/kv_memory.py).
"""

from __future__ import annotations

from typing import Any

import torch


def driver() -> Any:
    """The driver bindings (``cuda.bindings.driver``)."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("CUDA VMM needs NVIDIA's cuda-bindings package (pip install cuda-bindings)") from exc
    return cu


class DriverError(RuntimeError):
    """A driver call failed; ``code`` is its CUresult."""

    def __init__(self, code: Any) -> None:
        super().__init__(f"CUDA driver call failed: {code}")
        self.code = code


def check(result: Any) -> Any:
    """cuda-bindings returns (error, *values): raise DriverError on error, return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise DriverError(err)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def allocation_prop(cu: Any, device: torch.device, exportable: bool) -> Any:
    """Pinned device memory on ``device``; ``exportable``: shareable as a POSIX file descriptor."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device.index or 0
    if exportable:
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def granularity(cu: Any, prop: Any) -> int:
    """The size every mapping's size and offset are a multiple of (2 MiB on the H200)."""
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    return int(check(cu.cuMemGetAllocationGranularity(prop, flag)))


def set_access(cu: Any, ptr: int, size: int, device: torch.device, writable: bool) -> None:
    """Let ``device`` read (and write, if ``writable``) the mapped range."""
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device.index or 0
    flags = cu.CUmemAccess_flags
    access.flags = flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable else flags.CU_MEM_ACCESS_FLAGS_PROT_READ
    check(cu.cuMemSetAccess(ptr, size, [access], 1))


class _CudaArrayInterface:
    """Lets torch wrap a raw device pointer; the read-only flag must be False for torch to accept it
    (the protection is the driver mapping, not this flag)."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def wrap(ptr: int, size: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``size`` bytes of device memory at ``ptr`` (torch does not own it)."""
    return torch.as_tensor(_CudaArrayInterface(ptr, size), device=device)
