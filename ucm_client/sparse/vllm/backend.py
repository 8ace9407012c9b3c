"""vLLM CPU attention backend that runs the sparse hooks around every attention layer (vLLM 0.32).

vLLM has no sparse-attention hook for dense models, but it has a backend registry: this module
subclasses the CPU backend (``CPUAttentionBackendImpl``, internal and version-specific, hence the
version check in :mod:`ucm_client.sparse.vllm.plugin`) and is registered in place of ``CPU_ATTN``. No
vLLM function is replaced at runtime. Decode rows that a method sparsifies get a shorter block table
(the selected blocks in order) and matching ``seq_lens``; the kernel then attends exactly to those
blocks. With a full budget nothing is rewritten, so output is bit-identical to the dense backend.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadata,
)

from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime, runtime_for_engine, worker_runtime

__all__ = ["UcmSparseCPUAttentionBackend", "UcmSparseCPUAttentionImpl"]


class UcmSparseCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` with the sparse hooks around ``forward``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Built here, while vLLM's config for this engine is the current one.
        runtime_for_engine(get_current_vllm_config())

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: CPUAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        runtime = worker_runtime()
        if runtime is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        return self._sparse_forward(runtime, layer, query, key, value, kv_cache, attn_metadata, output)

    def _sparse_forward(
        self,
        runtime: SparseWorkerRuntime,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: CPUAttentionMetadata,
        output: torch.Tensor,
    ) -> torch.Tensor:
        inputs = runtime.begin_layer(
            layer.layer_name,
            num_heads=self.num_heads,
            query=query,
            key=key,
            value=value,
            output=output,
            kv_cache=kv_cache,
            query_start_loc=md.query_start_loc,
            seq_lens=md.seq_lens,
            block_table=md.block_table,
            slot_mapping=md.slot_mapping,
            num_actual_tokens=md.num_actual_tokens,
        )
        clock = runtime.method.clock
        start = time.perf_counter()
        if inputs.block_table is not None and inputs.seq_lens is not None:
            seq_lens = inputs.seq_lens
            md = dataclasses.replace(
                md,
                block_table=inputs.block_table,
                seq_lens=seq_lens,
                max_seq_len=int(seq_lens.max()),
                scheduler_metadata=self._scheduler_metadata(runtime, layer, md, seq_lens, query.dtype),
            )
        if inputs.output is not output:
            raise RuntimeError("sparse attention_begin must write into vLLM's output buffer, not a new one")
        mid = time.perf_counter()
        clock.add("kernel_meta", mid - start)
        out = super().forward(layer, inputs.query, inputs.key, inputs.value, kv_cache, md, output)
        clock.add("kernel", time.perf_counter() - mid)
        return runtime.finish_layer(layer.layer_name, out, query_start_loc=md.query_start_loc)

    def _scheduler_metadata(
        self,
        runtime: SparseWorkerRuntime,
        layer: Any,
        md: CPUAttentionMetadata,
        seq_lens: torch.Tensor,
        dtype: torch.dtype,
    ) -> Any:
        """The kernel's work split for the shortened rows, computed once per step and shape.

        vLLM's dense path builds it once per step for all layers; a budget keeps the same number
        of blocks in every layer, so the shortened rows of the next layers match and reuse it.
        """
        key = (
            "cpu_attn_scheduler_metadata",
            id(md.query_start_loc),
            tuple(seq_lens.tolist()),
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.sliding_window,
            dtype,
            layer.isa,
            self.kv_cache_dtype,
            md.causal,
            md.dynamic_causal,
        )
        memo = runtime.step_memo
        if key not in memo:
            memo[key] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=int(seq_lens.numel()),
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size,
                seq_lens=seq_lens,
                dtype=dtype,
                query_start_loc=md.query_start_loc,
                causal=md.causal,
                sliding_window_size=self.sliding_window,
                isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=md.dynamic_causal,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        return memo[key]


class UcmSparseCPUAttentionBackend(CPUAttentionBackend):
    """The CPU backend, with :class:`UcmSparseCPUAttentionImpl` as its implementation."""

    @staticmethod
    def get_impl_cls() -> type[UcmSparseCPUAttentionImpl]:
        return UcmSparseCPUAttentionImpl
