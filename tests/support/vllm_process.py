"""Helpers for the connector tests: real daemons and fresh vLLM processes (``tests/vllm/vllm_runner.py``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.daemon_stats import tiers_by_name
from ucm_server.testing.daemon import DaemonProcess

RUNNER = Path(__file__).resolve().parents[1] / "vllm" / "vllm_runner.py"
REPO = Path(__file__).resolve().parents[2]
BLOCK = 128
"""vLLM's CPU block size, in tokens: the unit of every hit count below."""


def tokens(seed: int, n: int) -> list[int]:
    """``n`` reproducible token ids inside the tiny model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


P1 = tokens(1, 600)  # 4 full blocks + 88 tokens
P_FULL = tokens(2, 4 * BLOCK)  # exactly 4 blocks: a full hit must still recompute one token
P_SHARED = P1[:300] + tokens(3, 300)  # shares P1's first 2 full blocks only


def metric_deltas(report: dict[str, Any], name: str) -> list[float]:
    """Per-prompt increase of a cumulative metric (the runner records them after every prompt)."""
    values = [m.get(name, 0) for m in report["metrics"]]
    return [b - a for a, b in zip([0, *values], values, strict=False)]


def last_metric(report: dict[str, Any], name: str) -> float:
    return float(report["metrics"][-1].get(name, 0))


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def start_daemon(workdir: Path, *args: str, data_dir: Path | None = None) -> DaemonProcess:
    """A real ``ucm-server`` writing through to disk (so every stored block is on disk at once)."""
    return DaemonProcess(workdir, args=["--write-mode", "write-through", *args], data_dir=data_dir).start()


def run_vllm(
    workdir: Path,
    spec: dict[str, Any],
    *,
    socket: Path | None,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
    timeout_s: float = 240,
    wrapper: str | None = None,
    wrapper_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Run one fresh vLLM process (``vllm_runner.py``) and return its JSON report.

    ``wrapper``: Python source run with ``-c`` instead, given spec path, result path and
    ``wrapper_args`` (it calls ``vllm_runner.main`` itself, after changing what it needs).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = workdir / "spec.json", workdir / "result.json"
    spec_path.write_text(json.dumps(spec))
    # Nothing from the caller's environment that changes the connector or vLLM's hashing leaks in.
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_") and k != "PYTHONHASHSEED"}
    if socket is not None:
        run_env["UCM_SOCKET"] = str(socket)
    run_env.update(env or {})
    script = ["-c", wrapper] if wrapper is not None else [str(RUNNER)]
    proc = subprocess.run(
        [sys.executable, *script, str(spec_path), str(result_path), *wrapper_args],
        cwd=REPO,
        env=run_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    (workdir / "log.txt").write_text(proc.stdout)
    if expect_failure:
        if proc.returncode == 0:
            raise AssertionError("the vLLM run was expected to fail but succeeded")
        return {"log": proc.stdout}
    if proc.returncode != 0:
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n{proc.stdout[-6000:]}")
    report: dict[str, Any] = json.loads(result_path.read_text())
    report["log"] = proc.stdout
    return report


def vllm_request(req_id: str, prompt: list[int], block_size: int = 16) -> Any:
    """A real ``vllm.v1.request.Request``, its block hashes computed as vLLM computes them (sha256)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    return Request(req_id, prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)


def stored_blocks(target: str) -> int:
    """Blocks the daemon holds (``start_daemon`` writes through: every stored block is in Posix).

    What a run stored, counted where it is, beside what the process says it stored
    (``vllm:ucm_save_blocks``, counted once the process saw each dump end).
    """
    from ucm_client import UcmClient

    with UcmClient(target, client_name="pytest-stored") as client:
        return int(tiers_by_name(client)["Posix"].blocks)
