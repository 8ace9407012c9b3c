"""One real SGLang server (``python -m sglang.launch_server --device cpu``) with HiCache and UCM as its
storage tier, for the serving test and the serving benchmark.

SGLang 0.5.23 lacks three pieces on a CPU; ``tests/sglang/standins/sitecustomize.py`` supplies them,
in the server's processes only (``UCM_SGLANG_CPU_STANDINS=1``), and says what each stands in for.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
STANDINS = REPO / "tests" / "sglang" / "standins"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SERVER_DEFAULTS: dict[str, str | None] = {
    "--device": "cpu",
    "--attention-backend": "torch_native",
    "--page-size": "16",
    "--max-total-tokens": "4096",
    "--disable-cuda-graph": "",
    "--skip-server-warmup": "",
    "--enable-hierarchical-cache": "",
    "--hicache-io-backend": "direct",
    "--hicache-mem-layout": "layer_first",
    "--hicache-storage-prefetch-policy": "wait_complete",
    "--hicache-storage-backend": "dynamic",
}
"""The serving test's options: CPU, HiCache with UCM loaded as a dynamic backend, ``layer_first``
host pool with the direct copy (the one SGLang's CPU stand-in provides), prefetch waited for."""


class SGLangServer:
    """One ``sglang.launch_server`` process on CPU, its log in a file.

    ``extra`` is the storage backend's extra config (``--hicache-storage-backend-extra-config``);
    ``args`` replace or add server options to :data:`SERVER_DEFAULTS` (``{"--max-total-tokens":
    "6144"}``; ``""``: a flag without a value, None: drop the option); ``env`` adds variables to the
    server's environment (``UCM_SGLANG_EXTEND_ROWS=1``: the extend stand-in of ``standins/``)."""

    def __init__(
        self,
        python: Path,
        model: Path,
        extra: dict[str, Any],
        log: Path,
        args: dict[str, str | None] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.log = log
        environment = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
        environment.update(PYTHONPATH=f"{STANDINS}:{REPO}", UCM_SGLANG_CPU_STANDINS="1", PYTHONUNBUFFERED="1")
        environment.update(env or {})
        options = {**SERVER_DEFAULTS, **(args or {})}
        command = [str(python), "-m", "sglang.launch_server", "--model-path", str(model)]
        command += ["--host", "127.0.0.1", "--port", str(self.port)]
        for flag, value in options.items():
            if value is not None:
                command += [flag, value] if value else [flag]
        command += ["--hicache-storage-backend-extra-config", json.dumps(extra)]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=environment,
                cwd=REPO,
                start_new_session=True,
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
        with urllib.request.urlopen(req, timeout=600) as r:
            text = r.read().decode()
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 12) -> dict[str, Any]:
        """Greedy generation of ``prompt`` (text, or token ids), with the tokens' log-probabilities."""
        body: dict[str, Any] = {
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0},
            "return_logprob": True,
        }
        if isinstance(prompt, str):
            body["text"] = prompt
        else:
            body["input_ids"] = list(prompt)
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
