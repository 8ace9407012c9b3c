"""``CudaKVCache``: the segments of vLLM's KV cache blocks, checked on CPU tensors against the staging path.

Registration needs a GPU; the layout does not, and it must match what the shared-memory staging path
stores (``StagingArea``), so that a block saved one way loads the other way.
"""

from __future__ import annotations

import ctypes

import pytest

torch = pytest.importorskip("torch")

from ucm_client.vllm.cuda_kv import CudaKVCache  # noqa: E402
from ucm_client.vllm.staging import StagingArea  # noqa: E402


def _bytes_of(kv: CudaKVCache, block_id: int) -> bytes:
    base = {region: storage for storage, region in kv.regions.items()}
    return b"".join(ctypes.string_at(base[s.region] + s.offset, s.length) for s in kv.segments(block_id))


@pytest.mark.parametrize("shared", [False, True], ids=["storage-per-layer", "one-storage"])
def test_block_bytes_match_the_staging_layout(shared: bool) -> None:
    layers, blocks, shape = 3, 5, (2, 16, 2, 8)  # [blocks, 2 (K/V), block_size, heads, head_size]
    if shared:
        raw = torch.randint(-128, 127, (layers * blocks * 2 * 16 * 2 * 8 * 2,), dtype=torch.int8)
        per_layer = raw.numel() // layers
        caches = {
            f"layer.{i}": raw[i * per_layer : (i + 1) * per_layer].view(torch.float16).view(blocks, *shape)
            for i in range(layers)
        }
    else:
        caches = {f"layer.{i}": torch.randn(blocks, *shape, dtype=torch.float16) for i in range(layers)}
    kv = CudaKVCache(caches)
    assert len(kv.storages) == (1 if shared else layers)
    kv.regions = {ptr: n + 1 for n, ptr in enumerate(kv.storages)}  # what register() would record
    staging = StagingArea(caches, blocks * kv.block_bytes)
    assert kv.block_bytes == staging.block_bytes and kv.num_blocks == blocks
    for b in range(blocks):
        staging.from_kv([b], [b])
        assert _bytes_of(kv, b) == staging.slot_bytes(b)
    segments = kv.segments(1)
    assert len(segments) == layers  # block-major within a layer: pages of one block are apart
    assert sum(s.length for s in segments) == kv.block_bytes
    with pytest.raises(IndexError):
        kv.segments(blocks)
    assert [b.key for b in kv.blocks([b"k" * 32, b"j" * 32], [0, 4])] == [b"k" * 32, b"j" * 32]
    staging.buffer.close()


def test_adjacent_pages_of_one_storage_merge() -> None:
    """A layout whose layers are adjacent for each block gives one segment per block."""
    raw = torch.zeros(4 * 2 * 64, dtype=torch.int8).view(4, 2, 64)  # [blocks, layers, page]
    caches = {"a": raw[:, 0, :], "b": raw[:, 1, :]}
    kv = CudaKVCache(caches)
    kv.regions = {ptr: 7 for ptr in kv.storages}
    assert kv.segments(2) == (kv.segments(2)[0],)
    assert kv.segments(2)[0].length == 128 and kv.segments(2)[0].offset == 2 * 128
