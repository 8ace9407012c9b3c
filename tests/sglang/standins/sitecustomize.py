"""Test-only stand-ins that let SGLang 0.5.23 serve with HiCache on a CPU, for the serving test.

Active only when ``UCM_SGLANG_CPU_STANDINS=1`` (the serving test sets it for the SGLang server it
starts, and this directory is on that server's ``PYTHONPATH``); otherwise this file does nothing.
SGLang ships its HiCache host<->device copies and host-memory pinning for CUDA/HIP/XPU/NPU only; on
a CPU these are the pieces it lacks:

1. ``transfer_kv_direct`` (stands in for ``sgl_kernel.kvcacheio.transfer_kv_direct``, CUDA-only):
   SGLang's L1<->L2 copy for the ``layer_first`` layout with ``--hicache-io-backend direct``; here a
   plain indexed tensor copy per layer (the test's device *is* host memory).
2. No host pinning (stands in for ``cudaHostRegister`` in ``_cuda_host_register``): the pool is
   plain host memory, with nothing to pin it for.
3. ``vllm._custom_ops.rotary_embedding`` importable (stands in for vLLM's CUDA op): SGLang's rotary
   embedding imports it on a non-CUDA device as its fallback kernel, which the CPU forward
   (``forward_native``) never calls; calling the stand-in raises.

Each is applied right after SGLang's module that needs it is imported, and says so on stderr.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

if os.environ.get("UCM_SGLANG_CPU_STANDINS") == "1":

    def transfer_kv_direct(
        src_layers: Sequence[Any],
        dst_layers: Sequence[Any],
        src_indices: Any,
        dst_indices: Any,
        page_size: int,
    ) -> None:
        """Stand-in for sgl_kernel.kvcacheio.transfer_kv_direct on CPU tensors: one pass over the
        bytes, as the kernel makes (a gather then a scatter would copy twice and make SGLang's own
        host-memory hit look slower than it is): the tokens are copied as runs where both sides'
        indices are consecutive (whole pages at least, usually much more), else row by row."""
        import torch

        src_idx = src_indices.to("cpu", non_blocking=False).long()
        dst_idx = dst_indices.to("cpu", non_blocking=False).long()
        if src_idx.numel() == 0:
            return
        breaks = ((src_idx[1:] - src_idx[:-1] != 1) | (dst_idx[1:] - dst_idx[:-1] != 1)).nonzero()
        starts = [0, *(breaks.flatten() + 1).tolist()]
        ends = [*starts[1:], src_idx.numel()]
        runs = [(int(src_idx[a]), int(dst_idx[a]), b - a) for a, b in zip(starts, ends, strict=True)]
        if len(runs) > src_idx.numel() // 4:  # scattered: the indexed copy is the cheaper one
            for src, dst in zip(src_layers, dst_layers, strict=True):
                dst.index_copy_(0, dst_idx, torch.index_select(src, 0, src_idx))
            return
        for src, dst in zip(src_layers, dst_layers, strict=True):
            for s, d, n in runs:
                dst[d : d + n].copy_(src[s : s + n])

    def _no_pinning(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
        """Stand-in for cudaHostRegister: nothing to pin on a CPU."""

    def _patch_mha(module: types.ModuleType) -> None:
        module.transfer_kv_direct = transfer_kv_direct  # type: ignore[attr-defined]

    def _patch_common(module: types.ModuleType) -> None:
        module._cuda_host_register = _no_pinning  # type: ignore[attr-defined]

    PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
        "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
        "sglang.srt.mem_cache.pool_host.common": _patch_common,
    }

    class _Patching(importlib.abc.MetaPathFinder):
        """Finds PATCHES' modules with the normal machinery, then patches them once executed."""

        def find_spec(
            self, fullname: str, path: Any, target: Any = None
        ) -> importlib.machinery.ModuleSpec | None:
            patch = PATCHES.get(fullname)
            if patch is None:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return None
            loader = spec.loader
            run = loader.exec_module

            def exec_module(module: types.ModuleType) -> None:
                run(module)
                patch(module)
                print(f"ucm test stand-in applied to {fullname}", file=sys.stderr, flush=True)

            loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Patching())

    def _rotary_embedding(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("vllm._custom_ops.rotary_embedding is a test stand-in (tests/sglang/standins)")

    _vllm = types.ModuleType("vllm")
    _vllm.__path__ = []
    _ops = types.ModuleType("vllm._custom_ops")
    _ops.rotary_embedding = _rotary_embedding  # type: ignore[attr-defined]
    _vllm._custom_ops = _ops  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm", _vllm)
    sys.modules.setdefault("vllm._custom_ops", _ops)
