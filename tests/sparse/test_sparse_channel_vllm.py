"""No configuration runs sparse attention keyed by anything but the request.

The configuration a user tries first — ``ucm_sparse_config`` through ``$UCM_SPARSE_CONFIG``, vLLM's
prefix caching on, no sparse connector — must not start sparse attention keyed by a row's first block
(requests sharing a prefix share it: every step of every layer then rebuilt every block's features,
0.06x dense). It refuses to start, naming the configuration to use, and that configuration works.
``UCMConnector`` (prefix storage in a real ``ucm-server``) carries the channel itself when sparse
attention is configured, so storage plus sparse attention is one connector.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon_stats import tiers_by_name
from tests.support.sparse_engine import small_window_runtime, sparse_llm
from tests.support.tiny_llama import build_tiny_llama
from ucm_client import UcmClient
from ucm_client.sparse.config import ENV_VAR
from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm

LAYERS = 2
BLOCK = 32
SPARSE = {"enabled": True, "min_seq_len": 64, "ESA": {"sparse_ratio": 1.0}}
SYSTEM = "system prompt cache block key value token layer head attention " * 30
QUESTIONS = ["alpha beta gamma delta needle haystack recall", "query value head layer token"]
MAX_TOKENS = 16

_REFUSED_SCRIPT = """
import json, sys, traceback
from vllm import LLM

if __name__ == "__main__":
    model, out = sys.argv[1], sys.argv[2]
    try:
        LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=2048, block_size=32,
            enable_prefix_caching=True, seed=0)
    except Exception:
        open(out, "w").write(traceback.format_exc())
    else:
        open(out, "w").write("STARTED")
"""


def _refusal(tmp_path: Path, model: Path) -> str:
    """What a fresh process gets when it starts vLLM the way a user tries first."""
    script, out = tmp_path / "refused.py", tmp_path / "refused.txt"
    script.write_text(_REFUSED_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(root),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        **{ENV_VAR: json.dumps(SPARSE)},
    )
    register = "from ucm_client.sparse import vllm_plugin; vllm_plugin.register()"
    code = f"{register}\nexec(open({str(script)!r}).read())"
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.exists(), proc.stderr[-3000:]
    return out.read_text()


def _suggested(message: str, connector: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON the refusal suggests for ``connector``."""
    for candidate in re.findall(r"'(\{.*?\})'", message):
        config: dict[str, Any] = json.loads(candidate)
        if config["kv_connector"] == connector:
            return config
    raise AssertionError(f"no {connector} configuration in: {message}")


def _generate(llm: Any, runtime: Any) -> tuple[list[list[int]], int]:
    """Greedy answers to both questions after the shared prompt, and the KV blocks they filled."""
    from vllm import SamplingParams

    from ucm_client.sparse.vllm import runtime as vllm_runtime

    vllm_runtime.install_runtime(runtime)
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([SYSTEM + q for q in QUESTIONS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    blocks = sum((len(o.prompt_token_ids) + len(o.outputs[0].token_ids)) // BLOCK for o in outs)
    return tokens, blocks


def _keyed_by_request(llm: Any) -> None:
    """Two requests sharing a prefix, at a 25% budget: every row named by its request, every block
    featured once per (request, layer), the state dropped when they finish."""
    runtime = small_window_runtime(llm, 0.25, retrieval_stride=4)
    tokens, final_blocks = _generate(llm, runtime)
    stats = runtime.method.stats
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert stats["sparse_rows"] > 0
    assert runtime.trace[("row_unnamed", -1)] == 0  # every row was named by its request id
    assert 0 < stats["feature_blocks"] <= LAYERS * final_blocks, (stats, final_blocks)
    llm.generate(["x"], use_tqdm=False)  # one more step delivers the last finished ids
    assert not runtime.method._states


def test_sparse_config_without_a_carrying_connector_refuses_with_the_configuration_to_use(
    tmp_path: Path,
) -> None:
    pytest.importorskip("vllm")
    model = build_tiny_llama(tmp_path / "models", layers=LAYERS)
    message = _refusal(tmp_path, model)
    assert message != "STARTED"
    assert "Refusing to start" in message and "no kv_transfer_config" in message
    alone = _suggested(message, "UcmSparseConnector")
    storage = _suggested(message, "UCMConnector")
    assert storage["kv_connector_module_path"] == "ucm_client.vllm.connector"
    assert alone["kv_connector_extra_config"]["ucm_sparse_config"]["ESA"] == SPARSE["ESA"]

    # The configuration it names works: the same engine, prefix caching on, with the channel.
    with sparse_llm(
        tmp_path / "models",
        layers=LAYERS,
        block_size=BLOCK,
        env={ENV_VAR: json.dumps(SPARSE)},
        enable_prefix_caching=True,
        kv_transfer_config=alone,
    ) as llm:
        assert llm.ucm_runtime is not None
        _keyed_by_request(llm)


@pytest.fixture(scope="module")
def ucm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``UCMConnector`` over a real daemon, sparse attention from ``$UCM_SPARSE_CONFIG`` (nothing about
    sparse attention in the connector's own config), prefix caching on."""
    pytest.importorskip("vllm")
    with (
        DaemonProcess(tmp_path_factory.mktemp("ucm") / "daemon") as daemon,
        sparse_llm(
            tmp_path_factory.mktemp("models"),
            layers=LAYERS,
            block_size=BLOCK,
            env={ENV_VAR: json.dumps(SPARSE)},
            enable_prefix_caching=True,
            kv_transfer_config={
                "kv_connector": "UCMConnector",
                "kv_connector_module_path": "ucm_client.vllm.connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"target": daemon.target},
            },
        ) as llm,
    ):
        llm.ucm_daemon = daemon
        yield llm


def test_ucm_connector_carries_the_channel_and_still_stores_prefixes(ucm_engine: Any) -> None:
    from ucm_client.sparse.vllm.channel import scheduler_bridge

    dense, _ = _generate(ucm_engine, None)
    bridge = scheduler_bridge()
    assert bridge is not None
    before = dict(bridge.trace)
    runtime = ucm_engine.ucm_runtime  # built from $UCM_SPARSE_CONFIG, budget 100%
    sparse, _ = _generate(ucm_engine, runtime)
    assert sparse == dense
    assert bridge.trace["request_begin"] - before.get("request_begin", 0) == 2
    assert bridge.trace["build_sparse_meta"] - before.get("build_sparse_meta", 0) >= MAX_TOKENS
    assert runtime.trace[("bind_step_meta", -1)] >= MAX_TOKENS
    assert runtime.trace[("row_unnamed", -1)] == 0
    with UcmClient(ucm_engine.ucm_daemon.target) as client:
        assert sum(t.blocks for t in tiers_by_name(client).values()) > 0  # prefix KV went to the daemon


def test_shared_prefix_through_ucm_connector_is_keyed_by_request(ucm_engine: Any) -> None:
    _keyed_by_request(ucm_engine)
