"""Cold KV's next-layer prefetch, against a real ucm-server, driven through the worker itself.

The worker is what vLLM's attention backend calls per layer (``resolve_rows``); here its KV caches
are plain tensors, so every page's bytes are known and each check says exactly which bytes a layer's
scratch blocks must hold. What a user would notice if the prefetch were wrong is a layer attending
to another layer's KV, or to a block it did not select: both are compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from ucm_client import UcmClient
from ucm_client.sparse.coldkv.orders import (
    ColdDump,
    ColdKVConfig,
    ColdKVStepMeta,
    ColdRelease,
    cold_block_key,
)
from ucm_client.sparse.coldkv.worker import ColdKVWorker
from ucm_client.sparse.errors import SparseInputError
from ucm_server.testing.daemon import DaemonProcess

LAYERS = 3
NUM_BLOCKS = 16
COLD = tuple(range(10))  # logical = physical blocks 0..9 go to the daemon
SCRATCH = (10, 11, 12)
NONCE = "engine-a"
PAGE = (2, 4, 2, 8)  # K/V, block size, KV heads, head dim


def _caches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        f"model.layers.{layer}.self_attn.attn": torch.randn((NUM_BLOCKS, *PAGE), generator=gen)
        for layer in range(LAYERS)
    }


Pair = tuple[ColdKVWorker, dict[int, torch.Tensor]]


@pytest.fixture
def worker_pair(daemon: DaemonProcess) -> Iterator[Callable[..., Pair]]:
    """Makes a worker whose request ``r`` has blocks 0..9 in the daemon, with each layer's original
    pages (the freed blocks in its caches are overwritten, as vLLM would reuse them)."""

    def make(prefetch: bool) -> Pair:
        caches = _caches()
        worker = ColdKVWorker(ColdKVConfig(target=daemon.target, prefetch=prefetch), caches)
        original = {layer: cache.clone() for layer, cache in worker.caches.items()}
        worker.apply(
            ColdKVStepMeta(
                NONCE,
                dumps=(ColdDump("r", COLD, COLD),),
                releases=(ColdRelease("r", COLD[0], COLD[-1] + 1, SCRATCH),),
            )
        )
        for cache in worker.caches.values():  # freed blocks get other requests' KV
            cache[: len(COLD)] = float("nan")
        return worker, original

    made: list[ColdKVWorker] = []

    def factory(prefetch: bool = True) -> Pair:
        worker, original = make(prefetch)
        made.append(worker)
        return worker, original

    yield factory
    for worker in made:
        worker.close()


def _step(worker: ColdKVWorker, selections: list[list[int]]) -> list[torch.Tensor]:
    """One decode step of request ``r``: each layer's selection resolved in order, as attention does."""
    table = torch.arange(NUM_BLOCKS)
    return [
        worker.resolve_rows(layer, [("r", torch.tensor(sel), table)])[0]
        for layer, sel in enumerate(selections)
    ]


def _assert_pages(
    worker: ColdKVWorker,
    original: dict[int, torch.Tensor],
    selections: list[list[int]],
    resolved: list[torch.Tensor],
) -> None:
    for layer, (sel, ids) in enumerate(zip(selections, resolved, strict=True)):
        got = worker.caches[layer][ids]
        assert torch.equal(got, original[layer][torch.tensor(sel)]), f"layer {layer} attends to wrong KV"


@pytest.mark.slow
def test_blocks_the_previous_layer_chose_come_from_the_prefetch(worker_pair: Callable[..., Pair]) -> None:
    worker, original = worker_pair()
    selections = [[1, 4, 7], [1, 4, 8], [2, 5, 9]]
    resolved = _step(worker, selections)
    _assert_pages(worker, original, selections, resolved)
    assert worker.stats["prefetch_hits"] == 2  # layer 1 took blocks 1 and 4 from layer 0's guess
    assert worker.stats["loaded_pages"] == 3 + 1 + 3  # layer 0 all, layer 1 block 8, layer 2 all
    assert worker.stats["prefetched_pages"] == 3 + 3  # guesses for layers 1 and 2; none after the last


@pytest.mark.slow
def test_without_prefetch_every_page_is_loaded_on_the_layers_path(worker_pair: Callable[..., Pair]) -> None:
    worker, original = worker_pair(prefetch=False)
    selections = [[1, 4, 7], [1, 4, 8], [2, 5, 9]]
    resolved = _step(worker, selections)
    _assert_pages(worker, original, selections, resolved)
    assert worker.stats["prefetch_hits"] == worker.stats["prefetched_pages"] == 0
    assert worker.stats["loaded_pages"] == 9


@pytest.mark.slow
def test_a_guess_skips_blocks_the_next_layer_holds(worker_pair: Callable[..., Pair]) -> None:
    worker, original = worker_pair()
    _step(worker, [[1, 4, 7], [1, 4, 8], [1, 4, 8]])
    sent, hits = worker.stats["prefetched_pages"], worker.stats["prefetch_hits"]
    second = [[1, 4, 7], [1, 4, 9], [1, 4, 9]]  # the next step: layer 0 keeps its selection
    resolved = _step(worker, second)
    _assert_pages(worker, original, second, resolved)
    # Layer 0 loaded nothing new, so it guesses nothing; layer 1 brought in 9 and sends only 9
    # (1 and 4 are in layer 2's scratch already), which layer 2 then takes.
    assert worker.stats["prefetched_pages"] - sent == 1
    assert worker.stats["prefetch_hits"] - hits == 1


@pytest.mark.slow
def test_a_guess_the_daemon_cannot_serve_is_not_used(
    worker_pair: Callable[..., Pair], client: UcmClient
) -> None:
    worker, original = worker_pair()
    namespace = worker.config.namespace_bytes(NONCE)
    client.delete(namespace, [cold_block_key(NONCE, "r", 1, 7)])  # layer 1's copy of block 7 is gone
    selections = [[1, 4, 7], [1, 4, 8], [1, 4, 8]]
    resolved = _step(worker, selections)  # layer 1 does not select 7: nothing fails
    _assert_pages(worker, original, selections, resolved)
    assert worker.stats["prefetch_failed"] == 0
    assert worker.stats["prefetch_hits"] == 2 + 3


@pytest.mark.slow
def test_a_guess_for_one_request_never_serves_another(worker_pair: Callable[..., Pair]) -> None:
    """Two cold requests with the same logical blocks: each layer gets its own request's pages."""
    worker, _ = worker_pair()
    worker.apply(
        ColdKVStepMeta(NONCE, releases=(ColdRelease("s", COLD[0], COLD[-1] + 1, (13, 14, 15)),))
    )  # ``s`` has no objects in the daemon: if it were served ``r``'s pages, they would be wrong
    table = torch.arange(NUM_BLOCKS)
    worker.resolve_rows(0, [("r", torch.tensor([1, 4, 7]), table)])
    with pytest.raises(RuntimeError, match="cold KV load"):
        worker.resolve_rows(1, [("s", torch.tensor([1, 4, 7]), table)])
    assert worker.stats["prefetch_hits"] == 0


def test_prefetch_setting_is_checked() -> None:
    with pytest.raises(SparseInputError, match=r"cold_kv\.prefetch must be true or false, got 'yes'"):
        ColdKVConfig.from_extra({"cold_kv": {"target": "/tmp/x.sock", "prefetch": "yes"}})
    assert ColdKVConfig.from_extra({"cold_kv": {"target": "/tmp/x.sock"}}).prefetch is True  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_block_the_guess_missed_is_loaded_by_the_layer(
    worker_pair: Callable[..., Pair], client: UcmClient
) -> None:
    """The guess ran while layer 1's block 7 was missing; it is back when layer 1 asks for it."""
    worker, original = worker_pair()
    namespace = worker.config.namespace_bytes(NONCE)
    key = cold_block_key(NONCE, "r", 1, 7)
    client.delete(namespace, [key])
    table = torch.arange(NUM_BLOCKS)
    layer0 = worker.resolve_rows(0, [("r", torch.tensor([1, 4, 7]), table)])[0]
    guess = worker._prefetch
    assert guess is not None and guess.pages == [("r", 1), ("r", 4), ("r", 7)]
    assert worker.client.wait(guess.task.result(10), 10).done  # the guess ended, without block 7
    assert client.put_blocks(namespace, [(key, original[1][7].numpy().tobytes())]).ok
    layer1 = worker.resolve_rows(1, [("r", torch.tensor([1, 4, 7]), table)])[0]
    _assert_pages(worker, original, [[1, 4, 7], [1, 4, 7]], [layer0, layer1])
    assert worker.stats["prefetch_hits"] == 2
    assert worker.stats["loaded_pages"] == 3 + 1


def _assert_head_pages(
    worker: ColdKVWorker, original: dict[int, torch.Tensor], layer: int, sel: torch.Tensor, ids: torch.Tensor
) -> None:
    for head in range(sel.shape[0]):
        got = worker.caches[layer][ids[head], head]
        assert torch.equal(got, original[layer][sel[head], head]), f"layer {layer} head {head}: wrong KV"


def test_per_head_selections_load_a_block_once_into_each_heads_page(worker_pair: Callable[..., Pair]) -> None:
    """Each KV head selects its own blocks; a block two heads chose comes from the daemon once, and
    each head's page of a scratch block holds that head's KV of its own block."""
    worker, original = worker_pair(prefetch=False)
    table = torch.arange(NUM_BLOCKS)
    sel = torch.tensor([[1, 4, 7], [2, 4, 9]])  # block 4 is both heads'
    ids = worker.resolve_rows(0, [("r", sel, table)])[0]
    assert ids.shape == sel.shape and set(ids.flatten().tolist()) <= set(SCRATCH)
    _assert_head_pages(worker, original, 0, sel, ids)
    assert worker.stats["loaded_pages"] == 5 and worker.stats["load_tasks"] == 1  # 1, 2, 4, 7, 9 once
    # Each head uses no more scratch blocks than a shared selection of the same size would.
    assert len(set(ids[0].tolist())) == len(set(ids[1].tolist())) == 3
    # Negative control: the heads' pages differ where they chose different blocks.
    assert not torch.equal(worker.caches[0][ids[0, 0], 1], original[0][1, 1])
    again = worker.resolve_rows(0, [("r", sel, table)])[0]  # the selection is kept: nothing loads
    assert torch.equal(again, ids) and worker.stats["loaded_pages"] == 5
    moved = torch.tensor([[1, 4, 8], [2, 4, 9]])  # head 0 moves on; head 1 keeps its blocks
    ids = worker.resolve_rows(0, [("r", moved, table)])[0]
    _assert_head_pages(worker, original, 0, moved, ids)
    assert worker.stats["loaded_pages"] == 6


def test_per_head_guess_serves_the_next_layers_heads(worker_pair: Callable[..., Pair]) -> None:
    worker, original = worker_pair()
    table = torch.arange(NUM_BLOCKS)
    first = torch.tensor([[1, 4, 7], [2, 4, 9]])
    second = torch.tensor([[2, 4, 7], [1, 5, 9]])  # other heads, mostly the same blocks
    ids0 = worker.resolve_rows(0, [("r", first, table)])[0]
    assert worker.stats["prefetched_pages"] == 5  # the union, each block once
    ids1 = worker.resolve_rows(1, [("r", second, table)])[0]
    _assert_head_pages(worker, original, 0, first, ids0)
    _assert_head_pages(worker, original, 1, second, ids1)
    assert worker.stats["prefetch_hits"] == 5  # 1, 2, 4, 7 and 9 were guessed (each once); 5 was not
    assert worker.stats["loaded_pages"] == 5 + 1
