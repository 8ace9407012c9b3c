"""The loud-key shrink of ESA/KVStar scoring, kept with the features instead of recomputed per retrieval.

Stated behaviour: a key ``c`` times longer than the median key of its KV head scores as if it had
the median length (factor ``1/c``), a key of median length or shorter is untouched (factor 1), and
the factors kept in the decode state equal those computed from scratch after blocks were appended
(the cache follows the features; a stale one would not).
"""

from __future__ import annotations

import pytest
import torch

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.kernels.attention import channel_codes, channel_token_max, norm_shrink
from ucm_client.sparse.methods.block_sparse import ChannelMajorFeatures, DecodeState

BLOCK = 32


def _method(name: str) -> ChannelMajorFeatures:
    method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, {"sparse_ratio": 0.2})
    assert isinstance(method, ChannelMajorFeatures)
    return method


def _kept(method: ChannelMajorFeatures, state: DecodeState, keys: torch.Tensor) -> torch.Tensor:
    """The token-major keys a method codes: all channels (ESA) or its kept ones (KVStar)."""
    dims = state.aux.get("dims")
    n = state.features_blocks * BLOCK
    return keys[:n] if dims is None else torch.gather(keys[:n], 2, dims[None].expand(n, -1, -1))


def test_norm_shrink_scales_loud_keys_to_the_median_and_leaves_others() -> None:
    sq = torch.full((2, 1000), 4.0)  # every key of norm 2
    sq[0, 10] = 4.0 * 16  # 4x the median norm
    sq[1, 20] = 1.0  # half of it
    shrink = norm_shrink(sq)
    assert shrink[0, 10].item() == pytest.approx(0.25)
    assert shrink[1, 20].item() == 1.0
    assert bool((shrink[0, :10] == 1.0).all())


@pytest.mark.parametrize("name", ["ESA", "KVStarMultiStep"])
def test_cached_shrink_follows_appended_blocks(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(BLOCK * 40, 2, 64, generator=gen)
    keys[BLOCK * 30 :] *= 3.0  # later blocks are loud: the median moves when they are featured
    method, state = _method(name), DecodeState()
    method.extend_features(state, BLOCK * 20, BLOCK, lambda a, b: keys[a:b])
    assert state.features is not None
    # the norms are derived as blocks are featured (prefill), before any retrieval asks for them,
    # from the keys themselves (the codes round them to within a step of their block's loudest)
    decoded = method._coded(state.features, state).dequantize()
    torch.testing.assert_close(state.aux["sq_norms"], decoded.square().sum(dim=1), rtol=0.05, atol=0.5)
    early = method._shrink(state.features, state)
    assert early.shape == (2, BLOCK * 20)
    method.extend_features(state, BLOCK * 40, BLOCK, lambda a, b: keys[a:b])
    late = method._shrink(state.features, state)
    fresh = norm_shrink(channel_codes(_kept(method, state, keys), BLOCK)[1])
    assert late.shape == fresh.shape == (2, BLOCK * 40)
    torch.testing.assert_close(late, fresh)
    # negative control: the factors of the first 20 blocks changed with the median, so reusing the
    # early cache for them would be wrong
    assert not torch.allclose(early, fresh[:, : BLOCK * 20])


def test_a_loud_orthogonal_block_does_not_outscore_a_needle() -> None:
    gen = torch.Generator().manual_seed(1)
    n, dim = BLOCK * 8, 64
    keys = torch.randn(n, 1, dim, generator=gen)
    q = torch.zeros(1, 1, dim)
    q[0, 0, :16] = 1.0
    needle = 3 * BLOCK + 5
    keys[needle, 0, :16] = 1.5  # aligned with the query on its channels
    loud = slice(6 * BLOCK, 7 * BLOCK)
    keys[loud, 0, :16] = 8.0 * torch.sign(torch.randn(BLOCK, 16, generator=gen))  # loud, unaligned
    keys[loud, 0, :16] = keys[loud, 0, :16].abs()  # and on the query's side: large partial dots
    keys[loud, 0, 16:] = 40.0  # but far longer than any other key
    cm, sq_norms = channel_codes(keys, BLOCK)
    shrunk = channel_token_max(q, cm, 16, BLOCK, norm_shrink(sq_norms))[0, 0]
    raw = channel_token_max(q, cm, 16, BLOCK, torch.ones(1, n))[0, 0]
    assert int(raw.argmax()) == 6  # negative control: unshrunk, the loud block wins
    assert int(shrunk.argmax()) == 3


def test_query_group_scored_in_one_pass_equals_one_query_at_a_time() -> None:
    gen = torch.Generator().manual_seed(2)
    n, dim = BLOCK * 16, 32
    keys = torch.randn(n, 2, dim, generator=gen)
    cm, sq_norms = channel_codes(keys, BLOCK)
    shrink = norm_shrink(sq_norms)
    group = torch.randn(4, 2, dim, generator=gen)  # 4 x 16 channels >= 32: the one-pass branch
    together = channel_token_max(group, cm, 16, BLOCK, shrink)
    alone = torch.cat([channel_token_max(group[i : i + 1], cm, 16, BLOCK, shrink) for i in range(4)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-4)
    # negative control: all channels instead of each query's 16 give other scores
    full = channel_token_max(group[:1], cm, dim, BLOCK, shrink)
    assert not torch.allclose(full, alone[:1], rtol=1e-3, atol=1e-3)
