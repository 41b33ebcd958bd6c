"""The KV cache's memory: allocated when the engine starts, or, on CUDA, reserved then and committed when the
engine is made to serve (``commit``: the supervisor activates every engine it starts before it takes traffic).

A standby that held its whole KV cache cost as much device memory as the active engine (three engines with a
12 GB KV cache each held 48.7 GB on the H200). A reserved cache is a range of virtual addresses
(cuMemAddressReserve) with one small placeholder allocation mapped again and again along it: kernels and CUDA
graphs see valid addresses, graphs captured against them keep them, and the engine's warm-up runs (its keys and
values land in the placeholder and mean nothing). ``commit`` maps real memory under the same addresses in the
placeholder's place, zeroed: the captured graphs replay unchanged. ../shared/probes/kv_remap_probe.py measured
the mechanism on the H200: 2 MiB held for a reserved 8 GB cache, 68 ms to map 8 GB (32 GB: 270 ms), and graphs
captured before the remap replay correctly after it.

The memory a commit needs may still be held by the engine this one replaces (a crashed one's until the driver
has torn its context down, a draining one's until it exits): the commit waits for it, up to its timeout.

On the CPU the kernel commits memory lazily anyway (an anonymous mapping holds nothing until written), so a
reserved cache and an allocated one are the same thing and a commit has nothing to do.
"""

from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable
from typing import Any

import torch

from common import cuda_vmm
from common.events import log_event

log = logging.getLogger("warmgate.engine.kv_memory")
PLACEHOLDER_BYTES = 32 << 20  # one mapping per this many bytes of a reserved cache: 1,600 for 50 GB
RETRY_S = 0.02  # between attempts of a commit waiting for memory


class KVMemory:
    """``nbytes`` of zeros on ``device`` as a uint8 tensor (``buffer``), held at once or only from ``commit``."""

    def __init__(self, nbytes: int, device: torch.device, reserve: bool) -> None:
        self.nbytes = nbytes
        self._reserved: _Reserved | None = None
        if device.type == "cuda" and reserve:  # CUDA VMM, as the cache's arenas (cache/arena.py) need anyway
            self._reserved = _Reserved(nbytes, device)
            self.buffer = self._reserved.buffer
        elif device.type == "cuda":
            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        else:
            self.buffer = _lazy_zeros(nbytes)

    @property
    def committed(self) -> bool:
        """Whether the memory is the cache's own (not the placeholder of a reserved cache)."""
        return self._reserved is None or self._reserved.committed

    @property
    def device_bytes(self) -> int:
        """Device memory held outside torch's allocator: a reserved cache's placeholder, then its own memory."""
        return 0 if self._reserved is None else self._reserved.held

    def commit(self, timeout: float, waiting: Callable[[], None] = lambda: None) -> float:
        """Map the cache's memory under its addresses (a reserved cache; else nothing to do); the seconds it took.
        Raises RuntimeError, saying how much was free, when the device has no room for it within ``timeout``
        seconds (``waiting`` is called between attempts: the engine thread's heartbeat); the cache is then still
        the placeholder."""
        if self._reserved is None or self._reserved.committed:
            return 0.0
        return self._reserved.commit(timeout, waiting)


class _Reserved:
    """A CUDA VMM range with the placeholder mapped along it, until ``commit``."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        cu = self.cu = cuda_vmm.driver()
        self.device = device
        self.prop = cuda_vmm.allocation_prop(cu, device, exportable=False)
        granularity = cuda_vmm.granularity(cu, self.prop)
        self.size = -(-nbytes // granularity) * granularity
        piece = min(self.size, -(-PLACEHOLDER_BYTES // granularity) * granularity)
        self.ptr = int(cuda_vmm.check(cu.cuMemAddressReserve(self.size, 0, 0, 0)))
        self.placeholder: Any = cuda_vmm.check(cu.cuMemCreate(piece, self.prop, 0))
        for offset in range(0, self.size, piece):
            cuda_vmm.check(cu.cuMemMap(self.ptr + offset, min(piece, self.size - offset), 0, self.placeholder, 0))
        cuda_vmm.set_access(cu, self.ptr, self.size, device, writable=True)
        self.buffer = cuda_vmm.wrap(self.ptr, self.size, device)[:nbytes]
        self.buffer[:piece].zero_()  # every piece of the range reads zeros until something is written
        self.memory: Any = None  # the cache's own allocation, once committed
        self.held = piece  # device bytes held: the placeholder, then the cache's own
        log_event(log, "kv_reserved", bytes=self.size, placeholder_bytes=piece)

    @property
    def committed(self) -> bool:
        return self.memory is not None

    def commit(self, timeout: float, waiting: Callable[[], None]) -> float:
        cu, started = self.cu, time.perf_counter()
        deadline = time.monotonic() + timeout
        out_of_memory = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        while True:
            try:
                memory = cuda_vmm.check(cu.cuMemCreate(self.size, self.prop, 0))
                break
            except cuda_vmm.DriverError as exc:
                if int(exc.code) != out_of_memory:
                    raise
                if time.monotonic() >= deadline:
                    free, total = torch.cuda.mem_get_info(self.device)
                    raise RuntimeError(f"the KV cache needs {_gb(self.size)} of device memory and {_gb(free)} of "
                                       f"{_gb(total)} stayed free for {timeout:.0f} s") from None  # fmt: skip
                waiting()
                time.sleep(RETRY_S)
        torch.cuda.synchronize(self.device)  # nothing may still be using the placeholder
        cuda_vmm.check(cu.cuMemUnmap(self.ptr, self.size))
        cuda_vmm.check(cu.cuMemRelease(self.placeholder))
        cuda_vmm.check(cu.cuMemMap(self.ptr, self.size, 0, memory, 0))
        cuda_vmm.set_access(cu, self.ptr, self.size, self.device, writable=True)
        self.memory, self.placeholder, self.held = memory, None, self.size
        self.buffer.zero_()
        torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - started
        log_event(log, "kv_committed", bytes=self.size, seconds=seconds)
        return seconds


def _lazy_zeros(nbytes: int) -> torch.Tensor:
    """Zeros without touching them: on CPU, anonymous mmap pages are zero until first written.

    torch.zeros would write every byte up front (6.7 s for the demo's 3 GB default cache here),
    which a restart would pay every time. Unused positions must read as zeros, not garbage:
    a masked score times a NaN value would still be NaN.
    """
    buffer = mmap.mmap(-1, max(1, nbytes))  # private, anonymous: zero-filled by the kernel, committed lazily
    return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes]


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
