"""Execution sessions and tensor validation for the worker-side hooks, so no hook runs on stale state.

Layer hooks touch per-step state (the selection, the step's metadata). Upstream let them run at any
time, so a stray call after a step had ended silently used stale state. Here a step is an explicit
session: ``execute_begin`` opens it, ``execute_finished`` closes it, and every layer hook checks that
one is open. Tensors are checked against the layer's immutable spec before any algorithm reads them,
so a wrong layout fails with the offending name and shape instead of producing wrong attention.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ucm_client.sparse.errors import SparseInputError, SparseSessionError

__all__ = ["ExecutionSession", "check_tensor"]


@dataclass(slots=True)
class ExecutionSession:
    """The state of one model step as seen by a sparse method.

    ``step`` counts completed sessions; ``layers_seen`` records which layers ran their hooks in the
    open session, so a second ``attention_begin`` for the same layer (a re-entrant or duplicated
    call) is rejected rather than double-counted.
    """

    step: int = 0
    is_open: bool = False
    layers_begun: set[int] = field(default_factory=set)
    layers_finished: set[int] = field(default_factory=set)

    def open(self) -> None:
        if self.is_open:
            raise SparseSessionError(
                f"execute_begin called while step {self.step} is still open; call execute_finished first"
            )
        self.is_open = True
        self.layers_begun.clear()
        self.layers_finished.clear()

    def close(self) -> None:
        self.require_open("execute_finished")
        unfinished = self.layers_begun - self.layers_finished
        self.is_open = False
        self.step += 1
        if unfinished:
            raise SparseSessionError(
                f"execute_finished with layers {sorted(unfinished)} begun but never finished"
            )

    def require_open(self, hook: str) -> None:
        if not self.is_open:
            raise SparseSessionError(
                f"{hook} called outside an execution session (open one with execute_begin)"
            )

    def begin_layer(self, layer_idx: int) -> None:
        self.require_open("attention_begin")
        if layer_idx in self.layers_begun:
            raise SparseSessionError(f"attention_begin called twice for layer {layer_idx} in one step")
        self.layers_begun.add(layer_idx)

    def finish_layer(self, layer_idx: int) -> None:
        self.require_open("attention_finished")
        if layer_idx not in self.layers_begun or layer_idx in self.layers_finished:
            raise SparseSessionError(
                f"attention_finished for layer {layer_idx} without a matching attention_begin"
            )
        self.layers_finished.add(layer_idx)


def check_tensor(
    name: str,
    tensor: object,
    *,
    shape: Sequence[int | None],
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Return ``tensor`` if it matches; raise :class:`SparseInputError` naming what is wrong.

    ``None`` in ``shape`` accepts any size in that dimension (token counts vary per step, head
    counts and head size never do).
    """
    if not isinstance(tensor, torch.Tensor):
        raise SparseInputError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        want_s = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise SparseInputError(f"{name}: expected shape {want_s}, got {list(tensor.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if tensor.dtype not in allowed:
            raise SparseInputError(
                f"{name}: expected dtype {' or '.join(map(str, allowed))}, got {tensor.dtype}"
            )
    if device is not None and tensor.device.type != device.type:
        raise SparseInputError(f"{name}: expected device {device}, got {tensor.device}")
    return tensor
