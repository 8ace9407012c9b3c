"""GPU data path on a real CUDA device: torch tensors shared by IPC with a ucm-server process.

Skipped (reason "no CUDA device") where there is no GPU, torch CUDA or cupy; ``benchmarks/gpu_check.sh``
runs the same round trip plus the throughput measurement on a GPU machine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from ucm_client import BlockIO, BlockState, Segment, UcmClient, key_digest, namespace_id
from ucm_server.testing.daemon import DaemonProcess


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available()) and importlib.util.find_spec("cupy") is not None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _cuda(), reason="no CUDA device")]

NS = namespace_id(model="gpu-real", dtype="uint8")
BLOCK = 2 << 20


@pytest.fixture
def gpu_daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    args = ["--cache-capacity", "512MiB", "--cache-page-size", "2MiB", "--gpu", "on"]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        yield d


def test_round_trip_between_two_gpu_tensors(gpu_daemon: DaemonProcess) -> None:
    import torch

    from ucm_client.cuda_ipc import producers_done

    n = 64
    src = torch.randint(0, 256, (n * BLOCK,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(n * BLOCK, dtype=torch.uint8, device="cuda")
    with UcmClient(gpu_daemon.target) as client:
        rs = client.register_cuda(src, label="src")
        rd = client.register_cuda(dst, label="dst")
        keys = [key_digest("gpu", i) for i in range(n)]
        producers_done()
        dump = client.wait(
            client.dump(NS, [BlockIO(k, (Segment(rs, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]), 60
        )
        assert dump.ok, dump.reasons
        load = client.wait(
            client.load(NS, [BlockIO(k, (Segment(rd, i * BLOCK, BLOCK),)) for i, k in enumerate(keys)]), 60
        )
        assert load.ok, load.reasons
        assert torch.equal(src, dst)
        missing = client.wait(client.load(NS, [BlockIO(key_digest("absent"), (Segment(rd, 0, BLOCK),))]), 10)
        assert missing.states == [BlockState.MISSING]


def test_tensor_inside_a_larger_allocation(gpu_daemon: DaemonProcess) -> None:
    """A view into the middle of a caching-allocator segment: the offset travels with the handle."""
    import torch

    big = torch.randint(0, 256, (8 * BLOCK,), dtype=torch.uint8, device="cuda")
    part = big[3 * BLOCK :]
    out = torch.zeros(BLOCK, dtype=torch.uint8, device="cuda")
    with UcmClient(gpu_daemon.target) as client:
        rp = client.register_cuda(part.clone())  # its own storage
        ro = client.register_cuda(out)
        key = key_digest("inner")
        assert client.wait(client.dump(NS, [BlockIO(key, (Segment(rp, BLOCK, BLOCK),))]), 30).ok
        assert client.wait(client.load(NS, [BlockIO(key, (Segment(ro, 0, BLOCK),))]), 30).ok
        assert torch.equal(out, big[4 * BLOCK : 5 * BLOCK])


def test_vllm_style_kv_cache_round_trip(gpu_daemon: DaemonProcess) -> None:
    """Per-layer CUDA KV tensors registered with CudaKVCache; blocks saved, wiped, loaded back."""
    import torch

    from ucm_client.cuda_ipc import producers_done
    from ucm_client.vllm.cuda_kv import CudaKVCache

    layers, blocks, shape = 4, 16, (2, 16, 8, 128)
    caches = {f"l{i}": torch.randn(blocks, *shape, dtype=torch.float16, device="cuda") for i in range(layers)}
    before = {name: t.clone() for name, t in caches.items()}
    kv = CudaKVCache(caches)
    keys = [key_digest("kv", b) for b in range(blocks)]
    with UcmClient(gpu_daemon.target) as client:
        kv.register(client)
        producers_done()
        assert client.wait(client.dump(NS, kv.blocks(keys, range(blocks))), 60).ok
        for t in caches.values():
            t.zero_()
        torch.cuda.synchronize()
        assert client.wait(client.load(NS, kv.blocks(keys[::-1], range(blocks))), 60).ok
        for name, t in caches.items():
            assert torch.equal(t, before[name].flip(0)), name


def test_layerwise_round_trip_layer_by_layer(gpu_daemon: DaemonProcess) -> None:
    """``use_layerwise`` on a real GPU: per-layer objects dumped, then loaded one task per layer, each
    layer's bytes in place once its own wait returns (the later layers may still be in flight)."""
    import torch

    from ucm_client.cuda_ipc import producers_done
    from ucm_client.layerwise import LayerwiseLoad
    from ucm_client.vllm.cuda_kv import CudaKVCache
    from ucm_client.vllm.identity import layer_key

    layers, blocks, shape = 4, 16, (2, 16, 8, 128)
    caches = {f"l{i}": torch.randn(blocks, *shape, dtype=torch.float16, device="cuda") for i in range(layers)}
    before = {name: t.clone() for name, t in caches.items()}
    kv = CudaKVCache(caches)
    keys = [key_digest("kv-layerwise", b) for b in range(blocks)]
    names = list(caches)

    def per_layer(ids: list[int]) -> list[list[BlockIO]]:
        return [
            kv.layer_blocks(name, [layer_key(keys[b], i) for b in ids], ids) for i, name in enumerate(names)
        ]

    with UcmClient(gpu_daemon.target) as client:
        kv.register(client)
        producers_done()
        for layer_blocks in per_layer(list(range(blocks))):
            assert client.wait(client.dump(NS, layer_blocks), 60).ok
        for t in caches.values():
            t.zero_()
        torch.cuda.synchronize()
        load = LayerwiseLoad(client, NS, per_layer(list(range(blocks))))
        for i, name in enumerate(names):
            result = load.wait_layer(i, 60)
            assert result is not None and result.ok, (name, result)
            assert torch.equal(caches[name], before[name]), name
