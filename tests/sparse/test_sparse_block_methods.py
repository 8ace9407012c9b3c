"""ESA, GSA and KVStarMultiStep on planted-needle workloads, against exact dense attention.

Stated bounds: at full budget the output equals dense attention to 1e-6 (relative); at 20% and 30%
budget exactly the budget is attended. Quality on hard patterns, against negative controls that must
fail, is ``test_sparse_quality.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.kernels.attention import block_means, dense_decode_attention, select_blocks
from ucm_client.sparse.methods.block_sparse import BlockSparseMethod, DecodeState
from ucm_client.sparse.methods.gsa import hash_codes
from ucm_client.sparse.testing import planted_needles, relative_error

METHODS = ["ESA", "GSA", "KVStarMultiStep"]
ERROR_BOUND = 0.02


def _method(name: str, **config: Any) -> BlockSparseMethod:
    method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, config)
    assert isinstance(method, BlockSparseMethod)
    return method


@pytest.mark.parametrize("name", METHODS)
def test_full_budget_reproduces_dense(name: str) -> None:
    case = planted_needles(2048, seed=3)
    dense = dense_decode_attention(case.query, case.keys, case.values, case.scale)
    res = _method(name, sparse_ratio=1.0).decode(
        case.query, case.keys, case.values, state=DecodeState(), block_size=case.block_size, scale=case.scale
    )
    assert res.block_ids.numel() == 2048 // case.block_size
    assert relative_error(res.output, dense) < 1e-6


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("ratio", [0.2, 0.3])
def test_low_budget_attends_exactly_the_budget(name: str, ratio: float) -> None:
    # Recall and error on hard patterns, with negative controls, are in test_sparse_quality.py.
    case = planted_needles(8192, seed=0, num_needles=6)
    res = _method(name, sparse_ratio=ratio).decode(
        case.query, case.keys, case.values, state=DecodeState(), block_size=case.block_size, scale=case.scale
    )
    num_blocks = 8192 // case.block_size
    assert res.block_ids.numel() == round(ratio * num_blocks + 0.4999)  # ceil, the budget exactly
    assert (
        relative_error(res.output, dense_decode_attention(case.query, case.keys, case.values, case.scale))
        < 0.02
    )


@pytest.mark.parametrize("name", METHODS)
def test_low_budget_without_needles_in_selection_is_far_from_dense(name: str) -> None:
    # The error bound above means something only if missing the needles breaks it: attend to the
    # windows alone (the needles excluded) and the error must be large.
    case = planted_needles(4096, seed=0)
    dense = dense_decode_attention(case.query, case.keys, case.values, case.scale)
    num_blocks = 4096 // case.block_size
    windows = torch.tensor([0, *range(num_blocks - 2, num_blocks)])
    tokens = (windows[:, None] * case.block_size + torch.arange(case.block_size)).flatten()
    out = dense_decode_attention(case.query, case.keys[tokens], case.values[tokens], case.scale)
    assert relative_error(out, dense) > 10 * ERROR_BOUND


def test_init_and_local_windows_are_always_kept() -> None:
    scores = torch.zeros(20)
    scores[7] = 5.0
    chosen = select_blocks(scores, keep=5, init_window=1, local_window=2).tolist()
    assert chosen[0] == 0 and chosen[-2:] == [18, 19] and 7 in chosen and len(chosen) == 5


def test_block_means_handle_a_partial_last_block() -> None:
    keys = torch.arange(10, dtype=torch.float32).reshape(10, 1, 1)
    means = block_means(keys, 4)
    assert means.flatten().tolist() == [1.5, 5.5, 8.5]


def test_esa_retrieves_every_stride_and_reuses_in_between() -> None:
    case = planted_needles(4096, seed=1)
    method = _method("ESA", sparse_ratio=0.2, retrieval_stride=3)
    state = DecodeState()
    retrieved = []
    for _ in range(7):
        res = method.decode(
            case.query, case.keys, case.values, state=state, block_size=case.block_size, scale=case.scale
        )
        retrieved.append(res.retrieved)
        assert case.recall(res.block_ids) == 1.0
    assert retrieved == [True, False, False, True, False, False, True]
    # features of full blocks are computed once, not per retrieval
    assert state.features_blocks == 4096 // case.block_size


@pytest.mark.parametrize("name", ["ESA", "KVStarMultiStep"])
def test_drift_cosine_zero_disables_the_drift_refresh(name: str) -> None:
    """``drift_cosine: 0`` is documented as off: unrelated queries then retrieve only every stride;
    with the default threshold the same queries refresh on every step (the control)."""
    case = planted_needles(4096, seed=2)
    gen = torch.Generator().manual_seed(0)
    queries = [torch.randn(case.query.shape, generator=gen) for _ in range(8)]  # unrelated directions

    def retrievals(**config: Any) -> list[bool]:
        method = _method(name, sparse_ratio=0.2, retrieval_stride=4, **config)
        state = DecodeState()
        return [
            method.decode(
                q, case.keys, case.values, state=state, block_size=case.block_size, scale=case.scale
            ).retrieved
            for q in queries
        ]

    assert retrievals(drift_cosine=0.0) == [True, False, False, False, True, False, False, False]
    assert retrievals() == [True] * 8


def test_reused_selection_follows_the_local_window_as_tokens_arrive() -> None:
    case = planted_needles(4096, seed=2)
    method = _method("ESA", sparse_ratio=0.2, retrieval_stride=100, local_window_sz=1)
    state = DecodeState()
    first = method.decode(case.query, case.keys, case.values, state=state, block_size=32, scale=case.scale)
    extra_k = torch.randn(40, case.keys.shape[1], case.keys.shape[2])
    keys = torch.cat([case.keys, extra_k])
    values = torch.cat([case.values, torch.randn_like(extra_k)])
    second = method.decode(case.query, keys, values, state=state, block_size=32, scale=case.scale)
    assert not second.retrieved
    assert set(first.block_ids.tolist()) <= set(second.block_ids.tolist())
    assert (4096 + 39) // 32 in second.block_ids.tolist()  # the new partial block


def test_gsa_hamming_similarity_tracks_angle() -> None:
    proj = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, generator=torch.Generator().manual_seed(1))
    near = x + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(2))
    far = -x
    hx, hn, hf = hash_codes(x, proj), hash_codes(near, proj), hash_codes(far, proj)
    assert int((hx != hn).sum()) < 30
    assert int((hx != hf).sum()) == 256


def test_kvstar_keeps_the_configured_dimensions_and_groups_queries() -> None:
    case = planted_needles(4096, seed=4, head_dim=64)
    method = _method(
        "KVStarMultiStep", sparse_ratio=0.2, dim_keep_ratio=0.25, query_group=3, retrieval_stride=3
    )
    state = DecodeState()
    for _ in range(4):
        res = method.decode(
            case.query, case.keys, case.values, state=state, block_size=case.block_size, scale=case.scale
        )
        assert case.recall(res.block_ids) == 1.0
    assert state.aux["dims"].shape == (2, 16)
    assert state.features is not None and state.features.shape == (2, 16, 4096)  # [H, kept dims, tokens]
    assert len(state.queries) == 3  # the last query_group decode queries, no more


@given(
    num_blocks=st.integers(1, 300),
    ratio=st.floats(0.01, 1.0),
    init=st.integers(0, 4),
    local=st.integers(1, 4),
    min_blocks=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=150, deadline=None)
def test_selection_respects_budget_and_windows(
    num_blocks: int, ratio: float, init: int, local: int, min_blocks: int, seed: int
) -> None:
    budget = BlockBudget(ratio, init, local, min_blocks)
    keep = budget.num_kept(num_blocks)
    scores = torch.randn(num_blocks, generator=torch.Generator().manual_seed(seed))
    chosen = select_blocks(scores, keep, init, local)
    ids = chosen.tolist()
    assert ids == sorted(set(ids)) and len(ids) == keep
    assert keep >= min(num_blocks, min_blocks)
    window = set(range(min(init, num_blocks))) | set(range(max(0, num_blocks - local), num_blocks))
    assert window <= set(ids)
    # whatever is chosen beyond the windows outranks whatever is not chosen
    rest = [b for b in range(num_blocks) if b not in window]
    picked = [float(scores[b]) for b in rest if b in ids]
    dropped = [float(scores[b]) for b in rest if b not in ids]
    if picked and dropped:
        assert min(picked) >= max(dropped)
