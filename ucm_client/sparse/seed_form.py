"""Running a method written in upstream UCM's example form (the "seed form") inside the checked session form.

Upstream's example overrides the public hooks directly: ``register_kv_caches(kv_caches)``,
``attention_begin(layer_idx, query, key, value, attn_metadata)`` returning ``(query, key, value,
output)``, ``build_sparse_meta`` returning any object that workers read back as
``scheduler_output.ucm_sparse_meta``. :class:`SeedFormAdapter` is a checked-form method that holds
such an instance and calls its hooks from the ``_on_*`` methods, so the session discipline and the
tensor checks of :class:`~ucm_client.sparse.base.UcmSparseBase` apply to it unchanged.

What the returned tuple may change, and why: ``query``, ``key`` and ``value`` are this step's new
tokens (vLLM writes ``key``/``value`` into the paged cache by slot), so replacements must keep their
shapes; choosing *which cached tokens* to attend is the checked form's ``block_table`` rewrite. An
output buffer other than vLLM's is honoured by copying the computed output into it before the
method's ``attention_finished`` sees it, and its result is copied back into vLLM's buffer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ucm_client.sparse.base import (
    PUBLIC_HOOKS,
    AttentionInputs,
    LayerSpec,
    PagedAttentionMeta,
    SparseMeta,
    SparseRequest,
    UcmSparseBase,
    UcmSparseRole,
)
from ucm_client.sparse.errors import SparseInputError

__all__ = ["SeedFormAdapter", "is_seed_form"]


def is_seed_form(cls: object) -> bool:
    """A class written in the seed form: a ``UcmSparseBase`` overriding the public hooks, or any class
    with all of them (e.g. one subclassing upstream UCM's own abstract base)."""
    if not isinstance(cls, type):
        return False
    if issubclass(cls, UcmSparseBase):
        return cls.seed_form
    return all(callable(getattr(cls, hook, None)) for hook in PUBLIC_HOOKS)


class SeedFormAdapter(UcmSparseBase):
    """A checked-form method delegating to a seed-form instance (``inner``)."""

    def __init__(
        self, role: UcmSparseRole, config: Mapping[str, Any], *, inner: Any, min_seq_len: int = 0
    ) -> None:
        super().__init__(role, config, min_seq_len=min_seq_len)
        self.inner = inner
        self._buffers: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------ scheduler
    def _on_request_begin(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.inner.request_begin(request_id, list(prompt_token_ids))

    def _on_estimate_num_slots_sparsed(self, request: SparseRequest) -> int:
        slots = self.inner.estimate_num_slots_sparsed(request)
        if not isinstance(slots, int) or slots < 0:
            raise SparseInputError(
                f"{type(self.inner).__name__}.estimate_num_slots_sparsed returned {slots!r}, not an int >= 0"
            )
        return slots

    def _on_build_sparse_meta(
        self,
        scheduler_output: Any,
        seq_group_metadata_list: Sequence[SparseRequest],
        request_metas: Mapping[str, Any],
    ) -> SparseMeta:
        custom = self.inner.build_sparse_meta(scheduler_output, list(seq_group_metadata_list), request_metas)
        return custom if isinstance(custom, SparseMeta) else SparseMeta(custom=custom)

    def _on_request_finished_in_scheduler(self, request_id: str) -> None:
        self.inner.request_finished_in_scheduler(request_id)

    # ------------------------------------------------------------ worker
    def _on_register_kv_caches(self) -> None:
        self.inner.register_kv_caches(dict(self._kv_caches))

    def _on_execute_begin(self, scheduler_output: SparseMeta | None) -> None:
        self._buffers.clear()
        self.inner.execute_begin(scheduler_output if scheduler_output is not None else SparseMeta())

    def _on_attention_begin(
        self,
        spec: LayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        meta: PagedAttentionMeta,
        output: torch.Tensor,
    ) -> AttentionInputs:
        result = self.inner.attention_begin(spec.layer_idx, query, key, value, meta)
        name = f"{type(self.inner).__name__}.attention_begin"
        if not isinstance(result, tuple) or len(result) != 4:
            raise SparseInputError(
                f"{name} must return (query, key, value, output), got {type(result).__name__}"
            )
        new_q, new_k, new_v, buffer = result
        for what, got, want in (("query", new_q, query), ("key", new_k, key), ("value", new_v, value)):
            if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise SparseInputError(
                    f"{name} returned {what} {shape}, expected {list(want.shape)}: these are the step's new "
                    "tokens, written to the paged cache; select cached tokens with the checked form instead"
                )
        if buffer is not output:
            if not isinstance(buffer, torch.Tensor) or buffer.numel() != output.numel():
                raise SparseInputError(
                    f"{name} returned an output buffer that cannot hold {list(output.shape)}"
                )
            self._buffers[spec.layer_idx] = buffer
        return AttentionInputs(new_q, new_k, new_v, output)

    def _on_attention_finished(self, spec: LayerSpec, output: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.pop(spec.layer_idx, None)
        if buffer is not None:
            buffer.copy_(output.reshape(buffer.shape))
        result = self.inner.attention_finished(spec.layer_idx, output if buffer is None else buffer)
        if result is not output:
            output.copy_(result.reshape(output.shape))
        return output

    def _on_execute_finished(self, logits_indices: torch.Tensor) -> torch.Tensor:
        result = self.inner.execute_finished(logits_indices)
        return logits_indices if result is None else result

    def _on_request_finished_in_worker(self, request_id: str) -> None:
        self.inner.request_finished_in_worker(request_id)
