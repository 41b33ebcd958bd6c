"""A reserved KV cache committed in stripes (engine/native/kv_memory.py): where a stripe's blocks lie, how block
counts and stripes meet a mapping's granularity, and the allocator handing out only committed blocks. (The CUDA
mappings themselves: tests/test_gpu.py; an engine growing its blocks while it serves: tests/test_engine_model.py.)"""

from __future__ import annotations

import itertools

import torch

from cache.checkpoint.architecture import ModelShape
from engine.native.kv_cache import BlockAllocator, KVCacheSpec
from engine.native.kv_memory import KVGeometry, block_multiple

MIB = 1 << 20
# Llama-3-8B in bf16: one block of 16 positions of one layer's keys is 16 x 8 heads x 128 x 2 bytes = 32 KiB.
LLAMA_BLOCK = 16 * 8 * 128 * 2


def test_a_stripe_is_one_range_per_layer_of_keys_and_of_values() -> None:
    geometry = KVGeometry(layers=2, blocks=8, block_bytes=100)
    assert geometry.half == 1600
    # Blocks 2..4 of layer 0 and layer 1 keys, then the same of the values (which begin at half).
    assert geometry.ranges(2, 5) == [(200, 300), (1000, 300), (1800, 300), (2600, 300)]
    assert geometry.stripes(stripe_bytes=2 * 2 * 100 * 3, multiple=1) == [(0, 3), (3, 6), (6, 8)]
    assert geometry.stripes(stripe_bytes=2 * 2 * 100 * 3, multiple=2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert geometry.stripes(stripe_bytes=1, multiple=4) == [(0, 4), (4, 8)]  # at least one multiple
    # The first of first_bytes (committed with the reservation), then from stripe_bytes each doubles, up to
    # max_bytes: fewer allocations for the driver to free at exit.
    long = KVGeometry(layers=1, blocks=40, block_bytes=1)
    assert long.stripes(stripe_bytes=2, multiple=1, first_bytes=4, max_bytes=8) == [
        (0, 2), (2, 3), (3, 5), (5, 9), (9, 13), (13, 17), (17, 21), (21, 25), (25, 29), (29, 33), (33, 37),
        (37, 40)]  # fmt: skip


def test_block_counts_and_stripes_meet_the_granularity_of_a_mapping() -> None:
    """Every range a stripe maps begins and ends on a 2 MiB boundary (the H200's granularity) when the cache's
    blocks and the stripes' bounds are multiples of block_multiple."""
    assert block_multiple(LLAMA_BLOCK, 2 * MIB) == 64
    assert block_multiple(16 * 3 * 64 * 2, 2 * MIB) == 1024  # SmolLM2-135M: 6 KiB blocks
    assert block_multiple(100, 1) == 1
    shape = ModelShape.from_config({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                    "vocab_size": 128256})  # fmt: skip
    spec = KVCacheSpec.plan(shape, torch.bfloat16, 256, 8192, 50 * 10**9, 16, multiple=64)
    assert spec.blocks % 64 == 0 and spec.total_bytes <= 50 * 10**9
    geometry = KVGeometry(shape.layers, spec.blocks, LLAMA_BLOCK)
    stripes = geometry.stripes(1 << 30, 64)
    assert stripes[0][0] == 0 and stripes[-1][1] == spec.blocks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(stripes))
    assert (stripes[0][1] - stripes[0][0]) * 2 * 32 * LLAMA_BLOCK == 1 << 30  # 1 GiB a stripe
    for first, end in stripes:
        assert all(offset % (2 * MIB) == 0 and size % (2 * MIB) == 0 for offset, size in geometry.ranges(first, end))
    # Without a budget the multiple rounds up (more blocks than asked for), within one down.
    assert KVCacheSpec.plan(shape, torch.bfloat16, 4, 100, None, 16, multiple=64).blocks == 64


def test_the_allocator_hands_out_committed_blocks_first_and_the_rest_as_they_come() -> None:
    allocator = BlockAllocator(KVCacheSpec(blocks=12, block_size=4, bytes_per_token=1))
    allocator.limit(4)  # blocks 1-3 committed (0 is the null block)
    table: list[int] = []
    assert allocator.free == 3 and allocator.grow(table, 12) and table == [1, 2, 3]
    assert not allocator.grow(table, 13)  # block 4 is not committed yet
    allocator.add(4, 8)
    assert allocator.free == 4 and allocator.grow(table, 16) and table == [1, 2, 3, 4]
    allocator.release(table)
    allocator.add(8, 12)
    other: list[int] = []
    assert allocator.free == 11 and allocator.grow(other, 44) and sorted(other) == list(range(1, 12))
