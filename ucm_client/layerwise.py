"""Layerwise loads: one load task per layer, waited for layer by layer.

The connector's ``use_layerwise`` submits every layer's task at once and waits per layer, so the copy
of layer L+1 runs while layer L computes. Keys of one layer's part of a block come from
:func:`ucm_client.vllm.identity.layer_key`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ucm_client.types import BlockIO, TaskResult

if TYPE_CHECKING:
    from ucm_client.sync import UcmClient

__all__ = ["LayerwiseLoad"]


class LayerwiseLoad:
    """One load task per layer, all submitted at once; :meth:`wait_layer` waits for one layer only.

    The daemon runs the tasks concurrently, so while the model computes layer L the copies of the
    following layers proceed; the forward calls ``wait_layer(L)`` right before layer L's attention.
    Blocks stored per layer (keys from :func:`~ucm_client.vllm.identity.layer_key`) make each layer
    its own small block.
    """

    def __init__(self, client: UcmClient, namespace: bytes, per_layer: Sequence[Sequence[BlockIO]]) -> None:
        self._client = client
        self.tasks = [client.load(namespace, list(blocks)) if blocks else None for blocks in per_layer]
        self.results: dict[int, TaskResult] = {}

    def wait_layer(self, layer: int, timeout_s: float) -> TaskResult | None:
        """Layer ``layer``'s result (``None`` if it had no blocks); cancels it if it times out."""
        if layer in self.results:
            return self.results[layer]
        task = self.tasks[layer]
        if task is None:
            return None
        result = self._client.wait(task, timeout_s, cancel_on_timeout=True)
        self.results[layer] = result
        return result

    def wait_all(self, timeout_s: float) -> list[TaskResult | None]:
        return [self.wait_layer(layer, timeout_s) for layer in range(len(self.tasks))]
