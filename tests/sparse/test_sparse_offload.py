"""ESA with most blocks in a store: only selected, non-resident blocks are fetched, in one batch.

``InMemoryBlockFetcher`` is a real in-process store (a dict), standing in for the daemon's loads.
"""

from __future__ import annotations

import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.block_sparse import DecodeState
from ucm_client.sparse.esa import ESA
from ucm_client.sparse.esa_offload import BlockFetcher, BlockKV, InMemoryBlockFetcher, OffloadedSequence
from ucm_client.sparse.kernels import dense_decode_attention
from ucm_client.sparse.testing import NeedleCase, planted_needles, relative_error

BS = 32


def _setup(
    n: int = 4096, *, drop: int | None = None
) -> tuple[NeedleCase, InMemoryBlockFetcher, OffloadedSequence]:
    case = planted_needles(n, seed=5)
    store = InMemoryBlockFetcher()
    for b in range(n // BS):
        if b != drop:
            sl = slice(b * BS, (b + 1) * BS)
            store.put(b, BlockKV(case.keys[sl].clone(), case.values[sl].clone()))
    esa = ESA(UcmSparseRole.WORKER, {"sparse_ratio": 0.2, "retrieval_stride": 4, "local_window_sz": 2})
    nb = n // BS
    seq = OffloadedSequence.from_prefill(
        esa,
        store,
        case.keys,
        case.values,
        block_size=BS,
        resident_blocks=40,
        keep_resident=[0, nb - 2, nb - 1],
    )
    return case, store, seq


def test_in_memory_fetcher_is_a_block_fetcher() -> None:
    assert isinstance(InMemoryBlockFetcher(), BlockFetcher)


def test_fetches_exactly_the_selected_non_resident_blocks_once() -> None:
    case, store, seq = _setup()
    res = seq.decode(case.query, case.scale)
    selected = set(res.block_ids.tolist())
    assert store.calls == 1  # one batched request
    assert set(store.requested[0]) == selected - {0, 126, 127}
    assert set(case.needle_blocks.tolist()) <= selected
    assert res.missing == ()
    # The same selection over fully resident KV gives the same attention output.
    ref = ESA(UcmSparseRole.WORKER, {"sparse_ratio": 0.2}).decode(
        case.query, case.keys, case.values, state=DecodeState(), block_size=BS, scale=case.scale
    )
    assert torch.equal(ref.block_ids, res.block_ids)
    assert relative_error(res.output, ref.output) < 1e-5
    # Next steps reuse the selection, now resident: nothing more is fetched.
    for _ in range(3):
        again = seq.decode(case.query, case.scale)
        assert again.fetched == ()
    assert store.calls == 1


def test_new_tokens_fill_blocks_that_become_resident() -> None:
    case, _store, seq = _setup()
    q = case.query
    seq.decode(q, case.scale)
    k_new = torch.randn(BS, 2, 64)
    for i in range(BS):
        seq.append(k_new[i], k_new[i])
    assert seq.num_tokens == 4096 + BS and 4096 // BS in seq.resident
    res = seq.decode(q, case.scale)
    assert (4096 // BS) in res.block_ids.tolist()


def test_a_block_the_store_lacks_is_reported_missing_not_invented() -> None:
    probe, _, _ = _setup()
    needle = int(probe.needle_blocks[0])
    case, _store, seq = _setup(drop=needle)
    res = seq.decode(case.query, case.scale)
    assert res.missing == (needle,)
    # Attention ran without it, so the error against dense is visible (not silently filled in).
    dense = dense_decode_attention(case.query, case.keys, case.values, case.scale)
    assert relative_error(res.output, dense) > 0.05


def test_resident_set_is_bounded() -> None:
    case, _store, seq = _setup()
    seq.decode(case.query, case.scale)
    assert len(seq.resident) <= 40
