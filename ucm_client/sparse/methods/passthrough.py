"""Base for methods whose algorithm runs at tensor level but which must still answer every hook.

ReRoPE needs keys before RoPE and Blend needs the model runner to skip tokens; vLLM 0.32's attention
backend sees neither, so inside vLLM these methods attend densely (``verify_patches`` reports them
inactive) while keeping the lifecycle, session discipline and validation of every other method.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ucm_client.sparse.base import (
    AttentionInputs,
    LayerSpec,
    PagedAttentionMeta,
    SparseMeta,
    SparseRequest,
    UcmSparseBase,
)

__all__ = ["DenseInVllmMethod"]


class DenseInVllmMethod(UcmSparseBase):
    """Every hook implemented as "attend densely"; subclasses add their tensor-level algorithm."""

    def _on_request_begin(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        return None

    def _on_estimate_num_slots_sparsed(self, request: SparseRequest) -> int:
        return request.num_tokens

    def _on_build_sparse_meta(
        self,
        scheduler_output: Any,
        seq_group_metadata_list: Sequence[SparseRequest],
        request_metas: Mapping[str, Any],
    ) -> SparseMeta:
        return SparseMeta()

    def _on_request_finished_in_scheduler(self, request_id: str) -> None:
        return None

    def _on_execute_begin(self, scheduler_output: SparseMeta | None) -> None:
        return None

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
        return AttentionInputs(query, key, value, output)

    def _on_request_finished_in_worker(self, request_id: str) -> None:
        return None
