"""Layerwise loads (the connector's ``use_layerwise``): one task per layer, waited for layer by layer.

Also the GPU half of it: ``CudaKVCache``'s per-layer objects, dumped and loaded through the daemon's
GPU path with the fake CUDA backend (no GPU needed).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import pytest
from support.blocks import NS
from support.fake_cuda import FakeCuda
from support.gpu_daemon import InProcessDaemon, export

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient
from ucm_client.layerwise import LayerwiseLoad
from ucm_client.vllm.cuda_kv import CudaKVCache
from ucm_client.vllm.identity import layer_key


@pytest.mark.slow
def test_layers_load_as_separate_tasks_and_are_waited_one_by_one(client: UcmClient) -> None:
    layers, nblocks, page = 4, 6, 32 << 10
    block_keys = [os.urandom(32) for _ in range(nblocks)]
    assert len({layer_key(k, layer) for k in block_keys for layer in range(layers)}) == layers * nblocks
    with SharedBuffer(layers * nblocks * page) as src, SharedBuffer(layers * nblocks * page) as dst:
        rs, rd = client.register(src), client.register(dst)
        src.buf[:] = os.urandom(src.size)

        def per_layer(region: int) -> list[list[BlockIO]]:
            return [
                [
                    BlockIO(layer_key(k, layer), (Segment(region, (layer * nblocks + b) * page, page),))
                    for b, k in enumerate(block_keys)
                ]
                for layer in range(layers)
            ]

        for blocks in per_layer(rs):  # saved layer by layer, as save_kv_layer would
            assert client.wait(client.dump(NS, blocks), 10).ok
        # The last layer's blocks are missing for one block: only that layer reports it.
        client.delete(NS, [layer_key(block_keys[2], layers - 1)])
        load = LayerwiseLoad(client, NS, [*per_layer(rd)[:-1], per_layer(rd)[-1]])
        assert len([t for t in load.tasks if t is not None]) == layers  # all submitted up front
        for layer in range(layers):
            result = load.wait_layer(layer, 10)
            assert result is not None and result.done
            expect = [BlockState.OK] * nblocks
            if layer == layers - 1:
                expect[2] = BlockState.MISSING
            assert result.states == expect
            assert load.wait_layer(layer, 10) is result  # waited once, answered from memory after
            start, stop = layer * nblocks * page, (layer + 1) * nblocks * page
            if layer < layers - 1:
                assert bytes(dst.buf[start:stop]) == bytes(src.buf[start:stop])
        empty = LayerwiseLoad(client, NS, [[], per_layer(rd)[1]])
        assert empty.wait_layer(0, 1) is None
        assert [r is None for r in empty.wait_all(10)] == [True, False]


# ---------------------------------------------------------------- vLLM's GPU KV cache, layer by layer

LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
KV_BLOCKS, KV_SHAPE = 6, (2, 16, 2, 8)  # [blocks, K/V, block_size, heads, head_size], float16
PAGE = 2 * 16 * 2 * 8 * 2


def _layer_views(mem: Any) -> dict[str, Any]:
    """vLLM's layer tensors as views of one storage (here host memory a fake device allocation owns)."""
    torch = pytest.importorskip("torch")
    raw = torch.frombuffer(mem, dtype=torch.int8)
    per_layer = KV_BLOCKS * PAGE
    return {
        name: raw[i * per_layer : (i + 1) * per_layer].view(torch.float16).view(KV_BLOCKS, *KV_SHAPE)
        for i, name in enumerate(LAYER_NAMES)
    }


def test_cuda_kv_cache_layer_objects_are_the_pages_of_a_block() -> None:
    _handle, mem = FakeCuda.allocate(len(LAYER_NAMES) * KV_BLOCKS * PAGE)
    kv = CudaKVCache(_layer_views(mem))
    kv.regions = {ptr: 9 for ptr in kv.storages}  # what register() would record
    whole = kv.segments(4)
    per_layer = [kv.layer_segments(name, 4) for name in LAYER_NAMES]
    assert [len(s) for s in per_layer] == [1, 1, 1]
    assert tuple(s for segs in per_layer for s in segs) == whole  # the same bytes, one object each
    assert sum(s[0].length for s in per_layer) == kv.block_bytes
    assert [b.key for b in kv.layer_blocks(LAYER_NAMES[1], [b"a" * 32, b"b" * 32], [0, 5])] == [
        b"a" * 32,
        b"b" * 32,
    ]
    with pytest.raises(IndexError):
        kv.layer_segments(LAYER_NAMES[0], KV_BLOCKS)


def test_cuda_kv_cache_layerwise_dump_and_load_through_the_gpu_path(tmp_path: Path) -> None:
    """Per-layer dumps from one fake-GPU KV cache, a LayerwiseLoad into another: bytes land per layer.

    The fake moves bytes only when the daemon waits for its copy events, so a layer reported loaded
    before its copies completed would compare wrong here.
    """
    fake = FakeCuda()
    size = len(LAYER_NAMES) * KV_BLOCKS * PAGE
    (hs, src), (hd, dst) = FakeCuda.allocate(size), FakeCuda.allocate(size)
    memoryview(src).cast("B")[:] = os.urandom(size)
    kv_src, kv_dst = CudaKVCache(_layer_views(src)), CudaKVCache(_layer_views(dst))
    keys = [os.urandom(32) for _ in range(3)]
    with InProcessDaemon(tmp_path / "ucm", fake) as daemon, UcmClient(daemon.target) as client:
        (ptr_src,) = kv_src.storages
        (ptr_dst,) = kv_dst.storages
        kv_src.regions = {ptr_src: client.register_cuda(export(fake, hs, size), label="src")}
        kv_dst.regions = {ptr_dst: client.register_cuda(export(fake, hd, size), label="dst")}
        for layer, name in enumerate(LAYER_NAMES):
            blocks = kv_src.layer_blocks(name, [layer_key(k, layer) for k in keys], [1, 2, 3])
            assert client.wait(client.dump(NS, blocks), 30).ok
        load = LayerwiseLoad(
            client,
            NS,
            [
                kv_dst.layer_blocks(name, [layer_key(k, layer) for k in keys], [3, 4, 5])
                for layer, name in enumerate(LAYER_NAMES)
            ],
        )
        for layer, name in enumerate(LAYER_NAMES):
            result = load.wait_layer(layer, 30)
            assert result is not None and result.ok
            src_pages = [_page(kv_src, name, b) for b in (1, 2, 3)]
            assert [_page(kv_dst, name, b) for b in (3, 4, 5)] == src_pages


def _page(kv: CudaKVCache, name: str, block: int) -> bytes:
    page = kv.pages_by_name[name]
    return ctypes.string_at(page.storage + page.start + block * page.stride, page.length)
