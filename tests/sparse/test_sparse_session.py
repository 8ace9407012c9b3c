"""Execution discipline of the sparse hooks: session scope, tensor validation, roles, and the paged hook path.

The paged cache here is built in the CPU backend's page layout (keys transposed inside each page),
so the hook path is exercised exactly as vLLM feeds it, without an engine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from ucm_client.sparse.base import LayerSpec, PagedAttentionMeta, UcmSparseBase, UcmSparseRole
from ucm_client.sparse.errors import SparseInputError, SparseRoleError, SparseSessionError
from ucm_client.sparse.kernels.attention import dense_decode_attention
from ucm_client.sparse.kernels.paged import PageLayout, detect_page_layout, read_request_kv
from ucm_client.sparse.methods.block_sparse import DecodeState
from ucm_client.sparse.methods.esa import ESA
from ucm_client.sparse.testing import planted_needles, relative_error

BS, HEADS, KV_HEADS, DIM = 32, 8, 2, 64


def _paged(
    keys: torch.Tensor, values: torch.Tensor, layout: PageLayout, num_blocks: int = 160
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write token-major KV into a paged cache at shuffled physical blocks; return (cache, block ids)."""
    n = keys.shape[0]
    nb = -(-n // BS)
    cache = torch.zeros(num_blocks, KV_HEADS, BS, 2 * DIM)
    paged = cache.view(num_blocks, KV_HEADS, 2 * BS, DIM)
    phys = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))[:nb]
    for logical, block in enumerate(phys.tolist()):
        k = keys[logical * BS : (logical + 1) * BS]
        v = values[logical * BS : (logical + 1) * BS]
        t = k.shape[0]
        paged[block, :, BS : BS + t] = v.permute(1, 0, 2)
        if layout is PageLayout.KEY_TRANSPOSED:
            page = paged[block, :, :BS].reshape(KV_HEADS, DIM, BS)
            page[:, :, :t] = k.permute(1, 2, 0)
        else:
            paged[block, :, :t] = k.permute(1, 0, 2)
    return cache, phys


def _worker(layout: PageLayout = PageLayout.KEY_TRANSPOSED, ratio: float = 0.2) -> tuple[ESA, Any]:
    case = planted_needles(4096, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, block_size=BS, seed=2)
    cache, phys = _paged(case.keys, case.values, layout)
    esa = ESA(UcmSparseRole.WORKER, {"sparse_ratio": ratio, "retrieval_stride": 1})
    esa.register_kv_caches({0: cache}, num_heads=HEADS, layout=layout)
    table = torch.full((1, 160), -1, dtype=torch.int32)
    table[0, : phys.numel()] = phys.to(torch.int32)
    meta = PagedAttentionMeta(
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([4096], dtype=torch.int32),
        block_table=table,
        num_actual_tokens=1,
        row_keys=["req-1"],
    )
    return esa, {"case": case, "cache": cache, "meta": meta}


def _qkv(case: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return case.query[None], torch.zeros(1, KV_HEADS, DIM), torch.zeros(1, KV_HEADS, DIM)


@pytest.mark.parametrize("layout", list(PageLayout))
def test_paged_hook_selects_blocks_and_matches_tensor_level_decode(layout: PageLayout) -> None:
    esa, ctx = _worker(layout)
    case = ctx["case"]
    q, k, v = _qkv(case)
    esa.execute_begin(None)
    inputs = esa.attention_begin(0, q, k, v, ctx["meta"])
    assert inputs.block_table is not None and inputs.seq_lens is not None
    kept = int(inputs.seq_lens[0]) // BS
    assert kept == 26  # ceil(0.2 * 128) blocks, the last one full
    # Attend over the rewritten table the way the kernel would, and compare with the tensor API.
    keys, values = read_request_kv(
        ctx["cache"], inputs.block_table[0, :kept], int(inputs.seq_lens[0]), layout
    )
    out = dense_decode_attention(case.query, keys, values, case.scale)
    ref = ESA(UcmSparseRole.WORKER, {"sparse_ratio": 0.2}).decode(
        case.query, case.keys, case.values, state=DecodeState(), block_size=BS, scale=case.scale
    )
    assert relative_error(out, ref.output) < 1e-5
    phys = ctx["meta"].block_table[0]
    assert set(inputs.block_table[0, :kept].tolist()) == {int(phys[b]) for b in ref.block_ids.tolist()}
    esa.attention_finished(0, inputs.output)
    esa.execute_finished(torch.tensor([0]))


def test_full_budget_leaves_the_block_table_alone() -> None:
    esa, ctx = _worker(ratio=1.0)
    esa.execute_begin(None)
    inputs = esa.attention_begin(0, *_qkv(ctx["case"]), ctx["meta"])
    assert inputs.block_table is None and inputs.seq_lens is None


def test_layer_hooks_outside_a_session_are_rejected() -> None:
    esa, ctx = _worker()
    q, k, v = _qkv(ctx["case"])
    with pytest.raises(SparseSessionError, match="outside an execution session"):
        esa.attention_begin(0, q, k, v, ctx["meta"])
    with pytest.raises(SparseSessionError, match="outside an execution session"):
        esa.attention_finished(0, torch.zeros(1, HEADS, DIM))
    with pytest.raises(SparseSessionError):
        esa.execute_finished(torch.tensor([0]))
    esa.execute_begin(None)
    out = esa.attention_begin(0, q, k, v, ctx["meta"]).output
    esa.attention_finished(0, out)
    esa.execute_finished(torch.tensor([0]))
    with pytest.raises(SparseSessionError, match="outside an execution session"):
        esa.attention_begin(0, q, k, v, ctx["meta"])  # the session closed: stale calls fail


def test_session_order_is_enforced() -> None:
    esa, ctx = _worker()
    q, k, v = _qkv(ctx["case"])
    esa.execute_begin(None)
    with pytest.raises(SparseSessionError, match="still open"):
        esa.execute_begin(None)
    esa.attention_begin(0, q, k, v, ctx["meta"])
    with pytest.raises(SparseSessionError, match="twice"):
        esa.attention_begin(0, q, k, v, ctx["meta"])
    with pytest.raises(SparseSessionError, match="never finished"):
        esa.execute_finished(torch.tensor([0]))
    assert not esa.session.is_open  # closed despite the error, so the next step can start


@pytest.mark.parametrize(
    ("what", "bad", "message"),
    [
        ("query", torch.zeros(1, HEADS + 1, DIM), r"query: expected shape \[\*, 8, 64\]"),
        ("query", torch.zeros(1, HEADS, DIM, dtype=torch.float16), "query: expected dtype torch.float32"),
        ("key", torch.zeros(2, KV_HEADS, DIM), r"key: expected shape \[1, 2, 64\]"),
        ("value", torch.zeros(1, KV_HEADS), "value: expected shape"),
        ("query", [[0.0]], "query: expected a torch.Tensor"),
    ],
)
def test_wrong_tensors_are_rejected_with_their_name(what: str, bad: Any, message: str) -> None:
    esa, ctx = _worker()
    args = dict(zip(("query", "key", "value"), _qkv(ctx["case"]), strict=True))
    args[what] = bad
    esa.execute_begin(None)
    with pytest.raises(SparseInputError, match=message):
        esa.attention_begin(0, args["query"], args["key"], args["value"], ctx["meta"])


def test_bad_metadata_and_unknown_layers_are_rejected() -> None:
    esa, ctx = _worker()
    q, k, v = _qkv(ctx["case"])
    esa.execute_begin(None)
    bad = dataclasses.replace(ctx["meta"], seq_lens=torch.tensor([4096.0]))
    with pytest.raises(SparseInputError, match="seq_lens: expected dtype"):
        esa.attention_begin(0, q, k, v, bad)
    with pytest.raises(SparseInputError, match="layer 5 has no registered KV cache"):
        esa.attention_begin(5, q, k, v, ctx["meta"])


def test_roles_are_kept_apart() -> None:
    worker = ESA(UcmSparseRole.WORKER, {})
    with pytest.raises(SparseRoleError, match="SCHEDULER hook"):
        worker.request_begin("r", [1, 2, 3])
    sched = ESA(UcmSparseRole.SCHEDULER, {"sparse_ratio": 0.25, "block_size": 16})
    with pytest.raises(SparseRoleError, match="WORKER hook"):
        sched.execute_begin(None)


@dataclasses.dataclass
class _Req:
    request_id: str
    num_tokens: int


def test_scheduler_hooks_estimate_slots_and_plan_retrievals() -> None:
    sched = ESA(UcmSparseRole.SCHEDULER, {"sparse_ratio": 0.25, "block_size": 16, "retrieval_stride": 2})
    sched.request_begin("a", list(range(1600)))
    assert sched.estimate_num_slots_sparsed(_Req("a", 1600)) == 25 * 16  # 25% of 100 blocks
    plans = [
        sched.build_sparse_meta(None, [_Req("a", 1600 + i)], {}).requests["a"].retrieve for i in range(4)
    ]
    assert plans == [True, False, True, False]
    sched.request_finished_in_scheduler("a")
    assert sched.build_sparse_meta(None, [_Req("a", 1)], {}).requests["a"].retrieve  # state was dropped


def test_layer_specs_are_immutable() -> None:
    esa, _ = _worker()
    spec = esa.layer_specs[0]
    assert isinstance(spec, LayerSpec) and spec.head_dim == DIM and spec.block_size == BS
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.head_dim = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        esa.layer_specs[1] = spec  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        esa.spec.sparse_ratio = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("layout", list(PageLayout))
def test_page_layout_is_detected_from_a_written_key(layout: PageLayout) -> None:
    keys = torch.randn(BS * 2, KV_HEADS, DIM)
    cache, phys = _paged(keys, torch.randn_like(keys), layout, num_blocks=4)
    slot = int(phys[1]) * BS + 5
    assert detect_page_layout(cache, slot, keys[BS + 5]) is layout
    with pytest.raises(SparseInputError, match="neither known page layout"):
        detect_page_layout(cache, slot, torch.randn(KV_HEADS, DIM))


def test_every_builtin_is_a_sparse_base() -> None:
    from ucm_client.sparse.factory import UcmSparseFactory

    for name in ("ESA", "GSA", "KVStarMultiStep", "Blend", "ReRoPE"):
        assert issubclass(UcmSparseFactory.load_class(name), UcmSparseBase)


def test_worker_follows_the_schedulers_retrieval_plan() -> None:
    from ucm_client.sparse.base import RequestSparseMeta, SparseMeta

    esa, ctx = _worker()
    q, k, v = _qkv(ctx["case"])
    plan = [True, False, False, True]
    for retrieve in plan:
        meta = SparseMeta(requests={"req-1": RequestSparseMeta("req-1", 4096, retrieve=retrieve)})
        esa.execute_begin(meta)
        out = esa.attention_begin(0, q, k, v, ctx["meta"]).output
        esa.attention_finished(0, out)
        esa.execute_finished(torch.tensor([0]))
    assert esa.stats["retrievals"] == 2
