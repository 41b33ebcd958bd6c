"""The KV cache's memory: allocated when the engine starts, or, on CUDA, reserved then and committed when the
engine is made to serve (the supervisor activates every engine it starts before it takes traffic).

A standby that held its whole KV cache cost as much device memory as the active engine (three engines with a
12 GB KV cache each held 48.7 GB on the H200). A reserved cache is a range of virtual addresses
(cuMemAddressReserve) with one placeholder allocation of 2 MiB mapped again and again along it: kernels and CUDA
graphs see valid addresses, graphs captured against them keep them, and the engine's warm-up runs (its keys and
values land in the placeholder and mean nothing). A commit maps real memory under the same addresses in the
placeholder's place, zeroed: the captured graphs replay unchanged. ../shared/probes/kv_remap_probe.py measured
the mechanism on the H200: 2 MiB held for a reserved 8 GB cache, 68 ms to map 8 GB (32 GB: 270 ms), and graphs
captured before the remap replay correctly after it.

At that rate a cache planned from the device (tens of GB) would take hundreds of milliseconds to map, on the
path of a crash's first token. So the cache is committed in stripes of blocks: the first (``FIRST_BYTES``, the first
steps' positions) when the cache is made, the rest once the engine is activated, in the background while
it serves, in stripes of ``STRIPE_BYTES`` then twice as large each time up to ``MAX_STRIPE_BYTES``, each stripe's
blocks handed to the scheduler once mapped and zeroed. A standby thus holds its first stripe (128 MiB for
Llama-3-8B) and its activation maps nothing: after a kill -9 on the H200 the driver tears the dead engine down for
~0.1 s, and an activation that mapped the first 2 GiB then took 63-105 ms (13-24 ms otherwise); the first steps
now run on the first stripe while the next is mapped. A stripe of blocks is one range per layer of
keys and of values (the layout is [layers, slots, heads, dim]), so block counts and stripe bounds are multiples
of the blocks that fill a mapping's granularity (``block_multiple``).

The memory a commit needs may still be held by the engine this one replaces (a crashed one's until the driver
has torn its context down, a draining one's until it exits): a commit waits for it, up to its timeout. It waits
too while it would leave less than ``headroom`` free (``DeviceMemory.commit_headroom``): ten restarts 1 s apart
on the H200 left two engines draining beside the new one, whose background commit took the device's last bytes,
and a step of the active engine failed for 16 MiB.

On the CPU the kernel commits memory lazily anyway (an anonymous mapping holds nothing until written): a
reserved cache is the same mapping, its stripes are only bookkeeping, and the same hand-over of blocks runs.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from common import cuda_vmm
from common.events import log_event

log = logging.getLogger("warmgate.engine.kv_memory")
FIRST_BYTES = 128 << 20  # committed with the reservation: 1,024 positions of Llama-3-8B (a standby's share of 1.5 GiB)
STRIPE_BYTES = 2 << 30  # the second stripe, committed first once activated: 16k positions of Llama-3-8B
# Past the first, stripes double up to this: each stripe is one allocation per layer of keys and of values, and the
# driver frees thousands of them slowly when the engine dies (57 GB as 3,648 allocations: kill -9 to the exit 0.31 s
# on the H200; as 64: 0.15 s; .diag/exit_probe.py in the issue note), which a crash's replacement waits for.
MAX_STRIPE_BYTES = 8 << 30
RETRY_S = 0.02  # between attempts of a commit waiting for memory
COMMIT_AT_START_S = 60.0  # how long the first stripe waits for memory when the cache is made


@dataclass(frozen=True)
class KVGeometry:
    """Where blocks lie: keys, then values, each [layers, blocks, one block]; ``block_bytes`` is one block of one
    layer's keys (or values)."""

    layers: int
    blocks: int  # including the null block
    block_bytes: int

    @property
    def half(self) -> int:
        return self.layers * self.blocks * self.block_bytes

    def ranges(self, first: int, end: int) -> list[tuple[int, int]]:
        """The (offset, size) byte ranges of blocks first..end-1: one per layer, of the keys and of the values."""
        size, layer = (end - first) * self.block_bytes, self.blocks * self.block_bytes
        return [(part + i * layer + first * self.block_bytes, size) for part in (0, self.half)
                for i in range(self.layers)]  # fmt: skip

    def stripes(self, stripe_bytes: int, multiple: int, first_bytes: int | None = None,
                max_bytes: int | None = None) -> list[tuple[int, int]]:  # fmt: skip
        """Block ranges committed one at a time, beginning at multiples of ``multiple``: the first of about
        ``first_bytes`` (default: ``stripe_bytes``), the next of about ``stripe_bytes``, then each twice the one
        before, up to ``max_bytes`` (default: all of ``stripe_bytes``)."""
        per_block = 2 * self.layers * self.block_bytes

        def blocks_of(n: int) -> int:
            return max(multiple, n // per_block // multiple * multiple)

        step, after = blocks_of(stripe_bytes if first_bytes is None else first_bytes), blocks_of(stripe_bytes)
        cap = blocks_of(max_bytes or stripe_bytes)
        stripes: list[tuple[int, int]] = []
        first = 0
        while first < self.blocks:
            stripes.append((first, min(first + step, self.blocks)))
            first = stripes[-1][1]
            step, after = after, min(2 * after, max(cap, after))
        return stripes


def block_multiple(block_bytes: int, granularity: int) -> int:
    """The fewest blocks whose bytes (of one layer's keys) are a whole number of ``granularity``."""
    return granularity // math.gcd(granularity, block_bytes)


def granularity(device: torch.device, reserve: bool) -> int:
    """What a reserved cache's mappings are multiples of (2 MiB on the H200); 1 where nothing is mapped."""
    if device.type != "cuda" or not reserve:
        return 1
    cu = cuda_vmm.driver()
    return cuda_vmm.granularity(cu, cuda_vmm.allocation_prop(cu, device, exportable=False))


class KVMemory:
    """The cache's bytes on ``device`` as one uint8 tensor (``buffer``), zeros, held at once or stripe by stripe
    from the first commit (``reserve``)."""

    def __init__(self, geometry: KVGeometry, device: torch.device, reserve: bool, multiple: int = 1,
                 headroom: int = 0) -> None:  # fmt: skip
        """``multiple``: block_multiple of the device's granularity, which the geometry's block count is too;
        ``headroom``: device bytes a commit leaves free."""
        self.geometry = geometry
        self.nbytes = 2 * geometry.half
        self.stripes = geometry.stripes(STRIPE_BYTES, multiple, FIRST_BYTES, MAX_STRIPE_BYTES) if reserve \
            else [(0, geometry.blocks)]  # fmt: skip
        self._done = 0 if reserve else len(self.stripes)  # stripes committed, in order
        self._cuda: _Reserved | None = None
        if device.type == "cuda" and reserve:  # CUDA VMM, as the cache's arenas (cache/arena.py) need anyway
            self._cuda = _Reserved(geometry, self.stripes, device, headroom)
            self.buffer = self._cuda.buffer
        elif device.type == "cuda":
            self.buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        else:
            self.buffer = _lazy_zeros(self.nbytes)
        if reserve:
            self.commit_next(COMMIT_AT_START_S)  # the first stripe: an activation then maps nothing

    @property
    def committed(self) -> bool:
        """Whether every stripe is the cache's own memory."""
        return self._done == len(self.stripes)

    @property
    def committed_blocks(self) -> int:
        """Blocks 0..this-1 are committed."""
        return self.stripes[self._done - 1][1] if self._done else 0

    @property
    def short(self) -> bool:
        """A commit is waiting for device memory (another engine still holds it): the next stripe may be long."""
        return self._cuda is not None and self._cuda.short

    @property
    def device_bytes(self) -> int:
        """Device memory held outside torch's allocator: a reserved cache's placeholder and committed stripes."""
        return 0 if self._cuda is None else self._cuda.held

    def commit_first(self, timeout: float, waiting: Callable[[], None] = lambda: None) -> float:
        """Commit the stripe an engine starts serving with (made with the cache: nothing left to do); the seconds it
        took."""
        return self.commit_until(self.stripes[0][1], timeout, waiting)

    def commit_until(self, blocks: int, timeout: float, waiting: Callable[[], None] = lambda: None) -> float:
        """Commit stripes until blocks 0..``blocks``-1 are (or every stripe is); the seconds it took. Raises
        RuntimeError, saying how much was free, when the device has no room for a stripe within ``timeout``
        seconds (``waiting`` is called between attempts: the engine thread's heartbeat)."""
        started = time.perf_counter()
        while not self.committed and self.committed_blocks < blocks:
            self.commit_next(timeout, waiting)
        return time.perf_counter() - started

    def commit_next(self, timeout: float, waiting: Callable[[], None] = lambda: None) -> tuple[int, int] | None:
        """Commit the next stripe and return its blocks (first, end); None when every stripe is committed. One
        caller at a time: the engine thread at activation, then one background thread."""
        if self.committed:
            return None
        stripe = self.stripes[self._done]
        if self._cuda is not None:
            self._cuda.commit(stripe, timeout, waiting)
        self._done += 1
        if self.committed and self._cuda is not None:
            log_event(log, "kv_committed", bytes=self.nbytes, stripes=len(self.stripes))
        return stripe


class _Reserved:
    """A CUDA VMM range with placeholder memory mapped all along it, until each stripe is committed.

    The driver maps an allocation only whole, from its start (a mapping of part of one, or at an offset into it,
    is CUDA_ERROR_NOT_SUPPORTED on the H200). So the placeholder is two allocations, each mapped whole again and
    again: one the size of a range of the second stripe (32 MiB for Llama-3-8B), along each range in such pieces,
    and one granule (2 MiB) for what is left at a range's end (and the small first stripe's ranges). One per
    granule (27k mappings for a 57 GB cache) took 1.0 s at start-up and made each commit's unmap slower."""

    def __init__(self, geometry: KVGeometry, stripes: list[tuple[int, int]], device: torch.device,
                 headroom: int) -> None:  # fmt: skip
        cu = self.cu = cuda_vmm.driver()
        self.geometry, self.device, self.headroom = geometry, device, headroom
        self.short = False  # a commit waits for the device to have the memory (another engine still holds it)
        self.prop = cuda_vmm.allocation_prop(cu, device, exportable=False)
        size = 2 * geometry.half
        granule = cuda_vmm.granularity(cu, self.prop)
        piece = max(end - first for first, end in stripes[:2]) * geometry.block_bytes  # a range of the 2nd stripe
        self.ptr = int(cuda_vmm.check(cu.cuMemAddressReserve(size, 0, 0, 0)))
        self.placeholders: list[Any] = [cuda_vmm.check(cu.cuMemCreate(n, self.prop, 0)) for n in (piece, granule)]
        once: dict[int, int] = {}  # placeholder size -> where it is first mapped
        for a, b in stripes:
            for offset, length in geometry.ranges(a, b):
                at, stop = self.ptr + offset, self.ptr + offset + length
                for n, handle in zip((piece, granule), self.placeholders, strict=True):
                    while stop - at >= n:
                        cuda_vmm.check(cu.cuMemMap(at, n, 0, handle, 0))
                        once.setdefault(n, at)
                        at += n
        cuda_vmm.set_access(cu, self.ptr, size, device, writable=True)
        self.buffer = cuda_vmm.wrap(self.ptr, size, device)
        for n, at in once.items():  # each placeholder zeroed once, at one of its mappings: it reads zeros everywhere
            self.buffer[at - self.ptr : at - self.ptr + n].zero_()
        self.handles: list[Any] = []  # the stripes' allocations
        self.commits = 0  # stripes committed
        self.piece = piece + granule
        self.held = self.piece  # device bytes held: the placeholders, then the committed stripes
        self.stream = torch.cuda.Stream(device)  # zeroing, beside the engine's steps
        log_event(log, "kv_reserved", bytes=size, placeholder_bytes=self.piece, stripes=len(stripes))

    def commit(self, stripe: tuple[int, int], timeout: float, waiting: Callable[[], None]) -> None:
        """Map the stripe's own memory under its ranges, zeroed. One allocation per range: cuMemMap maps an
        allocation only from its start (its offset argument must be 0; CUDA_ERROR_NOT_SUPPORTED otherwise, as the
        H200 answered), so a stripe's ranges cannot share one."""
        cu, ranges = self.cu, self.geometry.ranges(*stripe)
        memory: list[Any] = []
        deadline, size = time.monotonic() + timeout, sum(length for _, length in ranges)
        try:
            for _, length in ranges:  # the headroom checked once, for the whole stripe; not for the first, made
                room = 0 if memory or not self.commits else size  # with the reservation (a start, as its graphs)
                memory.append(self._create(length, room, deadline, waiting, f"{_gb(size)} more", timeout))
        except BaseException:
            for handle in memory:
                cu.cuMemRelease(handle)
            raise
        if self.commits == 1:  # the first after the one with the reservation: what ran on the placeholder (the
            torch.cuda.synchronize(self.device)  # warm-ups, the supervisor's probe) must be done
        # Nothing reads or writes these ranges now: their blocks are handed out only once committed. One unmap
        # takes a range's placeholder mappings, all of them (as ../shared/probes/kv_remap_probe.py did).
        for (offset, length), handle in zip(ranges, memory, strict=True):
            cuda_vmm.check(cu.cuMemUnmap(self.ptr + offset, length))
            cuda_vmm.check(cu.cuMemMap(self.ptr + offset, length, 0, handle, 0))
            cuda_vmm.set_access(cu, self.ptr + offset, length, self.device, writable=True)
        with torch.cuda.stream(self.stream):
            for offset, length in ranges:
                self.buffer[offset : offset + length].zero_()
        self.stream.synchronize()
        self.handles += memory
        self.held += size
        self.commits += 1
        if stripe[1] == self.geometry.blocks:  # the last: no placeholder mapping is left
            for handle in self.placeholders:
                cuda_vmm.check(cu.cuMemRelease(handle))
            self.placeholders, self.held = [], self.held - self.piece

    def _create(self, size: int, room: int, deadline: float, waiting: Callable[[], None], need: str,
                timeout: float) -> Any:  # fmt: skip
        """An allocation of ``size`` bytes, made once ``room`` bytes would leave ``headroom`` free, retried until
        ``deadline`` while the device lacks the memory."""
        cu = self.cu
        out_of_memory = int(cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        while True:
            if not self.headroom or not room or torch.cuda.mem_get_info(self.device)[0] - room >= self.headroom:
                try:
                    made = cuda_vmm.check(cu.cuMemCreate(size, self.prop, 0))
                    self.short = False
                    return made
                except cuda_vmm.DriverError as exc:
                    if int(exc.code) != out_of_memory:
                        raise
            if time.monotonic() >= deadline:
                free, total = torch.cuda.mem_get_info(self.device)
                kept = f", {_gb(self.headroom)} kept free besides," if self.headroom else ""
                raise RuntimeError(f"the KV cache needs {need} of device memory{kept} and {_gb(free)} of "
                                   f"{_gb(total)} stayed free for {timeout:.0f} s")  # fmt: skip
            self.short = True
            waiting()
            time.sleep(RETRY_S)


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
