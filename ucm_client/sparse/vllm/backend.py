"""vLLM CPU attention backend that runs the sparse hooks around every attention layer (vLLM 0.32).

vLLM has no sparse-attention hook for dense models, but it has a backend registry: this module
subclasses the CPU backend (``CPUAttentionBackendImpl``, internal and version-specific, hence the
version check in :mod:`ucm_client.sparse.vllm.plugin`) and is registered in place of ``CPU_ATTN``. No
vLLM function is replaced at runtime. Decode rows that a method sparsifies get a shorter block table
(the selected blocks in order) and matching ``seq_lens``; the kernel then attends exactly to those
blocks. With a full budget nothing is rewritten, so output is bit-identical to the dense backend.

vLLM's CPU kernel takes one block table per sequence, so all KV heads of a row would have to share
one selection; heads that look at different blocks (retrieval heads) then lose their needles. Rows a
method selects per KV head (``HeadTables``) run through the same kernel, once for all of them, over
the KV cache seen per (block, head) page: ``[blocks, kv_heads, ...]`` viewed as ``[blocks * kv_heads,
1, ...]`` is the same memory, each (row, KV head) becomes a sequence of its own with that head's
query group as its heads and its own block table (page ``block * kv_heads + head``). Measured on this
CPU against one call per KV head and against a torch gather of the selected pages: as fast as one
shared table, and the only one of the three that needs no copy of KV.
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

from ucm_client.sparse.base import HeadTables
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
            per_head=self.per_head_ok(md),
        )
        if inputs.output is not output:
            raise RuntimeError("sparse attention_begin must write into vLLM's output buffer, not a new one")
        clock = runtime.method.clock
        start = time.perf_counter()
        heads = inputs.head_tables
        # Every row per KV head (a decode-only step): the batch call has nothing left to do.
        batch_call = heads is None or heads.rows.numel() < md.seq_lens.numel()
        shortened = md
        if batch_call and inputs.block_table is not None and inputs.seq_lens is not None:
            seq_lens = inputs.seq_lens
            shortened = dataclasses.replace(
                md,
                block_table=inputs.block_table,
                seq_lens=seq_lens,
                max_seq_len=int(seq_lens.max()),
                scheduler_metadata=self._scheduler_metadata(runtime, layer, md, seq_lens, query.dtype),
            )
        mid = time.perf_counter()
        clock.add("kernel_meta", mid - start)
        if batch_call:
            output = super().forward(
                layer, inputs.query, inputs.key, inputs.value, kv_cache, shortened, output
            )
        if heads is not None:
            self._per_head_forward(runtime, layer, inputs.query, kv_cache, md, heads, output)
        clock.add("kernel", time.perf_counter() - mid)
        return runtime.finish_layer(layer.layer_name, output, query_start_loc=md.query_start_loc)

    def per_head_ok(self, md: CPUAttentionMetadata) -> bool:
        """Whether rows of this layer can attend per KV head: plain causal GQA attention (no ALiBi,
        sinks, window or dynamic mask: those are per query head or per sequence position)."""
        return (
            self.alibi_slopes is None
            and self.sinks is None
            and self.sliding_window in (None, -1)
            and md.dynamic_causal is None
            and self.num_heads % self.num_kv_heads == 0
        )

    def _per_head_forward(
        self,
        runtime: SparseWorkerRuntime,
        layer: Any,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: CPUAttentionMetadata,
        heads: HeadTables,
        output: torch.Tensor,
    ) -> None:
        """One kernel call for every (row, KV head) of ``heads``, each over its own blocks (see the
        module docstring); writes those rows' output."""
        kv_heads, group, dim = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size
        count = int(heads.rows.numel())
        # A decode-only step (every row one token, every row per KV head): rows are tokens 0..count-1.
        in_place = count == md.seq_lens.numel() == md.num_actual_tokens
        if in_place:
            tokens = None
            q = query[:count].reshape(count * kv_heads, group, dim)
            out = output[:count].view(count * kv_heads, group, dim)
        else:
            tokens = md.query_start_loc[heads.rows].to(torch.int64)
            q = query.index_select(0, tokens).view(count * kv_heads, group, dim)
            out = torch.empty_like(q)
        num_blocks, _, block_size, _ = kv_cache.shape
        pages = kv_cache.view(num_blocks * kv_heads, 1, 2 * block_size, dim)
        key_cache, value_cache = pages.chunk(2, dim=2)
        head_ids = torch.arange(kv_heads, dtype=torch.int32)[None, :, None]
        table = (heads.block_table * kv_heads + head_ids).view(count * kv_heads, -1)
        seq_lens = heads.seq_lens.repeat_interleave(kv_heads)
        query_start_loc = torch.arange(count * kv_heads + 1, dtype=torch.int32)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=key_cache,
            value_cache=value_cache,
            output=out,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            scale=self.scale,
            causal=md.causal,
            alibi_slopes=None,
            sliding_window=self.sliding_window,
            block_table=table,
            softcap=self.logits_soft_cap,
            scheduler_metadata=self._scheduler_metadata(
                runtime, layer, md, seq_lens, query.dtype, query_start_loc, heads=(group, 1)
            ),
            s_aux=None,
            dynamic_causal=None,
            k_scale=layer._k_scale_float,
            v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype,
        )
        if tokens is not None:
            output.index_copy_(0, tokens, out.view(count, self.num_heads, dim))

    def _scheduler_metadata(
        self,
        runtime: SparseWorkerRuntime,
        layer: Any,
        md: CPUAttentionMetadata,
        seq_lens: torch.Tensor,
        dtype: torch.dtype,
        query_start_loc: torch.Tensor | None = None,
        *,
        heads: tuple[int, int] | None = None,
    ) -> Any:
        """The kernel's work split for the shortened rows, computed once per step and shape.

        vLLM's dense path builds it once per step for all layers; a budget keeps the same number
        of blocks in every layer, so the shortened rows of the next layers match and reuse it.
        ``query_start_loc`` and ``heads`` (query and KV heads per sequence) describe the per-KV-head
        call's sequences; by default the step's rows with the layer's heads.
        """
        num_heads, num_kv_heads = heads or (self.num_heads, self.num_kv_heads)
        starts = md.query_start_loc if query_start_loc is None else query_start_loc
        key = (
            "cpu_attn_scheduler_metadata",
            id(md.query_start_loc),
            query_start_loc is None,
            tuple(seq_lens.tolist()),
            num_heads,
            num_kv_heads,
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
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=self.head_size,
                seq_lens=seq_lens,
                dtype=dtype,
                query_start_loc=starts,
                causal=md.causal,
                sliding_window_size=self.sliding_window,
                isa=layer.isa,
                enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
                dynamic_causal=md.dynamic_causal if query_start_loc is None else None,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        return memo[key]


class UcmSparseCPUAttentionBackend(CPUAttentionBackend):
    """The CPU backend, with :class:`UcmSparseCPUAttentionImpl` as its implementation."""

    @staticmethod
    def get_impl_cls() -> type[UcmSparseCPUAttentionImpl]:
        return UcmSparseCPUAttentionImpl
