"""The compiled scoring loop (``ucm_client.sparse.kernels.scoring``) through its torch entry point.

Stated behaviour: on the same int8 codes the loop gives what plain float arithmetic gives, for one
query and for a group, with channel counts that are not a multiple of its four-channel step; and
importing it leaves a process where vLLM can still start an engine (vLLM's CPU worker scans every
module's globals with ``vars(value).get(...)``, which llvmlite's library handle broke).
"""

from __future__ import annotations

import sys

import pytest
import torch

from ucm_client.sparse.kernels.attention import (
    channel_codes,
    channel_codes_reference,
    channel_token_max,
    norm_shrink,
)

BLOCK = 32


@pytest.mark.parametrize("block", [BLOCK, 6])  # 6: the block maximum's tail past its 4-wide steps
@pytest.mark.slow
def test_compiled_scores_equal_the_float_reference_and_a_wrong_query_does_not(block: int) -> None:
    """The compiled loop against plain float arithmetic on the same codes: every block's best token."""
    gen = torch.Generator().manual_seed(3)
    n, heads, dim = block * 24, 4, 64
    keys = torch.randn(n, heads, dim, generator=gen)
    keys[5 * block + 3] *= 30.0  # a loud token sets its block's scales; others keep theirs
    coded, sq_norms = channel_codes(keys, block)
    decoded = coded.dequantize()  # [H, D, n]
    torch.testing.assert_close(decoded.permute(2, 0, 1), keys, atol=keys.abs().max() / 250, rtol=0)
    shrink = norm_shrink(sq_norms)
    for count, channels in ((1, 16), (1, 6), (2, 16), (4, 16)):  # 6: padded to a multiple of 4
        queries = torch.randn(count, heads, dim, generator=gen)
        got = channel_token_max(queries, coded, channels, block, shrink)
        chosen = torch.topk(queries.abs(), channels, dim=-1).indices
        masked = torch.zeros_like(queries).scatter_(-1, chosen, queries.gather(-1, chosen))
        dots = torch.einsum("xhc,hcn->xhn", masked, decoded) * shrink
        want = dots.view(count, heads, -1, block).amax(dim=-1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        other = channel_token_max(-queries, coded, channels, block, shrink)  # negative control
        assert not torch.allclose(other, want, rtol=1e-2, atol=1e-2)


def test_every_loaded_module_global_answers_vllms_kernel_scan() -> None:
    """What ``vllm.triton_utils.dispatcher._rebind_kernels`` does to every global of every module."""
    import ucm_client.sparse.kernels.scoring  # noqa: F401  (numba and llvmlite loaded)

    assert "llvmlite.binding.ffi" in sys.modules
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if hasattr(value, "__dict__"):
                vars(value).get("kernel")  # raised AttributeError for llvmlite's handle before


@pytest.mark.slow
def test_gsa_compiled_hamming_equals_torch_bit_counts_and_a_wrong_query_does_not() -> None:
    """GSA on the host (one compiled call: query code, mask, Hamming loop) against GSAOnDevice (torch
    projection, packing and popcounts) on the same codes."""
    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.methods.block_sparse import DecodeState

    gen = torch.Generator().manual_seed(4)
    keys = torch.randn(BLOCK * 12, 4, 64, generator=gen)
    query = torch.randn(1, 16, 64, generator=gen)
    scores = []
    for name, q in (("GSA", query), ("GSAOnDevice", query), ("GSA", -query)):
        method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, {"sparse_ratio": 0.2})
        state = DecodeState()
        method.extend_features(state, keys.shape[0], BLOCK, lambda a, b: keys[a:b])
        assert state.features is not None
        scores.append(method._score(q, state.features, state))
    assert scores[0].shape == (4, 12)
    torch.testing.assert_close(scores[0], scores[1])
    assert not torch.allclose(scores[0], scores[2])  # negative control: the opposite query


@pytest.mark.parametrize("block", [BLOCK, 6])
def test_compiled_coding_equals_torch_coding(block: int) -> None:
    """The compiled coding pass against torch ops on the same keys: codes, scales and norms, with a
    loud token and an all-zero channel block (whose scale is the floor, codes 0)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(block * 10, 3, 64, generator=gen)
    keys[2 * block + 1, 1] *= 50.0
    keys[4 * block : 5 * block, 2, 7] = 0.0
    coded, norms = channel_codes(keys, block)
    want, want_norms = channel_codes_reference(keys, block)
    torch.testing.assert_close(coded.scales, want.scales)
    torch.testing.assert_close(norms, want_norms, rtol=1e-5, atol=1e-4)
    mismatched = (coded.codes != want.codes).float().mean().item()
    assert mismatched < 1e-4  # a tie at .5 may round either way after division (none expected)
    assert coded.codes.dtype == torch.int8 and int(coded.codes[2, 7, 4 * block : 5 * block].abs().sum()) == 0
    other, _ = channel_codes(-keys, block)  # negative control: the codes follow the keys
    assert torch.equal(other.codes, -coded.codes) and not torch.equal(other.codes, coded.codes)


@pytest.mark.parametrize("name", ["ESA", "KVStarMultiStep"])
def test_host_scoring_in_one_call_equals_the_torch_operations_it_replaced(name: str) -> None:
    """``grouped_block_max`` (query groups summed, channels chosen, scored and scaled in one compiled
    call) against the torch path it replaced: group sums, ``topk`` of magnitudes, ``channel_token_max``."""
    import math

    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.kernels.attention import group_query
    from ucm_client.sparse.methods.block_sparse import DecodeState

    gen = torch.Generator().manual_seed(5)
    heads, dim = 4, 64
    keys = torch.randn(BLOCK * 16, heads, dim, generator=gen)
    config = {"sparse_ratio": 0.2, "dim_keep_ratio": 0.5} if name != "ESA" else {"sparse_ratio": 0.2}
    method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, config)
    state = DecodeState()
    method.extend_features(state, keys.shape[0], BLOCK, lambda a, b: keys[a:b])
    assert state.features is not None
    queries = torch.randn(3, 16, dim, generator=gen)  # three steps of 16 query heads (4 per KV head)
    dims = state.aux.get("dims", torch.arange(dim).expand(heads, -1))
    grouped = torch.stack([group_query(q, heads).sum(dim=1) for q in queries]).gather(
        2, dims[None].expand(3, -1, -1)
    )
    shrink = method._shrink(state.features, state)
    want = channel_token_max(grouped, method._coded(state.features, state), 16, BLOCK, shrink) / math.sqrt(
        dim
    )
    got = method._host_scores(queries, state.features, state, dims.contiguous(), 1.0 / math.sqrt(dim))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    other = method._host_scores(-queries, state.features, state, dims.contiguous(), 1.0 / math.sqrt(dim))
    assert not torch.allclose(other, want, rtol=1e-2, atol=1e-2)  # negative control: opposite queries


def test_compiled_top_blocks_equals_aggregate_then_select() -> None:
    """``top_blocks`` (softmax per head, best head per block, windows forced, top-k, sorted) against
    ``select_blocks(aggregate_heads(...))`` on scores where only a featured prefix of blocks is scored."""
    import numpy as np

    from ucm_client.sparse.kernels.attention import aggregate_heads, select_blocks
    from ucm_client.sparse.kernels.scoring import top_blocks

    gen = torch.Generator().manual_seed(6)
    for heads, full, num_blocks, keep, init, local in (
        (8, 60, 64, 13, 1, 2),
        (2, 9, 10, 5, 1, 2),
        (4, 40, 40, 8, 0, 1),
    ):
        block_scores = torch.randn(heads, full, generator=gen) * 3
        padded = torch.full((heads, num_blocks), float("-inf"))
        padded[:, :full] = block_scores
        want = select_blocks(aggregate_heads(padded), keep, init, local)
        out = np.empty(num_blocks, np.int64)
        count = top_blocks(block_scores.numpy(), num_blocks, keep, init, local, out)
        assert out[:count].tolist() == want.tolist()
        count = top_blocks((-block_scores).numpy(), num_blocks, keep, init, local, out)
        assert out[:count].tolist() != want.tolist()  # negative control: reversed scores


def test_compiled_top_blocks_per_head_equals_select_per_head() -> None:
    """``top_blocks_per_head`` (windows forced, each KV head's own top-k, sorted) against
    ``select_blocks_per_head`` on scores where only a featured prefix of blocks is scored."""
    import numpy as np

    from ucm_client.sparse.kernels.attention import select_blocks_per_head
    from ucm_client.sparse.kernels.scoring import top_blocks_per_head

    gen = torch.Generator().manual_seed(8)
    for heads, full, num_blocks, keep, init, local in (
        (8, 255, 256, 52, 1, 2),
        (2, 9, 10, 5, 1, 2),
        (4, 40, 40, 8, 0, 1),
    ):
        block_scores = torch.randn(heads, full, generator=gen) * 3
        padded = torch.full((heads, num_blocks), float("-inf"))
        padded[:, :full] = block_scores
        want = select_blocks_per_head(padded, keep, init, local)
        out = np.empty((heads, num_blocks), np.int64)
        count = top_blocks_per_head(block_scores.numpy(), num_blocks, keep, init, local, out)
        assert out[:, :count].tolist() == want.tolist()
        assert len({tuple(row) for row in out[:, :count].tolist()}) > 1  # the heads chose differently
        count = top_blocks_per_head((-block_scores).numpy(), num_blocks, keep, init, local, out)
        assert out[:, :count].tolist() != want.tolist()  # negative control: reversed scores


def test_compiled_query_directions_equal_torch() -> None:
    """The drift anchor: unit direction of each KV head's summed query group, compiled vs torch."""
    from ucm_client.sparse.kernels.attention import group_query
    from ucm_client.sparse.methods.block_sparse import BlockSparseMethod

    query = torch.randn(32, 128, generator=torch.Generator().manual_seed(7))
    got = BlockSparseMethod._direction(query, 8)
    summed = group_query(query, 8).sum(dim=1)
    torch.testing.assert_close(got, summed / summed.norm(dim=-1, keepdim=True), rtol=1e-5, atol=1e-6)
