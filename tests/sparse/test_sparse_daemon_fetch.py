"""ESA fetching its non-resident blocks from a real ucm-server (the `daemon` fixture's process)."""

from __future__ import annotations

import torch

from ucm_client import UcmClient, namespace_id
from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.block_sparse import DecodeState
from ucm_client.sparse.daemon_fetcher import DaemonBlockFetcher
from ucm_client.sparse.esa import ESA
from ucm_client.sparse.esa_offload import BlockFetcher, BlockKV, OffloadedSequence
from ucm_client.sparse.testing import planted_needles, relative_error

BS = 32
N = 4096


def test_esa_fetches_selected_blocks_from_the_daemon(client: UcmClient) -> None:
    case = planted_needles(N, seed=5)
    nb = N // BS
    kv_heads, head_dim = case.keys.shape[1], case.keys.shape[2]
    fetcher = DaemonBlockFetcher(
        client,
        namespace_id(test="esa"),
        b"request-1",
        block_size=BS,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )
    assert isinstance(fetcher, BlockFetcher)
    try:
        fetcher.store(
            {
                b: BlockKV(case.keys[b * BS : (b + 1) * BS], case.values[b * BS : (b + 1) * BS])
                for b in range(nb)
            }
        )
        client.delete(namespace_id(test="esa"), [fetcher.key(7)])  # one block the daemon no longer has
        esa = ESA(UcmSparseRole.WORKER, {"sparse_ratio": 0.2, "retrieval_stride": 4, "local_window_sz": 2})
        seq = OffloadedSequence.from_prefill(
            esa,
            fetcher,
            case.keys,
            case.values,
            block_size=BS,
            resident_blocks=40,
            keep_resident=[0, nb - 2, nb - 1],
        )
        res = seq.decode(case.query, case.scale)
        assert fetcher.calls == 1 and res.fetched  # one batched Load for the selection
        assert set(case.needle_blocks.tolist()) <= set(res.block_ids.tolist())
        assert set(res.missing) <= {7}  # reported, never invented
        if not res.missing:
            # Same selection over fully resident KV: the bytes that came through the daemon are exact.
            ref = ESA(UcmSparseRole.WORKER, {"sparse_ratio": 0.2}).decode(
                case.query, case.keys, case.values, state=DecodeState(), block_size=BS, scale=case.scale
            )
            assert torch.equal(ref.block_ids, res.block_ids)
            assert relative_error(res.output, ref.output) < 1e-5
        got = fetcher.fetch([3, 7])
        assert set(got) == {3}
        assert torch.equal(got[3].keys, case.keys[3 * BS : 4 * BS])
        assert torch.equal(got[3].values, case.values[3 * BS : 4 * BS])
    finally:
        fetcher.close()
