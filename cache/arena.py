"""Arenas: one large buffer per device that holds every processed tensor at an aligned offset.

One mechanism on both devices: the cache process fills an arena, exports it as a file
descriptor, and engines map that descriptor read-only (it travels over the cache socket with
SCM_RIGHTS). An attach therefore opens one handle per arena, not one per tensor.

* CPU: a sealed memfd. After filling, the cache drops its writable mapping and seals the
  file against writes and resizing, so no process can map it writable again.
* CUDA: a CUDA VMM allocation (cuMemCreate, POSIX-fd handle type) through NVIDIA's
  cuda-bindings; engines import it and map it with read-only access. The driver refcounts
  the memory: mappings stay valid while any process holds them.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from common import cuda_vmm

ALIGN = 256  # bytes between tensors: enough for every dtype and for vectorised GPU loads

MEMFD = "memfd"
CUDA_VMM = "cuda-vmm"


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives: arena index, byte offset, dtype name (torch), shape, stride (elements)."""

    name: str
    arena: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def plan_layout(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorEntry], int]:
    """Offsets for every tensor in one arena, and the arena's size in bytes.

    A dense tensor keeps its strides (a transposed weight stays transposed: kernels such as
    torch._scaled_mm require that layout); any other tensor is stored contiguous.
    """
    entries, offset = [], 0
    for name, t in tensors.items():
        offset = -(-offset // ALIGN) * ALIGN
        stride = t.stride() if _dense(t) else torch.empty(t.shape, device="meta").stride()
        entries.append(TensorEntry(name, 0, offset, dtype_name(t.dtype), tuple(t.shape), tuple(stride)))
        offset += t.numel() * t.element_size()
    return entries, max(offset, ALIGN)


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill a block of exactly numel() slots with no gaps or overlaps (a permuted contiguous tensor)."""
    expected = 1
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def tensor_views(buffer: torch.Tensor, entries: list[TensorEntry]) -> dict[str, torch.Tensor]:
    """Typed views into a uint8 arena buffer (no copies): one reinterpretation per dtype, then
    one as_strided per tensor (an attach binds hundreds of them)."""
    typed: dict[str, torch.Tensor] = {}
    out = {}
    for e in entries:
        whole = typed.get(e.dtype)
        if whole is None:
            dtype = dtype_of(e.dtype)
            whole = typed[e.dtype] = buffer[: buffer.numel() // dtype.itemsize * dtype.itemsize].view(dtype)
        out[e.name] = whole.as_strided(e.shape, e.stride, e.offset // whole.element_size())
    return out


def copy_into(buffer: torch.Tensor, entries: list[TensorEntry], tensors: dict[str, torch.Tensor]) -> None:
    for name, view in tensor_views(buffer, entries).items():
        view.copy_(tensors[name])


class Arena(Protocol):
    transport: str
    size: int

    def buffer(self) -> torch.Tensor:
        """The whole arena as a uint8 tensor on its device."""
        ...

    def export_fd(self) -> int:
        """A file descriptor another process can map (the caller closes it after sending)."""
        ...


def create_arena(size: int, device: torch.device) -> WritableArena:
    """A new arena to fill; ``seal()`` it before exporting."""
    if device.type == "cpu":
        return MemfdArena(size)
    if device.type == "cuda":
        return CudaVmmArena(size, device)
    raise ValueError(f"no arena transport for device {device}")


def attach_arena(transport: str, fd: int, size: int, device: torch.device) -> Arena:
    """Map an exported arena read-only in this process (the fd may be closed afterwards)."""
    if transport == MEMFD and device.type == "cpu":
        return MappedMemfd(fd, size)
    if transport == CUDA_VMM and device.type == "cuda":
        return ImportedVmm(fd, size, device)
    raise ValueError(f"cannot map a {transport} arena on device {device}")


class WritableArena(Arena, Protocol):
    def fill(self, entries: list[TensorEntry], tensors: dict[str, torch.Tensor]) -> None: ...

    def seal(self) -> None: ...


# -- CPU: sealed memfd -----------------------------------------------------------------------


class MemfdArena:
    transport = MEMFD

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("warmgate-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        self._readonly: MappedMemfd | None = None

    def fill(self, entries: list[TensorEntry], tensors: dict[str, torch.Tensor]) -> None:
        with mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            # The temporary buffer tensor is gone when copy_into returns: a mapping cannot close while exported.
            copy_into(torch.frombuffer(mm, dtype=torch.uint8), entries, tensors)

    def seal(self) -> None:
        """No more writes, by anyone: F_SEAL_WRITE refuses every future writable mapping."""
        seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
        self._readonly = MappedMemfd(self.fd, self.size)

    def buffer(self) -> torch.Tensor:
        if self._readonly is None:
            raise RuntimeError("the arena is not sealed yet")
        return self._readonly.buffer()

    def export_fd(self) -> int:
        return os.dup(self.fd)


class MappedMemfd:
    transport = MEMFD

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": that is the point
            self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def export_fd(self) -> int:
        raise RuntimeError("a mapped arena is not re-exported")


# -- CUDA: VMM allocation exported as a POSIX fd -------------------------------------------


def preload_transport(device: torch.device) -> None:
    """Import the CUDA driver bindings now (engine start-up) rather than inside the first attach."""
    if device.type == "cuda":
        cuda_vmm.driver()


def _map(cu: Any, handle: Any, size: int, device: torch.device, writable: bool) -> int:
    ptr = cuda_vmm.check(cu.cuMemAddressReserve(size, 0, 0, 0))
    cuda_vmm.check(cu.cuMemMap(ptr, size, 0, handle, 0))
    cuda_vmm.set_access(cu, ptr, size, device, writable)
    return int(ptr)


class CudaVmmArena:
    transport = CUDA_VMM

    def __init__(self, size: int, device: torch.device) -> None:
        cu = cuda_vmm.driver()
        torch.zeros(1, device=device)  # the primary context must exist before driver calls
        prop = cuda_vmm.allocation_prop(cu, device, exportable=True)
        granularity = cuda_vmm.granularity(cu, prop)
        self.size = -(-size // granularity) * granularity
        self.device = device
        self._handle = cuda_vmm.check(cu.cuMemCreate(self.size, prop, 0))
        self._ptr = _map(cu, self._handle, self.size, device, writable=True)
        self._buf = cuda_vmm.wrap(self._ptr, self.size, device)

    def fill(self, entries: list[TensorEntry], tensors: dict[str, torch.Tensor]) -> None:
        copy_into(self._buf, entries, tensors)
        torch.cuda.synchronize(self.device)

    def seal(self) -> None:
        """Nothing to seal on the device: importers map the allocation with read-only access."""

    def buffer(self) -> torch.Tensor:
        return self._buf

    def export_fd(self) -> int:
        cu = cuda_vmm.driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(cuda_vmm.check(cu.cuMemExportToShareableHandle(self._handle, kind, 0)))


class ImportedVmm:
    transport = CUDA_VMM

    def __init__(self, fd: int, size: int, device: torch.device) -> None:
        cu = cuda_vmm.driver()
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.size = size
        self._handle = cuda_vmm.check(cu.cuMemImportFromShareableHandle(fd, kind))
        self._ptr = _map(cu, self._handle, size, device, writable=False)
        self._buf = cuda_vmm.wrap(self._ptr, size, device)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def export_fd(self) -> int:
        raise RuntimeError("an imported arena is not re-exported")
