"""Layerwise loads (the connector's ``use_layerwise``): one task per layer, waited for layer by layer."""

from __future__ import annotations

import os

from conftest import NS

from ucm_client import BlockIO, BlockState, Segment, SharedBuffer, UcmClient
from ucm_client.gpu import LayerwiseLoad, layer_key


def test_layers_load_as_separate_tasks_and_are_waited_one_by_one(client: UcmClient) -> None:
    layers, nblocks, page = 4, 6, 32 << 10
    block_keys = [os.urandom(32) for _ in range(nblocks)]
    assert len({layer_key(k, layer) for k in block_keys for layer in range(layers)}) == layers * nblocks
    with SharedBuffer(layers * nblocks * page) as src, SharedBuffer(layers * nblocks * page) as dst:
        rs, rd = client.register(src), client.register(dst)
        src.buf[:] = os.urandom(src.size)

        def per_layer(region: int) -> list[list[BlockIO]]:
            return [
                [
                    BlockIO(layer_key(k, layer), (Segment(region, (layer * nblocks + b) * page, page),))
                    for b, k in enumerate(block_keys)
                ]
                for layer in range(layers)
            ]

        for blocks in per_layer(rs):  # saved layer by layer, as save_kv_layer would
            assert client.wait(client.dump(NS, blocks), 10).ok
        # The last layer's blocks are missing for one block: only that layer reports it.
        client.delete(NS, [layer_key(block_keys[2], layers - 1)])
        load = LayerwiseLoad(client, NS, [*per_layer(rd)[:-1], per_layer(rd)[-1]])
        assert len([t for t in load.tasks if t is not None]) == layers  # all submitted up front
        for layer in range(layers):
            result = load.wait_layer(layer, 10)
            assert result is not None and result.done
            expect = [BlockState.OK] * nblocks
            if layer == layers - 1:
                expect[2] = BlockState.MISSING
            assert result.states == expect
            assert load.wait_layer(layer, 10) is result  # waited once, answered from memory after
            start, stop = layer * nblocks * page, (layer + 1) * nblocks * page
            if layer < layers - 1:
                assert bytes(dst.buf[start:stop]) == bytes(src.buf[start:stop])
        empty = LayerwiseLoad(client, NS, [[], per_layer(rd)[1]])
        assert empty.wait_layer(0, 1) is None
        assert [r is None for r in empty.wait_all(10)] == [True, False]
