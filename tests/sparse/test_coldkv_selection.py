"""ESA's selected blocks of a request whose cold KV lives in a real ucm-server, through the cold-KV worker.

What the offload prototype's tests asked of a store behind ESA, asked of the path vLLM runs: the
request's cold blocks are dumped, their pages in the KV cache are overwritten (vLLM hands them to
other requests), and each decode step's selection is resolved by the worker, which loads exactly the
selected cold blocks, once, in one batched task, into the request's scratch blocks. Attention over
the resolved pages must equal ESA's attention over the whole KV held in memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ucm_client import UcmClient
from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.coldkv.orders import (
    ColdDump,
    ColdKVConfig,
    ColdKVStepMeta,
    ColdRelease,
    cold_block_key,
)
from ucm_client.sparse.coldkv.worker import ColdKVWorker
from ucm_client.sparse.errors import SparseInputError
from ucm_client.sparse.kernels.attention import blocks_to_tokens, dense_decode_attention
from ucm_client.sparse.kernels.paged import PageLayout, read_request_kv
from ucm_client.sparse.methods.block_sparse import DecodeState
from ucm_client.sparse.methods.esa import ESA
from ucm_client.sparse.testing import NeedleCase, planted_needles, relative_error
from ucm_server.testing.daemon import DaemonProcess

BS = 32
N = 4096
NB = N // BS
FIRST, LAST = 1, NB - 2  # the initial window (block 0) and the local window stay in vLLM's cache
NONCE = "engine-a"
LAYER = "model.layers.0.self_attn.attn"


def _esa() -> ESA:
    return ESA(UcmSparseRole.WORKER, {"sparse_ratio": 0.2, "retrieval_stride": 4, "local_window_sz": 2})


def _paged(case: NeedleCase, num_blocks: int) -> torch.Tensor:
    """The case's KV in a paged cache of ``num_blocks`` blocks (logical = physical): per (block, head)
    page the keys token-major, then the values (``kernels.paged``'s ``TOKEN_MAJOR``)."""
    kv_heads, dim = case.keys.shape[1], case.keys.shape[2]
    cache = torch.zeros(num_blocks, kv_heads, BS, 2 * dim)
    halves = cache.view(num_blocks, kv_heads, 2 * BS, dim)
    halves[:NB, :, :BS] = case.keys.reshape(NB, BS, kv_heads, dim).transpose(1, 2)
    halves[:NB, :, BS:] = case.values.reshape(NB, BS, kv_heads, dim).transpose(1, 2)
    return cache


class Request:
    """One request of ``N`` tokens whose blocks ``FIRST..LAST-1`` were dumped and freed."""

    def __init__(self, daemon: DaemonProcess, *, scratch: int = 26) -> None:
        self.case = planted_needles(N, seed=5)
        self.cache = _paged(self.case, NB + scratch)
        self.scratch = tuple(range(NB, NB + scratch))
        self.worker = ColdKVWorker(ColdKVConfig(target=daemon.target, prefetch=False), {LAYER: self.cache})
        cold = tuple(range(FIRST, LAST))
        self.worker.apply(
            ColdKVStepMeta(
                NONCE,
                dumps=(ColdDump("r", cold, cold),),
                releases=(ColdRelease("r", FIRST, LAST, self.scratch),),
            )
        )
        self.cache[FIRST:LAST] = float("nan")  # freed: vLLM writes other requests' KV there
        self.esa = _esa()
        self.state = DecodeState()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step: ESA selects (features from the prefill's keys), the worker resolves; the
        selection and the attention output over the resolved pages."""
        case = self.case
        sel, _ = self.esa.select(case.query, N, self.state, BS, lambda a, b: case.keys[a:b])
        physical = self.worker.resolve_rows(0, [("r", sel, torch.arange(NB))])[0]
        keys, values = read_request_kv(self.cache, physical, sel.numel() * BS, PageLayout.TOKEN_MAJOR)
        return sel, dense_decode_attention(case.query, keys, values, case.scale)


@pytest.fixture
def request_in_daemon(daemon: DaemonProcess) -> Iterator[Request]:
    req = Request(daemon)
    yield req
    req.worker.close()


def test_selected_cold_blocks_load_once_in_one_task_and_attend_exactly(request_in_daemon: Request) -> None:
    req = request_in_daemon
    case = req.case
    sel, out = req.step()
    cold = [b for b in sel.tolist() if FIRST <= b < LAST]
    assert set(case.needle_blocks.tolist()) <= set(sel.tolist())
    assert req.worker.stats["load_tasks"] == 1  # one batched Load for the selection
    assert req.worker.stats["loaded_pages"] == len(cold) > 0  # exactly the selected cold blocks
    # The same selection over the whole KV held in memory: the bytes that came through the daemon are exact.
    ref = _esa().decode(
        case.query, case.keys, case.values, state=DecodeState(), block_size=BS, scale=case.scale
    )
    assert torch.equal(ref.block_ids, sel)
    assert relative_error(out, ref.output) < 1e-5
    expected = dense_decode_attention(
        case.query,
        case.keys[blocks_to_tokens(sel, BS, N)],
        case.values[blocks_to_tokens(sel, BS, N)],
        case.scale,
    )
    assert relative_error(out, expected) < 1e-5
    # Next steps reuse the selection, now in scratch blocks: nothing more is loaded.
    for _ in range(3):
        again, out_again = req.step()
        assert torch.equal(again, sel)
        assert relative_error(out_again, ref.output) < 1e-5
    assert req.worker.stats["load_tasks"] == 1
    assert req.worker.stats["reused_pages"] == 3 * len(cold)


def test_a_block_the_daemon_lacks_fails_the_step_never_invented(
    request_in_daemon: Request, client: UcmClient
) -> None:
    req = request_in_daemon
    needle = int(req.case.needle_blocks[0])
    assert FIRST <= needle < LAST
    client.delete(req.worker.config.namespace_bytes(NONCE), [cold_block_key(NONCE, "r", 0, needle)])
    with pytest.raises(RuntimeError, match=r"cold KV load of \d+ blocks failed for 1 of them"):
        req.step()


def test_blocks_outside_the_cold_range_stay_the_requests_own(request_in_daemon: Request) -> None:
    """Blocks filled after the dump (and the windows) are read where they are, never loaded."""
    req = request_in_daemon
    sel = torch.tensor([0, 5, LAST, NB - 1])
    physical = req.worker.resolve_rows(0, [("r", sel, torch.arange(NB))])[0]
    assert physical[0] == 0 and physical[2] == LAST and physical[3] == NB - 1
    assert int(physical[1]) in req.scratch
    assert req.worker.stats["loaded_pages"] == 1


def test_a_selection_larger_than_the_scratch_blocks_is_refused(daemon: DaemonProcess) -> None:
    req = Request(daemon, scratch=2)
    try:
        with pytest.raises(SparseInputError, match="selected 3 cold blocks, but it has 2 scratch blocks"):
            req.worker.resolve_rows(0, [("r", torch.tensor([1, 2, 3]), torch.arange(NB))])
    finally:
        req.worker.close()
