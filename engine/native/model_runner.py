"""Runs one scheduled step through the model: inputs staged in one copy, a CUDA graph when there is one.

Inputs live in fixed buffers (pinned on the host, mirrored on the device), so every step, eager
or graphed, reads the same tensors. On CUDA every graph is captured at start-up, before the
worker reports ready: decode steps (one token per sequence) by batch size, and mixed steps (prompt chunks with decode
tokens) by total tokens, with room for every sequence. At the batch sizes where walking a shared prefix once for
several sequences pays (``shared_decode_sizes``), decode steps have a second graph that walks it so. Padding rows
write their keys into the null block and belong to no sequence; padding sequences have no rows.

``run`` launches a step and returns without waiting for it: the engine stages the next step while the
device computes this one. A sequence's newest token may not be on the host yet (drawn by the step before,
still on the device): the stager leaves its place empty and the device copies it in from that step's tokens
before the forward. Two pinned staging buffers take turns, so the next step's inputs are written while this
step's are still being uploaded.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.native.attention import StepBatch
from engine.native.kv_cache import KVCache, slots_of
from engine.native.model import Transformer
from engine.native.sampler import argmax_rows
from engine.native.scheduler import Scheduled


def decode_buckets(max_seqs: int) -> list[int]:
    """Batch sizes with a decode graph: 1, 2, 4, 8, then powers of two and the halves between them (16, 24, 32, 48,
    64, 96, ...), and ``max_seqs``. Every graph is captured before an engine serves (on the fork path, under load,
    ~45 ms each on the H200), and a decode step's time grows little with its rows above 16 (~9 us a row from 64 to
    128: a padded row costs less than 2% of the step): 9 graphs for 64 sequences, 13 for 256 (11 and 23 before)."""
    sizes = {1, 2, 4, 8, max_seqs}
    size = 16
    while size < max_seqs:
        sizes.update((size, size * 3 // 2))
        size *= 2
    return sorted(s for s in sizes if s <= max_seqs)


# A step's shared prefix (ModelRunner._shared_prefix) counts from this many positions: four of the attention kernel's
# 64-position tiles.
SHARED_MIN = 256
# A decode step takes the shared prefix's walk (its own graph, on the batch sizes where it pays: shared_decode_pays)
# only where its sequences' own positions past the prefix are at most an eighth of it: a program walks the prefix once
# and then each of its DECODE_GROUP sequences' own positions in turn. On an H100, 64 sequences over a 2,000-position
# prefix: 100 positions of their own, the shared walk 16% faster; 300, even (engine/native/triton_attention.py).
SHARED_DECODE_OWN = 8

# Mixed steps above this many tokens run eagerly (the default budget is 1,024). Up to it they replay a graph: an eager
# step of Llama-3-8B holds the GIL for its ~400 kernel launches (on the H200 at 64 streams, eager 2,048-token steps
# were a third of the step loop's CPU: 47.5 -> 29.0 us a generated token with them graphed, docs/benchmarks.md), for
# an activation pool ~80 MiB larger in every engine and standby and a larger eager warm-up on the fork path.
MAX_MIXED_GRAPH_TOKENS = 2048


def mixed_buckets(max_tokens: int) -> list[int]:
    """Step sizes (tokens) with a mixed-step graph: powers of two from 64, from 512 on the halves between them too
    (768, 1,536), and the budget itself, up to ``MAX_MIXED_GRAPH_TOKENS``. A step replays the smallest graph that
    holds it and pays for its padding rows in full; above 512 tokens a step's time grows with its rows (a 2,048-token
    graph of llama3-8b: 33 ms on the H200), so without the halves a 1,100-token step would spend 46% of its graph's
    rows on padding (28% with them; a third at most above 512)."""
    top = min(max_tokens, MAX_MIXED_GRAPH_TOKENS)
    sizes = {top}
    size = 64
    while size < top:
        sizes.update((size, size * 3 // 2) if size >= 512 else (size,))
        size *= 2
    return sorted(s for s in sizes if s <= top)


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [S, vocab] float32, row s for the step's s-th sequence (a graph's: valid until the next)
    argmax: torch.Tensor  # [S] int64, row-wise argmax of logits, on the device
    timing: StepTiming  # the device's time on the step's work
    all_logits: dict[int, torch.Tensor] = field(default_factory=dict)  # s -> [count, vocab]: every token's (asked)


class ModelRunner:
    def __init__(self, model: Transformer, kv: KVCache, max_seqs: int, max_tokens: int, max_model_len: int,
                 cuda_graphs: bool) -> None:  # fmt: skip
        self.model = model
        self.kv = kv
        self.device = model.device
        self.block_size = kv.block_size
        self.max_seqs = max_seqs
        self.max_tokens = max(max_tokens, max_seqs)  # a decode step of every sequence always fits
        self.width = math.ceil(max_model_len / self.block_size)  # block-table columns
        t, s = self.max_tokens, self.max_seqs
        # One int64 buffer: tokens, positions, slots [T]; logits rows [S]; query starts [S + 1]; lengths [S]; the
        # tokens to copy in on the device: where they go, which row of the earlier step's tokens [S each]; the
        # positions every sequence shares (StepBatch.shared_prefix).
        self.offsets = {"tokens": 0, "positions": t, "slots": 2 * t, "logits": 3 * t, "starts": 3 * t + s,
                        "lengths": 3 * t + 2 * s + 1, "into": 3 * t + 3 * s + 1, "from": 3 * t + 4 * s + 1,
                        "shared": 3 * t + 5 * s + 1, "end": 3 * t + 5 * s + 2}  # fmt: skip
        pin = self.device.type == "cuda"
        # On CPU the staged inputs are the model's inputs; on CUDA they are copied over once per step, from one of
        # two pinned buffers in turn (each with the event of its last upload).
        self._staging = [_Staging(self.offsets["end"], s, self.width, pin) for _ in range(2 if pin else 1)]
        self._turn = 0
        self.host, self.host_np, self.host_tables, self.host_tables_np = self._staging[0].buffers()
        self.meta = self.host if not pin else torch.zeros_like(self.host, device=self.device)
        self.tables = self.host_tables if not pin else torch.zeros_like(self.host_tables, device=self.device)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.use_graphs = cuda_graphs and self.device.type == "cuda"
        self.asynchronous = self.device.type == "cuda"  # run() returns before the device has done the step
        self.decode_sizes = decode_buckets(s)
        # decode steps whose attention walks their shared prefix once for several sequences (a launch, and a graph, of
        # their own): the batch sizes where that pays on this device
        self._shared_decode_pays: Callable[[int], bool] = lambda seqs: False
        if self.device.type == "cuda":
            from engine.native.fused_ops import sm_count
            from engine.native.triton_attention import shared_decode_pays

            self._shared_decode_pays = functools.partial(shared_decode_pays, kv_heads=kv.k.shape[2],
                                                         sms=sm_count(self.device), kv_dtype=kv.k.dtype)  # fmt: skip
        self.shared_decode_sizes = [b for b in self.decode_sizes if self._shared_decode_pays(b)]
        self.mixed_sizes = mixed_buckets(self.max_tokens)
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.capture_parts: dict[str, float] = {}  # host seconds spent warming up, capturing, replaying graphs
        self.shared = 0  # the last staged step's shared prefix (StepBatch.shared_prefix)
        self.own = 0  # and the most positions a sequence of it has past that prefix

    # -- inputs ----------------------------------------------------------------------------

    def _stage(self, step: list[Scheduled], tokens: int, seqs: int) -> int:
        """Write the step's inputs into a host buffer, padded to ``tokens`` rows and ``seqs`` sequences; returns
        how many tokens the device copies in (``_upload``)."""
        if len(self._staging) > 1:
            self._turn ^= 1
            staging = self._staging[self._turn]
            assert staging.uploaded is not None
            staging.uploaded.synchronize()  # its last upload is done: it may be written again
            self.host, self.host_np, self.host_tables, self.host_tables_np = staging.buffers()
        o, h, bs = self.offsets, self.host_np, self.block_size
        tok, pos, slot = h[o["tokens"] :], h[o["positions"] :], h[o["slots"] :]
        logits, starts, lengths = h[o["logits"] :], h[o["starts"] :], h[o["lengths"] :]
        into, source = h[o["into"] :], h[o["from"] :]
        t = copied = 0
        for i, work in enumerate(step):
            seq, start, n = work.seq, work.start, work.count
            table = seq.blocks
            if n == 1:
                if start < seq.known:
                    tok[t] = seq.token_at(start)
                else:  # drawn by the step before, still on the device
                    into[copied], source[copied] = t, seq.pending_row
                    copied += 1
                pos[t] = start
                slot[t] = table[start // bs] * bs + start % bs
            else:
                assert start + n <= seq.known, "only a decode step's one token can be pending"
                tok[t : t + n] = seq.token_slice(start, start + n)
                pos[t : t + n] = np.arange(start, start + n)
                slot[t : t + n] = slots_of(table, start, start + n, bs)
            starts[i] = t
            lengths[i] = start + n
            logits[i] = t + n - 1
            self.host_tables_np[i, : len(table)] = table
            t += n
        real = len(step)
        self.shared, self.own = self._shared_prefix(step)
        h[o["shared"]] = self.shared
        tok[t:tokens] = 0
        pos[t:tokens] = 0
        slot[t:tokens] = 0  # the null block
        starts[real : seqs + 1] = t
        lengths[real:seqs] = 0
        logits[real:seqs] = 0
        return copied

    def _shared_prefix(self, step: list[Scheduled]) -> tuple[int, int]:
        """The positions the kernel walks for a tile of query rows of several sequences at once (engine/native/
        triton_attention.py; a decode step's where _decode_walks_shared): the first whole blocks that all the step's
        sequences' staged tables hold alike, before each one's rows. 0 unless there are at least SHARED_MIN of them
        and no sequence's own positions past them outnumber them: a program walks those for each of its tile's
        sequences in turn (four decode rows' sequences, or a 16-token block's). With the most positions a sequence
        has past them (0, 0 for none)."""
        bs, seqs = self.block_size, len(step)
        width = min(work.start for work in step) // bs
        if seqs < 2 or width * bs < SHARED_MIN:
            return 0, 0
        tables = self.host_tables_np[:seqs, :width]
        if (tables[:, 0] != tables[0, 0]).any():  # most steps that share nothing: ~7 us instead of ~25 on a slow CPU
            return 0, 0
        alike = (tables == tables[0]).all(axis=0)
        shared = bs * (width if alike.all() else int(alike.argmin()))
        own = max(work.start + work.count for work in step) - shared
        return (shared, own) if shared >= SHARED_MIN and own <= shared else (0, 0)

    def _decode_walks_shared(self, seqs: int) -> bool:
        """Whether the decode step just staged, launched for ``seqs`` sequences, takes the shared prefix's walk."""
        return self.shared > 0 and self.own * SHARED_DECODE_OWN <= self.shared and self._shared_decode_pays(seqs)

    def _batch(self, tokens: int, seqs: int, max_query_len: int, decode_walks_shared: bool = False) -> StepBatch:
        o, m = self.offsets, self.meta
        return StepBatch(
            tokens=m[o["tokens"] : o["tokens"] + tokens],
            positions=m[o["positions"] : o["positions"] + tokens],
            slots=m[o["slots"] : o["slots"] + tokens],
            query_start=m[o["starts"] : o["starts"] + seqs + 1],
            seq_lens=m[o["lengths"] : o["lengths"] + seqs],
            block_tables=self.tables[:seqs],
            logits_indices=m[o["logits"] : o["logits"] + seqs],
            max_query_len=max_query_len,
            block_size=self.block_size,
            shared_prefix=m[o["shared"] : o["shared"] + 1],
            decode_walks_shared=decode_walks_shared,
        )

    def _upload(self, seqs: int, copied: int = 0, drawn: torch.Tensor | None = None) -> None:
        """The staged inputs to the device, then the ``copied`` pending tokens from ``drawn`` (the tokens of the
        step before) into their places."""
        if self.meta is not self.host:
            self.meta.copy_(self.host, non_blocking=True)
            self.tables[:seqs].copy_(self.host_tables[:seqs], non_blocking=True)
            uploaded = self._staging[self._turn].uploaded
            assert uploaded is not None
            uploaded.record()
        if copied:
            assert drawn is not None, "tokens pending, but no step drew them"
            o, m = self.offsets, self.meta
            into, source = m[o["into"] : o["into"] + copied], m[o["from"] : o["from"] + copied]
            m[o["tokens"] : o["positions"]].index_copy_(0, into, drawn.index_select(0, source))

    # -- running ----------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, step: list[Scheduled], every_token: frozenset[int] = frozenset(),
            drawn: torch.Tensor | None = None) -> StepOutput:  # fmt: skip
        """Launch the step; nothing waits for it. Logits of each scheduled sequence's last token this step
        (meaningful where ``samples``), and of every token of the sequences at the indexes ``every_token`` (prompt
        logprobs: such a step runs eagerly). ``drawn``: the tokens of the step before, by row, where the pending
        tokens of this step's sequences are (``Sequence.pending_row``)."""
        seqs = len(step)
        decode = all(w.count == 1 for w in step)
        tokens = sum(w.count for w in step)
        if self.use_graphs and not every_token and (decode or tokens <= self.mixed_sizes[-1]):
            if decode:
                key = ("decode", _bucket(self.decode_sizes, seqs))
            else:
                key = ("mixed", _bucket(self.mixed_sizes, tokens))
            n_tokens, n_seqs = (key[1], key[1]) if decode else (key[1], self.max_seqs)
            copied = self._stage(step, n_tokens, n_seqs)
            if decode and self._decode_walks_shared(n_seqs):
                key = ("shared", n_seqs)  # shared_decode_sizes: its graph was captured
            self._upload(n_seqs, copied, drawn)
            graph, logits, argmax = self.graphs[key]  # capture_all() made every one
            timing = StepTiming(self.device)
            graph.replay()
            timing.stop()
            return StepOutput(logits[:seqs], argmax[:seqs], timing)
        copied = self._stage(step, tokens, seqs)
        self._upload(seqs, copied, drawn)
        batch = self._batch(tokens, seqs, max(w.count for w in step), decode and self._decode_walks_shared(seqs))
        if self.device.type == "cpu":
            self._host_metadata(batch, step)
        timing = StepTiming(self.device)
        hidden = self.model.forward(batch, self.kv)
        logits = self.model.logits(hidden[batch.logits_indices])
        every: dict[int, torch.Tensor] = {}
        if every_token:
            starts = itertools.accumulate((w.count for w in step), initial=0)
            for i, (w, begin) in enumerate(zip(step, starts, strict=False)):
                if i in every_token:
                    every[i] = self.model.logits(hidden[begin : begin + w.count]).float()
        argmax = argmax_rows(logits)
        timing.stop()
        return StepOutput(logits, argmax, timing, every)

    @torch.inference_mode()
    def hidden_states(self, step: list[Scheduled]) -> torch.Tensor:
        """Hidden states [T, hidden] of every token of the step, eager (tests and benchmarks)."""
        tokens = sum(w.count for w in step)
        self._stage(step, tokens, len(step))
        self._upload(len(step))
        batch = self._batch(tokens, len(step), max(w.count for w in step))
        if self.device.type == "cpu":
            self._host_metadata(batch, step)
        return self.model.forward(batch, self.kv)

    def _forward(self, batch: StepBatch) -> torch.Tensor:
        hidden = self.model.forward(batch, self.kv)
        return self.model.logits(hidden[batch.logits_indices])

    def _host_metadata(self, batch: StepBatch, step: list[Scheduled]) -> None:
        """The CPU attention walks sequences on the host: each one's query rows and context slots."""
        bs = self.block_size
        batch.query_lens = [w.count for w in step]
        batch.context_slots = []
        for w in step:
            batch.context_slots.append(torch.from_numpy(slots_of(w.seq.blocks, 0, w.start + w.count, bs)))

    # -- CUDA graphs ---------------------------------------------------------------------------

    def capture_all(self, warm_up_each: bool = False) -> float:
        """Capture every graph now (largest first, sharing one memory pool); returns the seconds it took.

        Only the first graph of each kind runs eagerly before its capture (lazy inits); the others are
        captured directly (``warm_up_each`` warms every size up). Measured on the H200 (Triton 3.6,
        bench/graph_capture.py): Triton kernels compile and load inside a capture fine, and graphs
        equal the eager steps exactly. Every graph is uploaded to the device once all are captured
        (what its first launch would do, without running it). Captures begin without torch.cuda.graph's synchronize and
        empty_cache before each (the cached blocks it frees are allocated again by the next warm-up and
        capture, and each free waits for the device, which another engine keeps busy on the fork path).
        """
        begin = time.perf_counter()
        keys = sorted([("mixed", t) for t in self.mixed_sizes] + [("decode", b) for b in self.decode_sizes]
                      + [("shared", b) for b in self.shared_decode_sizes], key=lambda k: -k[1])  # fmt: skip
        seen: set[str] = set()
        with _no_garbage_collection():
            for key in keys:
                self._capture(key, warm_up=warm_up_each or key[0] not in seen)
                seen.add(key[0])
        t = time.perf_counter()
        torch.cuda.empty_cache()  # once: the warm-ups' blocks (a standby holds what its graphs need, no more)
        self.capture_parts["free"] = time.perf_counter() - t
        t = time.perf_counter()
        for key in keys:
            self._upload_graph(key)  # paid here, not by a request
        torch.cuda.synchronize()
        self.capture_parts["replay"] = time.perf_counter() - t
        return time.perf_counter() - begin

    def _upload_graph(self, key: tuple[str, int]) -> None:
        """Put the captured graph on the device as its first launch would, without running it (cuGraphUpload: on
        the H200 under load 0.014 s for 17 graphs against 0.17-0.25 s of first launches); a first launch on dummy
        inputs where the driver's bindings are missing."""
        graph = self.graphs[key][0]
        try:
            from common import cuda_vmm

            cu = cuda_vmm.driver()
            stream = cu.CUstream(torch.cuda.current_stream().cuda_stream)
            cuda_vmm.check(cu.cuGraphUpload(cu.CUgraphExec(graph.raw_cuda_graph_exec()), stream))
        except (ImportError, RuntimeError, AttributeError):
            self._dummy_inputs(key)
            graph.replay()

    def _dummy_inputs(self, key: tuple[str, int]) -> StepBatch:
        """Inputs for a graph's capture and first launch, written on the device in stream order: every
        row a query of one empty-context sequence in the null block."""
        kind, size = key
        tokens, seqs, max_query_len = (size, self.max_seqs, size) if kind == "mixed" else (size, size, 1)
        o, m = self.offsets, self.meta
        m.zero_()
        m[o["starts"] : o["starts"] + seqs + 1] = torch.arange(seqs + 1, device=self.device).clamp_(max=tokens)
        m[o["lengths"] : o["lengths"] + seqs] = 1
        self.tables[:seqs].zero_()
        return self._batch(tokens, seqs, max_query_len, decode_walks_shared=kind == "shared")

    def _capture(self, key: tuple[str, int], warm_up: bool) -> None:
        parts, t = self.capture_parts, time.perf_counter()
        batch = self._dummy_inputs(key)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            logits = self._forward(batch)
            return logits, argmax_rows(logits)

        parts["inputs"] = parts.get("inputs", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        side = _side_stream(self.device)
        if warm_up:  # on the capture stream first (lazy inits, its cuBLAS workspace), so capture records kernels
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
        parts["warmup"] = parts.get("warmup", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())  # the dummy inputs, written in stream order
        with torch.cuda.stream(side):
            graph.capture_begin(pool=self.pool)
            try:
                logits, argmax = run()
            finally:
                graph.capture_end()
        parts["capture"] = parts.get("capture", 0.0) + time.perf_counter() - t
        self.graphs[key] = (graph, logits, argmax)


@contextlib.contextmanager
def _no_garbage_collection() -> Iterator[None]:
    """Python's cyclic collector off while graphs are captured. A collection inside a capture can free CUDA graphs
    left unreachable in reference cycles (another engine's, in a process that built several: the GPU tests do), and
    destroying a graph while a stream captures in global mode invalidates that capture
    (cudaErrorStreamCaptureInvalidated; pytorch/pytorch#161037 describes it). torch.cuda.graph collected before its
    captures; these call capture_begin themselves."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StepTiming:
    """The device's time on one step: CUDA events around its work on the current stream (read once the step is
    done), or on the CPU, where the work is done when the call returns, the host's clock. Started when made."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._began = time.perf_counter()
        self._ended = self._began

    def stop(self) -> None:
        if self.cuda:
            self._events[1].record()
        else:
            self._ended = time.perf_counter()

    def done(self) -> bool:
        """Whether the device has done the step (without waiting)."""
        return not self.cuda or self._events[1].query()

    def seconds(self) -> float:
        """The step's time, once it is done (waited for here: a step that draws no token, a prompt's partial chunk,
        was not waited for by anything else)."""
        if self.cuda:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1e3
        return self._ended - self._began


class _Staging:
    """A host buffer of a step's inputs and block tables (pinned on CUDA), and the event of its last upload."""

    def __init__(self, size: int, seqs: int, width: int, pin: bool) -> None:
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=pin)
        self.tables = torch.zeros(seqs, width, dtype=torch.int32, pin_memory=pin)
        self.uploaded = torch.cuda.Event() if pin else None

    def buffers(self) -> tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray]:
        return self.host, self.host.numpy(), self.tables, self.tables.numpy()


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream warm-ups and captures run on: one per device and process, since torch keeps a cuBLAS
    workspace (32 MiB on the H200) for every stream that ever ran a GEMM."""
    return torch.cuda.Stream(device=device)


def _bucket(sizes: list[int], n: int) -> int:
    for size in sizes:
        if size >= n:
            return size
    raise ValueError(f"a step of {n} exceeds the largest graph ({sizes[-1]})")
