"""The connector's parts without a vLLM engine: keys, grants, version gate, shared-memory KV, daemon link.

Memory tests use real ``SharedBuffer``s and torch tensors laid out as vLLM's CPU backend lays them out;
the daemon tests use a real ``ucm-server`` process.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from support.vllm_process import vllm_request

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, namespace_id
from ucm_client.vllm.config import ConfigError, ConnectorConfig
from ucm_client.vllm.connector import check_vllm_version
from ucm_client.vllm.identity import (
    KeySpace,
    block_keys,
    check_hash_stability,
    layer_key,
    layer_order,
    weight_fingerprint,
)
from ucm_client.vllm.kv_memory import KVMemory, ShmAllocation, adopt
from ucm_client.vllm.link import DaemonLink
from ucm_client.vllm.scheduler import hit_tokens
from ucm_client.vllm.staging import StagingArea
from ucm_client.vllm.stats import UcmConnectorStats
from ucm_server.testing.daemon import DaemonProcess

# ---------------------------------------------------------------- keys and grants


def test_block_keys_are_vllm_hashes_or_widened() -> None:
    sha = [bytes([i]) * 32 for i in range(4)]
    assert block_keys(sha, 16, 16) == sha
    # vLLM hashing at a finer grain than its blocks: a block's key is its last sub-block's hash.
    assert block_keys(sha, 32, 16) == [sha[1], sha[3]]
    xx = [bytes([i]) * 16 for i in range(3)]
    widened = block_keys(xx, 16, 16)
    assert [len(k) for k in widened] == [32, 32, 32] and len(set(widened)) == 3


@pytest.mark.parametrize(
    ("stored", "num_tokens", "local", "granted"),
    [
        (0, 600, 0, 0),
        (4, 600, 0, 512),  # 4 stored blocks of a 4.7-block prompt
        (4, 600, 256, 256),  # vLLM's own cache already has 2 blocks
        (2, 600, 256, 0),  # nothing beyond vLLM's own cache
        (4, 512, 0, 511),  # full hit: the last token is recomputed
        (4, 512, 384, 127),
        (9, 512, 0, 511),  # stored beyond the prompt (a longer earlier request)
    ],
)
def test_hit_tokens(stored: int, num_tokens: int, local: int, granted: int) -> None:
    assert hit_tokens(stored, 128, num_tokens, local) == granted


def test_unstable_hashes_are_refused_with_the_fix() -> None:
    config = ConnectorConfig()
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        check_hash_stability("xxhash", config, environ={})
    check_hash_stability("xxhash", config, environ={"PYTHONHASHSEED": "0"})
    check_hash_stability("sha256", config, environ={})
    check_hash_stability("xxhash_cbor", ConnectorConfig(allow_unstable_hashes=True), environ={})


def test_layer_order_is_numeric_and_independent_of_listing_order() -> None:
    names = ["m.layers.10.attn", "m.layers.9.attn", "m.layers.0.attn", "m.layers.9.attn", "m.mtp.0.attn"]
    expected = ("m.layers.0.attn", "m.layers.9.attn", "m.layers.10.attn", "m.mtp.0.attn")
    assert layer_order(names) == expected
    assert layer_order(reversed(names)) == expected


def test_layerwise_keyspace_has_its_own_namespace(tiny_model: Path) -> None:
    """Built from vLLM's own config objects: the layers in order, a namespace apart from whole blocks."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), dtype="float32"),
        cache_config=CacheConfig(block_size=128),
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]  # as listed, in any order
    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)]
    )
    whole = KeySpace.from_vllm(vllm_config, kv_config, ConnectorConfig())
    layered = KeySpace.from_vllm(vllm_config, kv_config, ConnectorConfig(use_layerwise=True))
    assert (whole.layerwise, layered.layerwise) == (False, True)
    assert layered.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10))
    assert whole.namespace(0) != layered.namespace(0)
    # The whole-block namespace is built from exactly the fields it always was.
    assert whole.fields == tuple((k, v) for k, v in layered.fields if k != "layerwise")


def test_vllm_version_gate() -> None:
    check_vllm_version("0.32.0", ConnectorConfig())
    check_vllm_version("0.33.1", ConnectorConfig())
    with pytest.raises(ConfigError, match=r"supports vLLM 0.32 and 0.33, this is vLLM 0.31.2"):
        check_vllm_version("0.31.2", ConnectorConfig())
    check_vllm_version("0.40.0", ConnectorConfig(allow_unsupported_vllm=True))


def test_weight_fingerprint_sees_values_not_paths(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    payload = bytes(range(256)) * 40_000  # 10 MB: sampled head and tail
    (a / "model.safetensors").write_bytes(payload)
    shutil.copy(a / "model.safetensors", b / "model.safetensors")
    changed = bytearray(payload)
    changed[100] ^= 1  # same size and shape, different values
    (c / "model.safetensors").write_bytes(bytes(changed))
    assert weight_fingerprint(a, "sampled") == weight_fingerprint(b, "sampled")
    assert weight_fingerprint(a, "sampled") != weight_fingerprint(c, "sampled")
    assert weight_fingerprint(a, "full") != weight_fingerprint(c, "full")


# ---------------------------------------------------------------- shared-memory KV cache

LAYERS, BLOCKS, HEADS, BLOCK, HEAD = 2, 6, 2, 16, 32


def _layer_views(raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """vLLM's CPU (LBHNC) layout: layer-outermost, one [B, H, N, 2*D] float32 view per layer."""
    flat = raw.view(torch.float32).view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD)
    return {f"model.layers.{i}.self_attn.attn": flat[i] for i in range(LAYERS)}


RAW_BYTES = LAYERS * BLOCKS * HEADS * BLOCK * 2 * HEAD * 4
PAGE = HEADS * BLOCK * 2 * HEAD * 4


def test_allocation_context_puts_the_kv_cache_in_shared_memory() -> None:
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(RAW_BYTES, dtype=torch.int8, device=torch.device("cpu"))
        other = torch.zeros(8, dtype=torch.float32)  # not the KV cache: untouched
    assert alloc.buffer is not None and raw.data_ptr() == alloc.buffer.torch().data_ptr()
    assert other.untyped_storage().data_ptr() != raw.untyped_storage().data_ptr()
    views = _layer_views(raw)
    memory = KVMemory(alloc.buffer, raw, views)
    views["model.layers.1.self_attn.attn"][3].fill_(2.5)
    assert memory.block_view(3)[PAGE:] == torch.full((PAGE // 4,), 2.5).numpy().tobytes()


def test_segments_per_layer_and_merged_when_contiguous() -> None:
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(RAW_BYTES, dtype=torch.int8)
    assert alloc.buffer is not None
    memory = KVMemory(alloc.buffer, raw, _layer_views(raw))
    segs = memory.segments(7, 2)
    assert [(s.region, s.offset, s.length) for s in segs] == [
        (7, 2 * PAGE, PAGE),
        (7, (BLOCKS + 2) * PAGE, PAGE),
    ]
    # Block-outermost layout: both layers' pages of a block are adjacent, so one segment.
    flat = raw.view(torch.float32).view(BLOCKS, LAYERS, HEADS, BLOCK, 2 * HEAD)
    merged = KVMemory(alloc.buffer, raw, {f"l{i}": flat[:, i] for i in range(LAYERS)})
    assert [(s.offset, s.length) for s in merged.segments(0, 2)] == [(2 * 2 * PAGE, 2 * PAGE)]
    # Which segment holds a layer (what a whole-block load's progress word counts): layer order
    # when pages never merge; none when they do (the whole block is one segment).
    assert [memory.segment_of(f"model.layers.{i}.self_attn.attn") for i in range(LAYERS)] == [0, 1]
    assert merged.segment_of("l1") is None and memory.segment_of("not-a-layer") is None
    with pytest.raises(IndexError):
        memory.segments(0, BLOCKS)
    # Layerwise, a block's object for one layer is that layer's page, merged layouts or not.
    assert memory.layer_segments(7, "model.layers.1.self_attn.attn", 2) == (
        Segment(7, (BLOCKS + 2) * PAGE, PAGE),
    )
    assert merged.layer_segments(7, "l1", 2) == (Segment(7, (2 * 2 + 1) * PAGE, PAGE),)
    with pytest.raises(IndexError):
        memory.layer_segments(0, "model.layers.0.self_attn.attn", BLOCKS)


def test_adopt_repoints_every_view_and_keeps_contents() -> None:
    raw = torch.zeros(RAW_BYTES, dtype=torch.int8)
    views = _layer_views(raw)
    views["model.layers.0.self_attn.attn"][1].fill_(1.25)

    class Layer:  # what vLLM binds: a separate view object of the same storage
        def __init__(self, kv: torch.Tensor) -> None:
            self.kv_cache = kv

    bound = Layer(raw.view(torch.float32).view(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD)[0])
    buffer, shm_raw = adopt(views, [bound])
    memory = KVMemory(buffer, shm_raw, views)
    for tensor in [*views.values(), bound.kv_cache]:
        assert memory.base <= tensor.data_ptr() < memory.base + buffer.size
    assert bool((bound.kv_cache[1] == 1.25).all())
    buffer.array(dtype="float32")[: PAGE // 4] = 7.0  # a write into the shm is what vLLM reads
    assert bool((bound.kv_cache[0] == 7.0).all())


def test_daemon_copies_straight_into_the_layer_tensors(tmp_path: Path) -> None:
    """Dump block 1 of one KV cache, load it as block 4 of another: the layer views see the bytes."""
    alloc_a, alloc_b = ShmAllocation(), ShmAllocation()
    with alloc_a:
        raw_a = torch.zeros(RAW_BYTES, dtype=torch.int8)
    with alloc_b:
        raw_b = torch.zeros(RAW_BYTES, dtype=torch.int8)
    assert alloc_a.buffer is not None and alloc_b.buffer is not None
    views_a, views_b = _layer_views(raw_a), _layer_views(raw_b)
    for i, view in enumerate(views_a.values()):
        view[1].copy_(torch.randn(view[1].shape, generator=torch.Generator().manual_seed(i)))
    mem_a, mem_b = KVMemory(alloc_a.buffer, raw_a, views_a), KVMemory(alloc_b.buffer, raw_b, views_b)
    ns, key = namespace_id(test="kv-memory"), b"k" * 32
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        region_a, region_b = client.register(alloc_a.buffer), client.register(alloc_b.buffer)
        assert client.wait(client.dump(ns, [BlockIO(key, mem_a.segments(region_a, 1))]), 10).ok
        assert client.wait(client.load(ns, [BlockIO(key, mem_b.segments(region_b, 4))]), 10).ok
    for name in views_a:
        assert torch.equal(views_b[name][4], views_a[name][1])
    assert mem_b.block_view(4) == mem_a.block_view(1)


def test_staging_path_stores_the_same_bytes_as_zero_copy(tmp_path: Path) -> None:
    """GPU-style staging: a block saved zero-copy loads through slots into another cache, and back."""
    alloc = ShmAllocation()
    with alloc:
        raw_a = torch.zeros(RAW_BYTES, dtype=torch.int8)
    assert alloc.buffer is not None
    views_a = _layer_views(raw_a)
    for i, view in enumerate(views_a.values()):
        view[2].copy_(torch.randn(view[2].shape, generator=torch.Generator().manual_seed(10 + i)))
    mem_a = KVMemory(alloc.buffer, raw_a, views_a)
    views_b = _layer_views(torch.zeros(RAW_BYTES, dtype=torch.int8))  # private memory, like a GPU's
    staging = StagingArea(views_b, 3 * 2 * PAGE)
    assert staging.block_bytes == mem_a.block_bytes and staging.num_slots == 3
    ns, key, key2 = namespace_id(test="staging"), b"s" * 32, b"t" * 32
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        region_a, region_s = client.register(alloc.buffer), client.register(staging.buffer)
        assert client.wait(client.dump(ns, [BlockIO(key, mem_a.segments(region_a, 2))]), 10).ok
        slots = staging.acquire(1)
        assert slots is not None
        assert client.wait(client.load(ns, [BlockIO(key, staging.segments(region_s, slots[0]))]), 10).ok
        staging.to_kv(slots, [5])
        for name in views_a:
            assert torch.equal(views_b[name][5], views_a[name][2])
        staging.from_kv(slots, [5])  # and out again through a slot, under another key
        assert client.wait(client.dump(ns, [BlockIO(key2, staging.segments(region_s, slots[0]))]), 10).ok
        staging.release(slots)
        assert client.get_blocks(ns, [key2]) == [mem_a.block_view(2)]
    assert staging.acquire(4) is None and staging.free_slots == 3


# ---------------------------------------------------------------- daemon link and stats


def test_link_to_absent_daemon_warns_once_and_retries_later(tmp_path: Path, caplog: Any) -> None:
    now = [100.0]
    target = f"unix://{tmp_path}/nobody.sock"
    links = [
        DaemonLink(target, reconnect_interval_s=5, connect_timeout_s=0.2, clock=lambda: now[0], role=r)
        for r in ("scheduler", "worker")
    ]
    with caplog.at_level(logging.WARNING, logger="vllm.ucm_connector"):
        assert links[0].client() is None and links[1].client() is None
        assert links[0].client() is None  # within the retry interval: no new attempt
        now[0] += 6
        assert links[0].client() is None  # retried, still down
    warnings = [r for r in caplog.records if "is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "prefixes are recomputed" in warnings[0].getMessage()
    assert all(link.is_down for link in links)


@pytest.mark.slow
def test_link_reconnects_when_the_daemon_appears(tmp_path: Path) -> None:
    now = [0.0]
    socket = tmp_path / "ucm" / "ucm.sock"
    link = DaemonLink(f"unix://{socket}", reconnect_interval_s=1, connect_timeout_s=0.2, clock=lambda: now[0])
    assert link.client() is None
    with DaemonProcess(tmp_path / "ucm"):
        assert link.client() is None  # the retry time has not come yet
        now[0] += 2
        client = link.client()
        assert client is not None
        assert client.lookup(namespace_id(test="link"), [b"x" * 32]).hit_prefix == 0
        link.succeeded()
        assert not link.is_down
    link.close()


def test_stats_aggregate_reduce_and_take() -> None:
    worker = UcmConnectorStats()
    worker.add(load_blocks=2, load_bytes=2_000_000_000, load_seconds=1.0)
    scheduler = UcmConnectorStats()
    scheduler.add(hit_tokens=256, lookups=1)
    total = scheduler.aggregate(worker)
    assert isinstance(total, UcmConnectorStats)
    reduced = total.reduce()
    assert reduced["hit_tokens"] == 256 and reduced["load_gb_per_s"] == 2.0
    taken = worker.take()
    assert taken is not None and taken.data["load_blocks"] == 2
    assert worker.is_empty() and worker.take() is None
    with pytest.raises(KeyError):
        worker.add(bogus=1)


def test_shared_buffer_outlives_nothing_it_should_not() -> None:
    """A SharedBuffer used as KV memory must stay mapped while a tensor views it."""
    buffer = SharedBuffer(4096)
    tensor = torch.frombuffer(buffer.buf, dtype=torch.int8, count=4096)
    tensor[0] = 5
    assert buffer.array()[0] == 5
    del tensor
    buffer.close()


# ---------------------------------------------------------------- scheduler half on real vLLM objects


def _scheduler(daemon: DaemonProcess, keyspace: KeySpace) -> Any:
    """A scheduler half with 16-token blocks talking to ``daemon``."""
    from vllm.config import CacheConfig, VllmConfig

    from ucm_client.vllm.scheduler import UcmScheduler

    config = ConnectorConfig(target=daemon.target)
    return UcmScheduler(VllmConfig(cache_config=CacheConfig(block_size=16)), keyspace, config)


@pytest.mark.slow
def test_scheduler_lookup_covers_every_tp_rank_and_plans_loads_and_saves(tmp_path: Path) -> None:
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from ucm_client.vllm.identity import KeySpace

    keyspace = KeySpace(fields=(("model", "parts-test"),), tp_size=2)
    tokens = list(range(100, 170))  # 4 full blocks of 16 + 6 tokens
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        scheduler = _scheduler(daemon, keyspace)
        first = vllm_request("a", tokens)
        keys = block_keys(first.block_hashes, 16, 16)
        assert len(keys) == 4
        # Rank 0 holds 3 blocks, rank 1 only 2: a block missing on one rank is a miss for all.
        client.put_blocks(keyspace.namespace(0), [(k, b"x" * 64) for k in keys[:3]])
        client.put_blocks(keyspace.namespace(1), [(k, b"y" * 64) for k in keys[:2]])
        assert scheduler.get_num_new_matched_tokens(first, 0) == (32, False)
        client.put_blocks(keyspace.namespace(1), [(keys[2], b"y" * 64)])
        assert scheduler.get_num_new_matched_tokens(first, 0) == (32, False)  # cached per request
        second = vllm_request("b", tokens)
        assert scheduler.get_num_new_matched_tokens(second, 16) == (32, False)  # 1 block local, 2 more

        class Blocks:  # the shape of vLLM's KVCacheBlocks that the connector reads
            def get_block_ids(self) -> tuple[list[int], ...]:
                return ([7, 8, 9, 10, 11],)

        scheduler.update_state_after_alloc(second, Blocks(), 32)
        second.num_computed_tokens = 48  # what vLLM sets after granting 16 local + 32 external
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(second, ([7, 8, 9, 10, 11],))]
        output.num_scheduled_tokens = {"b": 70 - 48}
        meta = scheduler.build_connector_meta(output)
        (load,) = meta.loads
        assert (load.req_id, load.block_ids, load.keys) == ("b", (8, 9), tuple(keys[1:3]))
        (save,) = meta.saves  # block 3 becomes full this step; 0-2 are stored already
        assert (save.block_ids, save.keys) == ((10,), (keys[3],))
        assert scheduler.request_finished(second) == (True, None)  # held until the save is reported
        assert scheduler.request_finished(first) == (False, None)
        scheduler.shutdown()


@pytest.mark.slow
def test_layerwise_lookup_grants_only_blocks_with_every_layer_on_every_rank(tmp_path: Path) -> None:
    from vllm.config import CacheConfig, VllmConfig

    from ucm_client.vllm.scheduler import UcmScheduler

    layers = ("attn.0", "attn.1", "attn.2")
    keyspace = KeySpace(fields=(("model", "parts-layerwise"),), tp_size=2, layer_names=layers, layerwise=True)
    request = vllm_request("a", list(range(100, 170)))  # 4 full blocks of 16 + 6 tokens
    keys = block_keys(request.block_hashes, 16, 16)
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:

        def put(rank: int, blocks: range, layer_ids: tuple[int, ...]) -> None:
            items = [(layer_key(keys[b], layer), b"x" * 64) for b in blocks for layer in layer_ids]
            client.put_blocks(keyspace.namespace(rank), items)

        put(0, range(4), (0, 1, 2))
        put(1, range(2), (0, 1, 2))
        put(1, range(2, 4), (0, 2))  # blocks 2 and 3 lack their middle layer on rank 1
        client.put_blocks(keyspace.namespace(1), [(k, b"w" * 64) for k in keys])  # whole blocks: no use
        config = ConnectorConfig(target=daemon.target, use_layerwise=True)
        scheduler = UcmScheduler(VllmConfig(cache_config=CacheConfig(block_size=16)), keyspace, config)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (32, False)
        stats = scheduler.take_stats()
        assert stats is not None and stats.data["lookups"] == 2  # one batched Lookup per rank
        put(1, range(2, 4), (1,))
        assert scheduler.get_num_new_matched_tokens(vllm_request("b", list(range(100, 170))), 0) == (
            64,
            False,
        )
        scheduler.shutdown()


@pytest.mark.slow
def test_layerwise_lookup_longer_than_one_call_is_asked_in_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More keys than one Lookup may carry: asked block-aligned, in order, until a part misses."""
    from vllm.config import CacheConfig, VllmConfig

    from ucm_client.vllm import scheduler as scheduler_module
    from ucm_client.vllm.scheduler import UcmScheduler

    monkeypatch.setattr(scheduler_module, "MAX_LOOKUP_KEYS", 7)  # 2 blocks of 3 layers per Lookup
    layers = ("attn.0", "attn.1", "attn.2")
    keyspace = KeySpace(fields=(("model", "parts-chunked"),), tp_size=1, layer_names=layers, layerwise=True)
    tokens = list(range(100, 170))  # 4 full blocks of 16 + 6 tokens
    keys = block_keys(vllm_request("a", tokens).block_hashes, 16, 16)
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        namespace = keyspace.namespace(0)
        client.put_blocks(namespace, [(layer_key(k, layer), b"x" * 64) for k in keys for layer in range(3)])
        config = ConnectorConfig(target=daemon.target, use_layerwise=True)
        scheduler = UcmScheduler(VllmConfig(cache_config=CacheConfig(block_size=16)), keyspace, config)

        def ask(req_id: str) -> tuple[tuple[int | None, bool], float]:
            granted = scheduler.get_num_new_matched_tokens(vllm_request(req_id, tokens), 0)
            stats = scheduler.take_stats()
            assert stats is not None
            return granted, stats.data["lookups"]

        assert ask("all") == ((64, False), 2)  # 12 keys in 2 Lookups, the whole prefix found
        client.delete(namespace, [layer_key(keys[2], 1)])
        assert ask("third-block-torn") == ((32, False), 2)
        client.delete(namespace, [layer_key(keys[1], 0)])
        assert ask("second-block-torn") == ((16, False), 1)  # the first part misses: no second Lookup
        scheduler.shutdown()


def test_connector_overrides_accept_what_vllm_passes() -> None:
    """Every base-class method UCMConnector overrides takes the installed vLLM's arguments.

    vLLM 0.33 calls ``unregister_kv_caches()`` and ``restore_kv_caches()`` with no argument.
    """
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from ucm_client.vllm.connector import UCMConnector

    for name, base in vars(KVConnectorBase_V1).items():
        ours = vars(UCMConnector).get(name)
        if not callable(base) or ours is None or not callable(ours):
            continue
        params = inspect.signature(base).parameters.values()
        wanted = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        mine = inspect.signature(ours)
        try:
            mine.bind(*(None for _ in wanted))
        except TypeError as exc:
            raise AssertionError(f"UCMConnector.{name}{mine} cannot take {[p.name for p in wanted]}") from exc
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in mine.parameters.values())
        required = [
            p.name
            for p in mine.parameters.values()
            if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        assert has_var_kw or set(required) <= {p.name for p in wanted}, (name, required)


@pytest.mark.slow
def test_worker_registers_again_after_sleep(tmp_path: Path) -> None:
    """vLLM 0.33 sleep mode: ``unregister_kv_caches()`` drops the daemon registration,
    ``restore_kv_caches()`` (vLLM passes no argument) brings it back, and saves work again."""
    import time
    from types import SimpleNamespace

    from ucm_client.vllm.connector import UCMConnector
    from ucm_client.vllm.identity import KeySpace
    from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm_client.vllm.worker import UcmWorker

    views = _layer_views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    for i, view in enumerate(views.values()):
        view[1].copy_(torch.randn(view[1].shape, generator=torch.Generator().manual_seed(20 + i)))
    keyspace = KeySpace(fields=(("model", "sleep-test"),), tp_size=1)
    vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        config = ConnectorConfig(target=daemon.target, zero_copy=False, staging_buffer_gib=0.001)
        worker = UcmWorker(vllm_config, keyspace, config, tp_rank=0)

        def save(key: bytes) -> None:
            worker.save(UcmConnectorMetadata(saves=[BlockTransfer("r", (1,), (key,))]))
            deadline = time.monotonic() + 10
            while client.lookup(keyspace.namespace(0), [key]).hit_prefix != 1:
                assert time.monotonic() < deadline, f"{key!r} was not saved"
                worker.get_finished(set())
                time.sleep(0.02)

        worker.register_kv_caches(views)
        save(b"a" * 32)
        shell: Any = SimpleNamespace(_worker=worker)  # the connector's worker-role state
        UCMConnector.unregister_kv_caches(shell)  # exactly as vLLM 0.33's Worker.sleep calls it
        assert worker.staging is None
        UCMConnector.restore_kv_caches(shell)  # and Worker.wake_up
        assert worker.staging is not None
        save(b"b" * 32)
        assert client.get_blocks(keyspace.namespace(0), [b"b" * 32]) == client.get_blocks(
            keyspace.namespace(0), [b"a" * 32]
        )
        worker.shutdown()


def test_worker_saves_to_a_daemon_that_appeared_after_it_started(tmp_path: Path) -> None:
    """Down when the worker registered its KV cache, then a daemon appears: the first step's save
    after the retry interval reconnects, registers and stores. (The step's saturation check read the
    link first and took its one retry per interval without making a call, so the save found the
    daemon still down, and so did every later step's: nothing was ever saved again.)"""
    import time
    from types import SimpleNamespace

    from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm_client.vllm.worker import UcmWorker

    views = _layer_views(torch.zeros(RAW_BYTES, dtype=torch.int8))
    keyspace = KeySpace(fields=(("model", "late-daemon"),), tp_size=1)
    vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    daemon = DaemonProcess(tmp_path / "ucm")
    interval = 0.2
    config = ConnectorConfig(
        target=daemon.target, zero_copy=False, staging_buffer_gib=0.001, reconnect_interval_s=interval
    )
    worker = UcmWorker(vllm_config, keyspace, config, tp_rank=0)
    worker.register_kv_caches(views)  # the daemon is not there yet: the link is down
    key = b"k" * 32
    with daemon, UcmClient(daemon.target) as client:
        time.sleep(2 * interval)  # the retry is due
        deadline = time.monotonic() + 30
        while client.lookup(keyspace.namespace(0), [key]).hit_prefix != 1:  # a step's save, as vLLM's
            assert time.monotonic() < deadline, "no step's save after the daemon appeared was stored"
            worker.save(UcmConnectorMetadata(saves=[BlockTransfer("r", (1,), (key,))]))
            worker.get_finished(set())
            time.sleep(0.1)
        worker.shutdown()


@pytest.mark.slow
def test_own_hit_of_blocks_the_daemon_lost_is_looked_up_and_saved_again(tmp_path: Path) -> None:
    """vLLM's own prefix cache holds 4 blocks the daemon no longer has (evicted, or a daemon restarted
    empty): the own hit still asks, and the blocks are saved again, so the prefix outlives the vLLM
    process. (A connector that took own hits as stored would never save them again, and its Lookup
    would not keep them fresh in the daemon's LRU either.) Control: blocks the daemon has are not
    saved twice."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    keyspace = KeySpace(fields=(("model", "parts-own-hit"),), tp_size=1)
    tokens = list(range(100, 170))  # 4 full blocks of 16 + 6 tokens
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        scheduler = _scheduler(daemon, keyspace)

        def saves_after_own_hit(request_id: str) -> int:
            own = vllm_request(request_id, tokens)
            assert scheduler.get_num_new_matched_tokens(own, 64) == (0, False)
            own.num_computed_tokens = 64
            output = SchedulerOutput.make_empty()
            output.scheduled_new_reqs = [NewRequestData.from_request(own, ([1, 2, 3, 4, 5],))]
            output.num_scheduled_tokens = {request_id: 6}
            meta = scheduler.build_connector_meta(output)
            scheduler.request_finished(own)
            return sum(len(save.block_ids) for save in meta.saves) if meta.saves else 0

        assert saves_after_own_hit("lost") > 0
        stats = scheduler.take_stats()
        assert stats is not None and stats.data["lookups"] >= 1
        keys = block_keys(vllm_request("x", tokens).block_hashes, 16, 16)
        client.put_blocks(keyspace.namespace(0), [(k, b"x" * 64) for k in keys])
        assert saves_after_own_hit("kept") == 0
        scheduler.shutdown()


def test_shm_kv_allocation_is_mapped_up_front() -> None:
    """The KV cache's shared memory is in this process's page tables from the start, as vLLM's own
    ``torch.zeros`` leaves it: the first forward reading a loaded block takes no page faults.
    Negative control: a plain ``SharedBuffer`` of the same size faults on first read."""
    import resource

    size, page = 32 << 20, 4096

    def faults_reading(tensor: torch.Tensor) -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        int(tensor[::page].sum())
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    plain = SharedBuffer(size)
    plain_faults = faults_reading(torch.frombuffer(plain.buf, dtype=torch.int8, count=size))
    alloc = ShmAllocation()
    with alloc:
        raw = torch.zeros(size, dtype=torch.int8)
    assert alloc.buffer is not None and raw.data_ptr() == alloc.buffer.torch().data_ptr()
    populated_faults = faults_reading(raw)
    assert plain_faults > size // page // 32  # at most 16 pages per fault with the kernel's fault-around
    assert populated_faults < plain_faults // 10
    assert int(raw.abs().sum()) == 0  # still zeros, as torch.zeros promises


def test_whole_block_load_lets_each_layer_start_on_its_own_pages(tmp_path: Path) -> None:
    """Zero copy on CPU: a whole-block load carries a progress word, the first attention layer
    waits only until its own pages of every block are in (they are then), the step's end waits for
    the rest. Negative control: a block the daemon lacks is still a load error (recomputed), and
    its neighbours still load."""
    import time
    from types import SimpleNamespace

    from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm_client.vllm.worker import UcmWorker

    keyspace = KeySpace(fields=(("model", "progress-test"),), tp_size=1)
    vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    first = "model.layers.0.self_attn.attn"
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        worker = UcmWorker(vllm_config, keyspace, ConnectorConfig(target=daemon.target), tp_rank=0)
        alloc = worker.mem_pool_context()
        assert alloc is not None
        with alloc:
            raw = torch.zeros(RAW_BYTES, dtype=torch.int8)
        views = _layer_views(raw)
        worker.register_kv_caches(views)
        assert worker.memory is not None
        for i, view in enumerate(views.values()):
            view[:3].copy_(torch.randn(view[:3].shape, generator=torch.Generator().manual_seed(40 + i)))
        expected = {name: view[:3].clone() for name, view in views.items()}
        keys = tuple(bytes([k]) * 32 for k in b"xyz")
        worker.save(UcmConnectorMetadata(saves=[BlockTransfer("fill", (0, 1, 2), keys)]))
        deadline = time.monotonic() + 10
        while client.lookup(keyspace.namespace(0), list(keys)).hit_prefix != 3:
            assert time.monotonic() < deadline, "the fill was not saved"
            worker.get_finished(set())
            time.sleep(0.02)
        raw.zero_()

        # vLLM's order in a step: handle_preemptions (first thing: the loads start there on CPU),
        # then start_load_kv (right before the forward: nothing left to submit), then the layers.
        meta = UcmConnectorMetadata(loads=[BlockTransfer("hit", (3, 4, 5), keys)])
        worker.handle_preemptions(meta)
        assert [job.parts[0].word is not None for job in worker.sync_loads] == [True]
        worker.start_load(meta)
        assert len(worker.sync_loads) == 1
        worker.wait_for_layer_load(first)
        assert torch.equal(views[first][3:6], expected[first])  # this layer's pages are in now
        worker.save(UcmConnectorMetadata())  # end of step: the whole load is waited for
        assert not worker.sync_loads and worker.take_load_errors() == set()
        for name, view in views.items():
            assert torch.equal(view[3:6], expected[name]), name

        raw.zero_()
        gap = (keys[0], b"w" * 32, keys[2])  # the middle block was never stored
        worker.start_load(UcmConnectorMetadata(loads=[BlockTransfer("gap", (3, 4, 5), gap)]))
        worker.wait_for_layer_load(first)
        worker.save(UcmConnectorMetadata())
        assert worker.take_load_errors() == {4}
        for name, view in views.items():
            assert torch.equal(view[3], expected[name][0]) and torch.equal(view[5], expected[name][2])
        worker.shutdown()
