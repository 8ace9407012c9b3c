"""A real SGLang server (``python -m sglang.launch_server --device cpu``) on a tiny model, with UCM as
its HiCache L3 tier: a prompt, ``POST /flush_cache`` (drops SGLang's GPU and host copies), the same
prompt again. The storage tier must serve the prefix (SGLang's own ``cached_tokens`` report) and the
output tokens must be the same; a negative control whose backend corrupts every page it reads must
change them, so the equality means the bytes came back, not that they were recomputed.

SGLang 0.5.23 lacks three pieces on a CPU; ``standins/sitecustomize.py`` supplies them, in the
server's processes only (``UCM_SGLANG_CPU_STANDINS=1``), and says what each stands in for:
the ``layer_first`` L1<->L2 copy (``transfer_kv_direct``), no host pinning (``cudaHostRegister``),
and an importable ``vllm._custom_ops.rotary_embedding`` (never called on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.sglang_server import SGLangServer, output_ids
from support.tiny_llama import build_tiny_llama

from tests.sglang.conftest import require_sglang
from ucm_server.testing.daemon import DaemonProcess

PAGE = 16
BACKEND = {"backend_name": "ucm", "module_path": "ucm_client.sglang.backend", "interface_v1": 1}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_tiny_llama(tmp_path_factory.mktemp("models")))


@pytest.fixture
def serve(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    servers: list[SGLangServer] = []

    def start(extra: dict[str, Any], name: str) -> SGLangServer:
        server = SGLangServer(require_sglang(), tiny_model, extra, tmp_path / f"{name}.log")
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


PROMPT = " ".join(f"cache block {i % 7} key value token layer {i % 5} page" for i in range(90))


def prompt_flush_prompt(server: SGLangServer) -> tuple[dict[str, Any], dict[str, Any]]:
    first = server.generate(PROMPT)
    time.sleep(2)  # SGLang backs the prompt's pages up to storage in the background (write_through)
    server.post("/flush_cache")
    second = server.generate(PROMPT)
    return first, second


def test_storage_tier_serves_the_prefix_after_flush_with_identical_output(serve: Any, tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "256MiB"]) as daemon:
        server = serve({**BACKEND, "class_name": "UcmHiCacheStorage", "target": daemon.target}, "ucm")
        first, second = prompt_flush_prompt(server)
        prompt_tokens = first["meta_info"]["prompt_tokens"]
        assert prompt_tokens > 700
        assert first["meta_info"]["cached_tokens"] == 0
        served = second["meta_info"]["cached_tokens"]
        # Every whole page of the prompt but the last token's, which SGLang always computes.
        assert served >= (prompt_tokens - 1) // PAGE * PAGE - PAGE, (served, prompt_tokens)
        details = second["meta_info"].get("cached_tokens_details") or {}
        if details:
            assert details.get("storage", served) > 0, details
        assert output_ids(second) == output_ids(first)
        assert "shared with the daemon in place" in server.tail()


def test_negative_control_a_backend_corrupting_pages_on_read_changes_the_output(
    serve: Any, tmp_path: Path
) -> None:
    with DaemonProcess(tmp_path / "ucm", args=["--cache-capacity", "256MiB"]) as daemon:
        extra = {
            **BACKEND,
            "module_path": "corrupting_backend",
            "class_name": "CorruptingUcmStorage",
            "target": daemon.target,
        }
        server = serve(extra, "corrupt")
        first, second = prompt_flush_prompt(server)
        assert second["meta_info"]["cached_tokens"] > 700 - 2 * PAGE
        assert output_ids(second) != output_ids(first)
