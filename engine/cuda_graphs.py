"""CUDA graphs for decode: one graph per (batch bucket, attention span bucket), captured on first use.

A decode step is hundreds of small kernels; replaying a captured graph removes their
launch cost, which otherwise dominates small-batch decode. Inputs go into static
buffers with one host-to-device copy from pinned memory; padded rows decode a dummy token
in slots that hold no running sequence.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache, next_pow2, span_bucket
from engine.model import Transformer


class GraphedDecode:
    def __init__(self, model: Transformer, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.max_batch = kv.spec.slots
        device = model.device
        # Row 0: tokens, row 1: positions. Staged in pinned memory, copied in one transfer.
        self.staged = torch.zeros(2, self.max_batch, dtype=torch.long, pin_memory=True)
        self.staged_np = self.staged.numpy()  # plain stores from Python lists, no tensor per step
        self.inputs = torch.zeros(2, self.max_batch, dtype=torch.long, device=device)
        self.tokens, self.positions = self.inputs[0], self.inputs[1]
        # The graph also takes each row's argmax and copies it back to pinned memory itself.
        self.argmax = torch.zeros(self.max_batch, dtype=torch.long, pin_memory=True)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def buckets(self, batch: int, longest: int) -> tuple[int, int]:
        return min(self.max_batch, next_pow2(batch)), span_bucket(longest, self.kv.spec.max_len)

    def __call__(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Logits [B, vocab] and their row-wise argmax for B sequences in slots 0..B-1 (token b at positions[b])."""
        b = len(tokens)
        bucket = self.buckets(b, max(positions) + 1)
        # The previous step's copy has completed: its results were read back before this call.
        self.staged_np[0, :b] = tokens
        self.staged_np[1, :b] = positions
        self.staged_np[:, b : bucket[0]] = 0
        self.inputs[:, : bucket[0]].copy_(self.staged[:, : bucket[0]], non_blocking=True)
        entry = self.graphs.get(bucket) or self._capture(*bucket)
        entry[0].replay()
        torch.cuda.current_stream().synchronize()
        return entry[1][:b], self.argmax[:b].tolist()

    def _run(self, batch: int, span: int) -> torch.Tensor:
        hidden = self.model.decode(self.tokens[:batch], self.positions[:batch], self.kv, span)
        logits = self.model.logits(hidden)
        self.argmax[:batch].copy_(logits.argmax(dim=-1), non_blocking=True)
        return logits

    def _capture(self, batch: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream first (lazy inits, Triton compiles) so capture records only kernels.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._run(batch, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._run(batch, span)
        self.graphs[(batch, span)] = (graph, out)
        return graph, out
