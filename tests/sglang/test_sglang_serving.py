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

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.tiny_llama import build_tiny_llama

from tests.sglang.conftest import REPO, require_sglang
from ucm_server.testing.daemon import DaemonProcess

STANDINS = Path(__file__).resolve().parent / "standins"
PAGE = 16
BACKEND = {"backend_name": "ucm", "module_path": "ucm_client.sglang.backend", "interface_v1": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``sglang.launch_server`` process on CPU, its log in a file."""

    def __init__(self, model: Path, extra: dict[str, Any], log: Path) -> None:
        self.port = free_port()
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
        env.update(PYTHONPATH=f"{STANDINS}:{REPO}", UCM_SGLANG_CPU_STANDINS="1", PYTHONUNBUFFERED="1")
        command = [
            str(require_sglang()), "-m", "sglang.launch_server",
            "--model-path", str(model), "--device", "cpu", "--attention-backend", "torch_native",
            "--host", "127.0.0.1", "--port", str(self.port), "--page-size", str(PAGE),
            "--max-total-tokens", "4096", "--disable-cuda-graph", "--skip-server-warmup",
            "--enable-hierarchical-cache", "--hicache-io-backend", "direct",
            "--hicache-mem-layout", "layer_first",
            "--hicache-storage-prefetch-policy", "wait_complete",
            "--hicache-storage-backend", "dynamic",
            "--hicache-storage-backend-extra-config", json.dumps(extra),
        ]  # fmt: skip
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"SGLang exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise AssertionError(f"SGLang did not answer /health in {timeout_s}s:\n{self.tail()}")

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url(path), data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            text = r.read().decode()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def generate(self, prompt: str) -> dict[str, Any]:
        body = {
            "text": prompt,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0},
            "return_logprob": True,
        }
        reply: dict[str, Any] = self.post("/generate", body)
        return reply

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-8000:]

    def stop(self) -> None:
        """The server and the processes it started (its own session): SIGTERM, then SIGKILL."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 30.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def output_ids(reply: dict[str, Any]) -> list[int]:
    """The generated tokens (``output_token_logprobs``: (logprob, token id, text) per token)."""
    return [int(entry[1]) for entry in reply["meta_info"]["output_token_logprobs"]]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(build_tiny_llama(tmp_path_factory.mktemp("models")))


@pytest.fixture
def serve(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    servers: list[Server] = []

    def start(extra: dict[str, Any], name: str) -> Server:
        server = Server(tiny_model, extra, tmp_path / f"{name}.log")
        servers.append(server)
        server.wait_ready()
        return server

    yield start
    for server in servers:
        server.stop()


PROMPT = " ".join(f"cache block {i % 7} key value token layer {i % 5} page" for i in range(90))


def prompt_flush_prompt(server: Server) -> tuple[dict[str, Any], dict[str, Any]]:
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
