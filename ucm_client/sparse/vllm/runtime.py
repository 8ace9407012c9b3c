"""The per-process bridge between vLLM's attention backend and one sparse method instance.

vLLM calls the backend once per layer and knows nothing of sessions, so this runtime derives them:
the first layer call of a step opens the session (``execute_begin``), the last layer's call closes it
(``execute_finished``). KV caches are registered lazily at the first real forward, when every layer's
cache is bound and the page layout can be detected from a key that was just written. It also keeps a
trace of which hook ran on which layer, which is what ``verify_patches`` and the tests read.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ucm_client.sparse.base import (
    AttentionInputs,
    PagedAttentionMeta,
    SparseMeta,
    UcmSparseBase,
    UcmSparseRole,
    layer_index,
)
from ucm_client.sparse.config import UcmSparseConfig, load_sparse_config
from ucm_client.sparse.errors import SparseConfigError
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.kernels.paged import detect_page_layout
from ucm_client.sparse.vllm.carrier import channel_problem

__all__ = [
    "SparseWorkerRuntime",
    "install_runtime",
    "layer_index",
    "reset_runtime",
    "runtime_for_engine",
    "worker_runtime",
]

_RUNTIME: SparseWorkerRuntime | None = None
_EXPLICIT = False
TRACE_ENV = "UCM_SPARSE_TRACE"
"""If set, each worker writes its hook counts (JSON) to this path after every step."""


class SparseWorkerRuntime:
    """One per worker process: the method, the layer map and the hook trace."""

    def __init__(
        self, method: UcmSparseBase, config: UcmSparseConfig | None = None, *, vllm_config: Any = None
    ) -> None:
        self.method = method
        self.config = config
        self.trace: Counter[tuple[str, int]] = Counter()
        self._registered = False
        self._last_layer = -1
        self._vllm_config: Any = vllm_config
        self._trace_path = os.environ.get(TRACE_ENV)
        self._step_meta: SparseMeta | None = None
        self._step_start = 0.0
        self._step_cpu_start = 0.0
        self._decode_only = False
        self.step_memo: dict[Any, Any] = {}
        """Values every layer of one step can share (the attention backend's); emptied each step."""
        self.decode_step_s: list[float] = []
        """Wall time of each decode-only step, first attention layer to last (what benchmarks read)."""
        self.decode_step_cpu_s: list[float] = []
        """The same steps' CPU time of this process: what a step costs whatever else the machine runs."""
        self.per_head = True
        """Let each KV head attend to its own blocks where the backend can (False: one block table
        for all heads of a row, as vLLM's kernel takes it; kept to measure what per-head buys)."""

    def bind_step_meta(self, meta: SparseMeta | None) -> None:
        """The scheduler's metadata for the next step (from the sparse connector), before the forward.

        Requests the scheduler finished are dropped here, so worker state never outlives them.
        """
        self._step_meta = meta
        if meta is not None:
            self.trace[("bind_step_meta", -1)] += 1
            for req_id in meta.finished:
                self.method.request_finished_in_worker(req_id)
                self.trace[("request_finished_in_worker", -1)] += 1

    def bind_vllm_config(self, vllm_config: Any) -> None:
        """Remember the engine's config (captured while vLLM builds the layers, when it is current)."""
        if self._vllm_config is None:
            self._vllm_config = vllm_config

    def _register(
        self, layer_name: str, kv_cache: torch.Tensor, key: torch.Tensor, slot: int, num_heads: int
    ) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        layout = detect_page_layout(kv_cache, slot, key)
        caches: dict[int, torch.Tensor] = {}
        if self._vllm_config is not None:
            layers = get_layers_from_vllm_config(self._vllm_config, Attention)
            caches = {layer_index(name): layer.kv_cache for name, layer in layers.items()}
        if not caches:  # not inside vLLM's config context: register the one layer we know
            caches = {layer_index(layer_name): kv_cache}
        self.method.register_kv_caches(caches, num_heads=num_heads, layout=layout)
        self._last_layer = max(caches)
        self._registered = True
        self.trace[("register_kv_caches", -1)] += 1

    def begin_layer(
        self,
        layer_name: str,
        *,
        num_heads: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        num_actual_tokens: int,
        per_head: bool = False,
    ) -> AttentionInputs:
        idx = layer_index(layer_name)
        if not self._registered:
            self._register(layer_name, kv_cache, key[0], int(slot_mapping[0]), num_heads)
        if not self.method.session.is_open:
            self._step_start = time.perf_counter()
            self._step_cpu_start = time.process_time()
            self._decode_only = num_actual_tokens == int(seq_lens.numel())
            self.step_memo.clear()
            self.method.execute_begin(self._step_meta)
            self.trace[("execute_begin", -1)] += 1
        row_keys = self._row_keys(block_table, seq_lens, kv_cache.shape[2])
        meta = PagedAttentionMeta(
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table[: seq_lens.numel()],
            num_actual_tokens=num_actual_tokens,
            row_keys=row_keys,
            per_head=per_head and self.per_head,
        )
        start = time.perf_counter()
        inputs = self.method.attention_begin(idx, query, key, value, meta, output=output)
        self.method.clock.add("hooks_begin", time.perf_counter() - start)
        self.trace[("attention_begin", idx)] += 1
        if inputs.block_table is not None:
            self.trace[("sparse_rewrite", idx)] += 1
        if inputs.head_tables is not None:
            self.trace[("per_head_rows", idx)] += int(inputs.head_tables.rows.numel())
        return inputs

    def _row_keys(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> list[str | None]:
        """Request id per batch row, from the block each row writes this step (see ``SparseMeta``);
        ``None`` for a row no scheduled request writes into (it attends densely, keeps no state)."""
        memo_key = ("row_keys", id(block_table), id(seq_lens))
        if memo_key in self.step_memo:  # every layer of a step sees the same rows
            keys: list[str | None] = self.step_memo[memo_key]
            return keys
        keys = self._derive_row_keys(block_table, seq_lens, block_size)
        self.step_memo[memo_key] = keys
        return keys

    def _derive_row_keys(
        self, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int
    ) -> list[str | None]:
        rows = int(seq_lens.numel())
        meta = self._step_meta
        if meta is None or not meta.write_blocks:
            # No scheduler metadata this step: no row can be named. Never key a row by its blocks
            # (requests sharing a prefix share them): attend densely instead, and count it.
            self.trace[("row_unnamed", -1)] += rows
            return [None] * rows
        last = ((seq_lens[:rows].to(torch.int64) - 1).clamp_min(0) // block_size)[:, None]
        written = block_table[:rows].to(torch.int64).gather(1, last).flatten().tolist()
        keys: list[str | None] = []
        for block in written:
            req_id = meta.write_blocks.get(int(block))
            if req_id is None:  # a vLLM path the bridge does not model: dense for this row, counted
                self.trace[("row_unnamed", -1)] += 1
            keys.append(req_id)
        return keys

    def finish_layer(
        self, layer_name: str, output: torch.Tensor, *, query_start_loc: torch.Tensor
    ) -> torch.Tensor:
        idx = layer_index(layer_name)
        start = time.perf_counter()
        out = self.method.attention_finished(idx, output)
        clock = self.method.clock
        clock.add("hooks_finish", time.perf_counter() - start)
        self.trace[("attention_finished", idx)] += 1
        if idx == self._last_layer:
            self.method.execute_finished((query_start_loc[1:] - 1).to(torch.int64))
            self._step_meta = None
            if self._decode_only:
                self.decode_step_s.append(time.perf_counter() - self._step_start)
                self.decode_step_cpu_s.append(time.process_time() - self._step_cpu_start)
                clock.add("step", self.decode_step_s[-1])
            clock.end_step(keep=self._decode_only)
            self.trace[("execute_finished", -1)] += 1
            if self._trace_path:
                self._write_trace(self._trace_path)
        return out

    def _write_trace(self, path: str) -> None:
        """Dump the hook counts (for checks on worker processes the caller cannot inspect)."""
        data = {
            "pid": os.getpid(),
            "hooks": {f"{name}:{layer}": n for (name, layer), n in self.trace.items()},
        }
        tmp = f"{path}.{os.getpid()}.tmp"
        Path(tmp).write_text(json.dumps(data))
        Path(tmp).replace(path)

    @property
    def vllm_config(self) -> Any:
        return self._vllm_config

    def layers_seen(self, hook: str) -> set[int]:
        return {layer for (name, layer), count in self.trace.items() if name == hook and count}


def install_runtime(runtime: SparseWorkerRuntime | None) -> None:
    """Pin this process's runtime (``None``: dense) until :func:`reset_runtime`; for tests and embedders."""
    global _RUNTIME, _EXPLICIT
    _RUNTIME = runtime
    _EXPLICIT = True


def reset_runtime() -> None:
    """Forget the runtime; the next engine built in this process loads its own config again."""
    global _RUNTIME, _EXPLICIT
    _RUNTIME = None
    _EXPLICIT = False


def runtime_for_engine(vllm_config: Any) -> SparseWorkerRuntime | None:
    """The runtime for the engine whose layers are being built now (called from the backend's init).

    Built from that engine's ``ucm_sparse_config`` (``$UCM_SPARSE_CONFIG`` first, then the
    connector's extra config), once per engine: a second engine in the same process gets its own,
    never the first one's caches. A pinned runtime (:func:`install_runtime`) is kept and bound.
    Refuses (``SparseConfigError``, naming the configuration to use) an engine whose connector does
    not carry the scheduler's metadata: its rows could not be keyed by request.
    """
    global _RUNTIME
    if _EXPLICIT or (_RUNTIME is not None and _RUNTIME.vllm_config is vllm_config):
        if _RUNTIME is not None:
            _RUNTIME.bind_vllm_config(vllm_config)
        return _RUNTIME
    config = load_sparse_config(_extra_config(vllm_config))
    _RUNTIME = None
    if config is not None and config.enabled:
        problem = channel_problem(vllm_config, config)
        if problem is not None:
            raise SparseConfigError(problem)
        method = UcmSparseFactory.from_config(config, UcmSparseRole.WORKER)
        _RUNTIME = SparseWorkerRuntime(method, config, vllm_config=vllm_config)
    return _RUNTIME


def worker_runtime() -> SparseWorkerRuntime | None:
    """This process's current runtime (``None``: attend densely)."""
    return _RUNTIME


def _extra_config(vllm_config: Any) -> dict[str, Any] | None:
    kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(kv_transfer, "kv_connector_extra_config", None)
    return dict(extra) if extra else None
