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

One more, for the serving benchmark only (``UCM_SGLANG_EXTEND_ROWS=1`` as well):

4. An extend attention that computes only the new tokens' rows (stands in for the extend kernels
   SGLang uses on a GPU, FlashInfer's and FlashAttention's, which do so): ``torch_native``'s
   ``_run_sdpa_forward_extend`` builds a query as long as the whole sequence and runs causal
   attention over all of it, so on a CPU a request whose 4,096-token prefix is cached pays the
   prefix's whole attention again (3 s of a 3.1 s time to first token), hiding where the prefix came
   from. Same mathematics: each new token attends to the keys up to its own position.

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

    def _patch_torch_native(module: types.ModuleType) -> None:
        backend = module.TorchNativeAttnBackend
        shipped = backend._run_sdpa_forward_extend

        def extend_rows_only(
            self: Any,
            query: Any,
            output: Any,
            k_cache: Any,
            v_cache: Any,
            req_to_token: Any,
            req_pool_indices: Any,
            seq_lens: Any,
            extend_prefix_lens: Any,
            extend_seq_lens: Any,
            encoder_lens: Any = None,
            scaling: Any = None,
            enable_gqa: bool = False,
            causal: bool = False,
            is_cross_attn: bool = False,
            sliding_window_size: int | None = None,
        ) -> Any:
            """Causal self-attention of the extend tokens only; anything else as SGLang ships it."""
            import torch
            from torch.nn.functional import scaled_dot_product_attention

            windowed = sliding_window_size is not None and sliding_window_size > -1
            if not causal or windowed or encoder_lens is not None or is_cross_attn:
                return shipped(
                    self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
                    extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
                    is_cross_attn, sliding_window_size,
                )  # fmt: skip
            heads_first = query.movedim(0, query.dim() - 2)
            start_q = 0
            for seq in range(seq_lens.shape[0]):
                n_q, prefix, n_kv = (
                    int(extend_seq_lens[seq]),
                    int(extend_prefix_lens[seq]),
                    int(seq_lens[seq]),
                )
                tokens = req_to_token[req_pool_indices[seq], :n_kv]
                key = k_cache[tokens].movedim(0, query.dim() - 2).to(query.dtype)
                value = v_cache[tokens].movedim(0, query.dim() - 2).to(query.dtype)
                q_pos = torch.arange(prefix, prefix + n_q, device=query.device).unsqueeze(1)
                mask = torch.arange(n_kv, device=query.device).unsqueeze(0) <= q_pos
                out = scaled_dot_product_attention(
                    heads_first[:, start_q : start_q + n_q, :].unsqueeze(0),
                    key.unsqueeze(0),
                    value.unsqueeze(0),
                    attn_mask=mask,
                    enable_gqa=enable_gqa,
                    scale=scaling,
                )
                output[start_q : start_q + n_q] = out.squeeze(0).movedim(query.dim() - 2, 0)
                start_q += n_q
            return output

        backend._run_sdpa_forward_extend = extend_rows_only

    PATCHES: dict[str, Callable[[types.ModuleType], None]] = {
        "sglang.srt.mem_cache.pool_host.mha": _patch_mha,
        "sglang.srt.mem_cache.pool_host.common": _patch_common,
    }
    if os.environ.get("UCM_SGLANG_EXTEND_ROWS") == "1":
        PATCHES["sglang.srt.layers.attention.torch_native_backend"] = _patch_torch_native

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
