"""The worker reaches the KV cache through one ``KVAccess`` chosen once, so no hook re-decides
how to reach it; the staging path keeps its exact behaviour.

A real ``ucm-server`` process and a real ``UcmWorker`` over CPU tensors laid out as vLLM's CPU backend
lays them out. What is checked is what vLLM would notice: the bytes the daemon stores, the bytes that
land in the KV cache, which blocks are reported as load errors, and when a save is skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ucm_client import BlockIO, UcmClient
from ucm_client.cuda_ipc import CudaUnavailable, StreamMark
from ucm_client.vllm import transfers as transfers_module
from ucm_client.vllm.config import ConnectorConfig
from ucm_client.vllm.identity import KeySpace, layer_order
from ucm_client.vllm.kv_access import (
    KVAccess,
    LayerKVAccess,
    SharedMemoryKV,
    StagedKV,
    choose_kv_access,
)
from ucm_client.vllm.kv_memory import ShmAllocation
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.worker import UcmWorker
from ucm_server.testing.daemon import DaemonProcess

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 2, 8, 2, 16, 32
PAGE = HEADS * BLOCK * 2 * HEAD * 4
RAW_BYTES = LAYERS * BLOCKS * PAGE
SLOTS = 2
STAGING_GIB = SLOTS * LAYERS * PAGE / (1 << 30)  # exactly two block-sized slots
KEYSPACE = KeySpace(fields=(("model", "kv-access-test"),), tp_size=1)
NS = KEYSPACE.namespace(0)
CPU = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))


def _views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's CPU (LBHNC) layout: layer-outermost, one [B, H, N, 2*D] float32 view per layer."""
    flat = raw.view(torch.float32).view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD)
    return {f"model.layers.{i}.self_attn.attn": flat[i] for i in range(LAYERS)}


def _fill(views: dict[str, torch.Tensor], block: int, seed: int) -> None:
    for i, view in enumerate(views.values()):
        view[block].copy_(
            torch.randn(view[block].shape, generator=torch.Generator().manual_seed(seed * 10 + i))
        )


def _block(views: dict[str, torch.Tensor], block: int) -> bytes:
    """A block as every path stores it: each layer's page, in address order."""
    return b"".join(view[block].numpy().tobytes() for view in views.values())


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path / "ucm") as d:
        yield d


def _staged_worker(daemon: DaemonProcess, views: dict[str, torch.Tensor]) -> UcmWorker:
    config = ConnectorConfig(target=daemon.target, zero_copy=False, staging_buffer_gib=STAGING_GIB)
    worker = UcmWorker(CPU, KEYSPACE, config, tp_rank=0)
    worker.register_kv_caches(views)
    assert worker.staging is not None and worker.memory is None
    assert worker.staging.num_slots == SLOTS
    return worker


def _save_and_finish(worker: UcmWorker, transfer: BlockTransfer) -> None:
    worker.save(UcmConnectorMetadata(saves=[transfer]))
    deadline = time.monotonic() + 60  # a hang guard: the first save also connects
    while (worker.get_finished({transfer.req_id})[0] or set()) != {transfer.req_id}:
        assert time.monotonic() < deadline, f"save of {transfer.req_id} never finished"
        time.sleep(0.02)


def test_staged_save_stores_the_bytes_of_the_step_even_if_vllm_reuses_the_blocks_at_once(
    daemon: DaemonProcess,
) -> None:
    views = _views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    for b in (1, 2):
        _fill(views, b, seed=b)
    expected = [_block(views, 1), _block(views, 2)]
    worker = _staged_worker(daemon, views)
    try:
        worker.save(UcmConnectorMetadata(saves=[BlockTransfer("r", (1, 2), (b"a" * 32, b"b" * 32))]))
        for b in (1, 2):
            _fill(views, b, seed=99)  # vLLM writes new tokens into the freed blocks right away
        deadline = time.monotonic() + 60  # a hang guard: the first save also connects
        while (worker.get_finished({"r"})[0] or set()) != {"r"}:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with UcmClient(daemon.target) as client:
            assert client.get_blocks(NS, [b"a" * 32, b"b" * 32]) == expected
        stats = worker.take_stats()
        assert stats is not None and (stats.data["save_blocks"], stats.data["save_failed_blocks"]) == (2, 0)
        assert worker.staging is not None and worker.staging.free_slots == SLOTS  # slots given back
    finally:
        worker.shutdown()
    assert daemon.healthy()


def test_staged_load_writes_only_the_blocks_that_loaded(daemon: DaemonProcess) -> None:
    source = _views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    _fill(source, 1, seed=1)
    with UcmClient(daemon.target) as client:
        assert client.put_blocks(NS, [(b"a" * 32, _block(source, 1))]).ok
    views = _views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    _fill(views, 4, seed=7)
    untouched = _block(views, 4)
    worker = _staged_worker(daemon, views)
    try:
        load = BlockTransfer("q", (3, 4), (b"a" * 32, b"m" * 32))  # "m": never stored
        worker.start_load(UcmConnectorMetadata(loads=[load]))
        worker.wait_for_layer_load(None)
        assert _block(views, 3) == _block(source, 1)
        assert _block(views, 4) == untouched, "a block that failed to load was overwritten"
        assert worker.take_load_errors() == {4}
        assert worker.staging is not None and worker.staging.free_slots == SLOTS
    finally:
        worker.shutdown()


def test_staging_full_skips_the_save_and_keeps_working(daemon: DaemonProcess, caplog: Any) -> None:
    views = _views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    for b in range(4):
        _fill(views, b, seed=b)
    worker = _staged_worker(daemon, views)
    try:
        keys = tuple(bytes([65 + i]) * 32 for i in range(3))
        with caplog.at_level(logging.WARNING, logger="vllm.ucm_connector"):
            _save_and_finish(worker, BlockTransfer("big", (0, 1, 2), keys))  # 3 blocks, 2 slots
        assert "staging buffer full, save of step-save skipped" in caplog.text
        stats = worker.take_stats()
        assert stats is not None and (stats.data["save_blocks"], stats.data["save_failed_blocks"]) == (0, 3)
        with UcmClient(daemon.target) as client:
            assert client.lookup(NS, list(keys)).hit_prefix == 0
            _save_and_finish(worker, BlockTransfer("fits", (3,), (b"z" * 32,)))
            assert client.get_blocks(NS, [b"z" * 32]) == [_block(views, 3)]
    finally:
        worker.shutdown()
    assert daemon.healthy()


class RefusedCudaIpcDouble:
    """Test double for a CUDA KV cache whose IPC export the driver refuses (no GPU here to refuse it)."""

    label = "vllm-kv-cache"
    block_bytes = LAYERS * PAGE

    def register(self, client: UcmClient) -> None:
        raise CudaUnavailable("CUDA IPC refused (test double)")

    def regions(self) -> list[int]:
        return []

    def acquire(self, block_ids: Any, *, save: bool) -> list[int] | None:
        raise AssertionError("a refused access must not be used")

    def blocks(self, keys: Any, block_ids: Any, slots: Any) -> list[BlockIO]:
        raise AssertionError("a refused access must not be used")

    def finish(self, slots: Any, ids: Any, ok: Any, *, load: bool) -> None:
        raise AssertionError("a refused access must not be used")

    def before_dump(self) -> None:
        return None

    def mark(self) -> StreamMark | None:
        return None


def test_refused_cuda_ipc_falls_back_to_staging_once(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    refused = RefusedCudaIpcDouble()
    assert isinstance(refused, KVAccess)
    monkeypatch.setattr(transfers_module, "choose_kv_access", lambda *a, **kw: refused)
    views = _views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    _fill(views, 2, seed=2)
    config = ConnectorConfig(target=daemon.target, zero_copy=True, staging_buffer_gib=STAGING_GIB)
    worker = UcmWorker(CPU, KEYSPACE, config, tp_rank=0)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.ucm_connector"):
            worker.register_kv_caches(views)  # the daemon is up: registers (and falls back) now
        assert "CUDA IPC refused" in caplog.text and "using a staging buffer instead" in caplog.text
        assert worker.staging is not None
        _save_and_finish(worker, BlockTransfer("r", (2,), (b"c" * 32,)))
        with UcmClient(daemon.target) as client:
            assert client.get_blocks(NS, [b"c" * 32]) == [_block(views, 2)]
    finally:
        worker.shutdown()


def test_the_choice_and_its_capabilities() -> None:
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(RAW_BYTES, dtype=torch.int8)
    views = _views(raw)

    def choose(*, zero_copy: bool, layerwise: bool) -> KVAccess | str:
        return choose_kv_access(
            views,
            zero_copy=zero_copy,
            staging_bytes=1 << 20,
            layerwise=layerwise,
            alloc=alloc,
            vllm_config=CPU,
        )

    zero_copy = choose(zero_copy=True, layerwise=True)
    assert isinstance(zero_copy, SharedMemoryKV) and isinstance(zero_copy, LayerKVAccess)
    assert zero_copy.memory.buffer is alloc.buffer  # vLLM's own allocation, no copy
    staged = choose(zero_copy=False, layerwise=False)
    assert isinstance(staged, StagedKV) and isinstance(staged, KVAccess)
    assert not isinstance(staged, LayerKVAccess)  # staging moves whole blocks only
    off = choose(zero_copy=False, layerwise=True)
    assert isinstance(off, str) and "use_layerwise needs the daemon to reach the cpu KV cache directly" in off


class _Mark:
    def __init__(self, log: list[str], n: int) -> None:
        self.log, self.n, self.done = log, n, False

    def ready(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.log.append(f"wait mark {self.n}")
        self.done = True


class StreamOrderDouble(SharedMemoryKV):
    """Test double for CUDA's stream ordering (no GPU here): shared-memory KV whose marks are reached
    only when the test says so; logs marks, waits, ``before_dump`` and every dump submitted."""

    def __init__(self, memory: Any, names: list[str]) -> None:
        super().__init__(memory)
        self.names, self.log, self.marks = names, [], []

    def mark(self) -> Any:
        self.marks.append(_Mark(self.log, len(self.marks)))
        self.log.append(f"mark {len(self.marks) - 1}")
        return self.marks[-1]

    def before_dump(self) -> None:
        self.log.append("before_dump")

    def blocks(self, keys: Any, block_ids: Any, slots: Any) -> list[BlockIO]:
        self.log.append("submit whole")
        return super().blocks(keys, block_ids, slots)

    def layer_blocks(self, layer_name: str, keys: Any, block_ids: Any) -> list[BlockIO]:
        self.log.append(f"submit {self.names.index(layer_name)}")
        return super().layer_blocks(layer_name, keys, block_ids)


def _ordered_worker(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, *, layerwise: bool
) -> tuple[UcmWorker, StreamOrderDouble, list[str]]:
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(RAW_BYTES, dtype=torch.int8)
    views = _views(raw)
    names = list(views)
    chosen = choose_kv_access(
        views, zero_copy=True, staging_bytes=0, layerwise=layerwise, alloc=alloc, vllm_config=None
    )
    assert isinstance(chosen, SharedMemoryKV)
    double = StreamOrderDouble(chosen.memory, names)
    monkeypatch.setattr(transfers_module, "choose_kv_access", lambda *a, **kw: double)
    fields = (("model", f"order-{layerwise}"),)
    keyspace = KeySpace(fields=fields, tp_size=1, layer_names=layer_order(names), layerwise=layerwise)
    config = ConnectorConfig(target=daemon.target, use_layerwise=layerwise)
    worker = UcmWorker(CPU, keyspace, config, tp_rank=0)
    worker.register_kv_caches(views)
    return worker, double, names


@pytest.mark.slow
def test_layer_dumps_wait_for_the_kernels_that_wrote_them(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What CUDA ordering needs from the worker: a layer's dump goes out only once the mark recorded
    after its attention is reached; the end of the step waits for the rest, and layers whose attention
    never ran are dumped only after ``before_dump`` (the whole forward's kernels)."""
    worker, double, names = _ordered_worker(daemon, monkeypatch, layerwise=True)
    try:
        meta = UcmConnectorMetadata(saves=[BlockTransfer("r", (1,), (b"k" * 32,))])
        worker.save_layer(meta, names[0])
        worker.save_layer(meta, names[1])
        assert double.log == ["mark 0", "mark 1"]  # layer 0's kernels still running: nothing dumped
        double.marks[0].done = True
        worker.save_layer(meta, names[1])  # called again for a layer already marked: no second mark
        assert double.log == ["mark 0", "mark 1", "submit 0"]
        worker.save(meta)  # wait_for_save
        assert double.log[3:] == ["wait mark 1", "submit 1"]
        double.log.clear()
        step2 = UcmConnectorMetadata(saves=[BlockTransfer("s", (2,), (b"l" * 32,))])
        worker.save_layer(step2, names[1])  # layer 0's attention did not run this step
        worker.save(step2)
        assert double.log == ["mark 2", "wait mark 2", "submit 1", "before_dump", "submit 0"]
    finally:
        worker.shutdown()


def test_whole_block_dump_waits_for_the_forward(
    daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, double, _ = _ordered_worker(daemon, monkeypatch, layerwise=False)
    try:
        worker.save(UcmConnectorMetadata(saves=[BlockTransfer("r", (1, 2), (b"k" * 32, b"l" * 32))]))
        worker.save(UcmConnectorMetadata())  # a step without saves dumps nothing, waits for nothing
        assert double.log == ["before_dump", "submit whole"]
    finally:
        worker.shutdown()
