"""CUDA graphs for decode: one graph per (batch bucket, attention span bucket), captured on first use.

A decode step is hundreds of small kernels; replaying a captured graph removes their
launch cost, which otherwise dominates small-batch decode. Inputs are copied into static
buffers; padded rows decode a dummy token in slots that hold no running sequence.
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
        self.tokens = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def buckets(self, batch: int, longest: int) -> tuple[int, int]:
        return min(self.max_batch, next_pow2(batch)), span_bucket(longest, self.kv.spec.max_len)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, longest: int) -> torch.Tensor:
        """Logits [B, vocab] for B sequences in slots 0..B-1; ``longest`` >= max(positions) + 1."""
        b = tokens.shape[0]
        bucket = self.buckets(b, longest)
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)
        self.tokens[b : bucket[0]].zero_()
        self.positions[b : bucket[0]].zero_()
        entry = self.graphs.get(bucket) or self._capture(*bucket)
        entry[0].replay()
        return entry[1][:b]

    def _run(self, batch: int, span: int) -> torch.Tensor:
        hidden = self.model.decode(self.tokens[:batch], self.positions[:batch], self.kv, span)
        return self.model.logits(hidden)

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
