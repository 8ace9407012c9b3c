"""Worker half of the connector: move block bytes between the daemon and vLLM's KV cache.

Runs in every worker process, on its own TP rank's shard. Per step it is told (metadata) which
blocks to load and which to save; it never decides. Loads that feed this step's forward are waited
for at the first attention layer; async loads and all saves are polled each step and never block
decode. Failures are data: a block that did not load is reported through
``get_block_ids_with_load_errors`` and vLLM recomputes it; a save that failed is a future miss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm_client import BlockIO, BlockState, UcmClient
from ucm_client.errors import UcmError
from ucm_client.gpu import CudaKVCache, CudaUnavailable, producers_done
from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig
from ucm_client.vllm.identity import KeySpace
from ucm_client.vllm.kv_memory import KVMemory, ShmAllocation, adopt
from ucm_client.vllm.link import DaemonLink
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.staging import StagingArea
from ucm_client.vllm.stats import UcmConnectorStats

__all__ = ["UcmWorker"]

logger = logging.getLogger(LOGGER_NAME)


@dataclass(slots=True, eq=False)  # identity: one dump may be pending for several requests
class _Task:
    """A submitted load or dump and what it covers."""

    task_id: int | None
    transfer: BlockTransfer
    started: float
    deadline: float
    block_bytes: int
    slots: list[int] | None = None
    """Staging slots holding this task's bytes (staging path only), released when it ends."""

    @property
    def nbytes(self) -> int:
        return self.block_bytes * len(self.transfer.block_ids)


@dataclass(slots=True)
class _SaveState:
    pending: list[_Task] = field(default_factory=list)
    finished: bool = False


def _per_block(states: list[BlockState], task: _Task) -> list[bool] | None:
    """OK per block; None (all failed) if the daemon did not answer for every block."""
    if len(states) != len(task.transfer.block_ids):
        return None
    return [state == BlockState.OK for state in states]


class UcmWorker:
    """Loads and saves one rank's blocks; owns the shared-memory KV cache registration."""

    def __init__(self, vllm_config: Any, keyspace: KeySpace, config: ConnectorConfig, tp_rank: int):
        self._vllm_config = vllm_config
        self._config = config
        self._namespace = keyspace.namespace(tp_rank)
        self._link = DaemonLink(
            config.target,
            reconnect_interval_s=config.reconnect_interval_s,
            connect_timeout_s=config.connect_timeout_s,
            rpc_timeout_s=config.rpc_timeout_s,
            on_connect=self._on_connect,
            role=f"worker rank {tp_rank}",
        )
        self._alloc: ShmAllocation | None = None
        self._memory: KVMemory | None = None
        self._staging: StagingArea | None = None
        self._cuda_kv: CudaKVCache | None = None
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._region: int | None = None
        """Daemon region of the shared buffer (CPU zero copy or staging); CUDA keeps its own."""
        self._registered = False
        self._sync_loads: list[_Task] = []
        self._async_loads: dict[str, _Task] = {}
        self._saves: dict[str, _SaveState] = {}
        self._save_tasks: list[_Task] = []
        """Dumps in flight, oldest first; each may hold blocks of several requests."""
        self._load_errors: set[int] = set()
        self._stats = UcmConnectorStats()

    # ------------------------------------------------------------------ registration

    def mem_pool_context(self) -> ShmAllocation | None:
        """Have vLLM allocate its CPU KV cache in shared memory (see ``kv_memory``)."""
        if self._vllm_config.device_config.device_type != "cpu" or not self._config.zero_copy:
            return None
        self._alloc = ShmAllocation()
        return self._alloc

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Make sure the daemon can reach the KV cache, then register that memory with it once.

        CPU: the KV cache itself is put in shared memory (zero copy). CUDA: each KV storage is
        registered by CUDA IPC and the daemon copies with ``cudaMemcpyAsync`` (zero copy). Otherwise
        (``zero_copy: false``, or CUDA IPC refused) blocks go through a shared-memory staging buffer.
        """
        if not kv_caches:
            return
        self._kv_caches = dict(kv_caches)
        first = next(iter(kv_caches.values()))
        if first.device.type == "cuda" and self._config.zero_copy:
            self._cuda_kv = CudaKVCache(kv_caches)
            logger.info(
                "UCM worker: CUDA KV cache (%d blocks x %d bytes) shared with the daemon by CUDA IPC",
                self._cuda_kv.num_blocks,
                self._cuda_kv.block_bytes,
            )
            self._link.client()
            return
        if first.device.type != "cpu" or not self._config.zero_copy:
            self._use_staging(first.device.type)
            self._link.client()
            return
        alloc = self._alloc
        if (
            alloc is not None
            and alloc.tensor is not None
            and alloc.buffer is not None
            and (first.untyped_storage().data_ptr() == alloc.tensor.data_ptr())
        ):
            buffer, raw = alloc.buffer, alloc.tensor
            how = "allocated in shared memory"
        else:
            layers = self._vllm_config.compilation_config.static_forward_context.values()
            buffer, raw = adopt(kv_caches, layers)
            how = "moved into shared memory"
        self._memory = KVMemory(buffer, raw, kv_caches)
        logger.info(
            "UCM worker: KV cache (%d blocks x %d bytes) %s (%s); the daemon copies into it directly",
            self._memory.num_blocks,
            self._memory.block_bytes,
            how,
            buffer.name,
        )
        self._link.client()  # registers now if the daemon is up; otherwise on reconnect

    def _use_staging(self, device: str) -> None:
        staging_bytes = int(self._config.staging_buffer_gib * (1 << 30))
        self._staging = StagingArea(self._kv_caches, staging_bytes)
        logger.info(
            "UCM worker: %s KV cache staged through %d shared-memory slots of %d bytes (%s)",
            device,
            self._staging.num_slots,
            self._staging.block_bytes,
            self._staging.buffer.name,
        )

    def _on_connect(self, client: UcmClient) -> None:
        """Register the memory the daemon copies to and from (once; the client re-registers later)."""
        if self._registered:
            return
        if self._cuda_kv is not None:
            try:
                self._cuda_kv.register(client, label="vllm-kv-cache")
                self._registered = True
                return
            except CudaUnavailable as exc:
                logger.warning("UCM worker: CUDA IPC refused (%s); using a staging buffer instead", exc)
                self._cuda_kv = None
                self._use_staging("cuda")
        if self._memory is not None:
            self._region = client.register(self._memory.buffer, label="vllm-kv-cache")
        elif self._staging is not None:
            self._region = client.register(self._staging.buffer, label="vllm-kv-staging")
        self._registered = self._region is not None

    @property
    def _block_bytes(self) -> int:
        if self._cuda_kv is not None:
            return self._cuda_kv.block_bytes
        if self._memory is not None:
            return self._memory.block_bytes
        return self._staging.block_bytes if self._staging is not None else 0

    @property
    def memory(self) -> KVMemory | None:
        """The zero-copy KV cache in shared memory (None on the staging path)."""
        return self._memory

    @property
    def staging(self) -> StagingArea | None:
        return self._staging

    # ------------------------------------------------------------------ per step

    def _client(self) -> UcmClient | None:
        if not self._kv_caches:
            return None
        client = self._link.client()
        if client is not None and not self._registered:
            try:
                self._on_connect(client)
            except UcmError as exc:
                self._link.failed(exc)
                return None
        return client

    def _blocks(self, transfer: BlockTransfer, slots: list[int] | None) -> list[BlockIO]:
        """Where each block's bytes go: vLLM's own pages (zero copy) or staging slots."""
        if self._cuda_kv is not None:
            return self._cuda_kv.blocks(transfer.keys, transfer.block_ids)
        assert self._region is not None
        if slots is not None:
            assert self._staging is not None
            return [
                BlockIO(key=key, segments=self._staging.segments(self._region, slot))
                for key, slot in zip(transfer.keys, slots, strict=True)
            ]
        assert self._memory is not None
        return [
            BlockIO(key=key, segments=self._memory.segments(self._region, block_id))
            for key, block_id in zip(transfer.keys, transfer.block_ids, strict=True)
        ]

    def start_load(self, meta: UcmConnectorMetadata) -> None:
        for transfer in meta.loads:
            task = self._submit(transfer, load=True)
            if task is None:
                self._fail_load(transfer.block_ids)
                if transfer.is_async:
                    # Still report it as received, so vLLM moves on and recomputes.
                    self._async_loads[transfer.req_id] = _Task(None, transfer, 0.0, 0.0, 0)
            elif transfer.is_async:
                self._async_loads[transfer.req_id] = task
            else:
                self._sync_loads.append(task)

    def _submit(self, transfer: BlockTransfer, *, load: bool) -> _Task | None:
        """Hand a load or dump to the daemon; None if it could not be (the caller degrades)."""
        op = "load" if load else "save"
        client = self._client()
        if client is None or not self._registered:
            self._stats.add(daemon_unavailable=1)
            return None
        slots: list[int] | None = None
        if self._staging is not None:
            slots = self._staging.acquire(len(transfer.block_ids))
            if slots is None:
                logger.warning("UCM worker: staging buffer full, %s of %s skipped", op, transfer.req_id)
                return None
            if not load:  # the daemon reads finished bytes; vLLM may reuse its blocks at once
                self._staging.from_kv(slots, transfer.block_ids)
        now = time.monotonic()
        timeout = self._config.load_timeout_s if load else self._config.save_timeout_s
        try:
            blocks = self._blocks(transfer, slots)
            task_id = client.load(self._namespace, blocks) if load else client.dump(self._namespace, blocks)
        except UcmError as exc:
            if slots is not None and self._staging is not None:
                self._staging.release(slots)
            if self._link.failed(exc):
                self._stats.add(daemon_unavailable=1)
            else:
                logger.warning("UCM worker: %s of %s refused: %s", op, transfer.req_id, exc)
            return None
        self._link.succeeded()
        return _Task(task_id, transfer, now, now + timeout, self._block_bytes, slots)

    def wait_for_layer_load(self) -> None:
        """Finish this step's sync loads before the first attention layer reads the cache."""
        while self._sync_loads:
            task = self._sync_loads.pop()
            remaining = max(task.deadline - time.monotonic(), 0.001)
            self._finish_load(task, self._wait(task, remaining))

    def _wait(self, task: _Task, timeout_s: float) -> list[bool] | None:
        """Per-block success once the task is done; None if it failed as a whole or timed out."""
        client = self._link.client()
        if client is None or task.task_id is None:
            return None
        try:
            result = client.wait(task.task_id, timeout_s, cancel_on_timeout=True)
        except UcmError as exc:
            self._link.failed(exc)
            return None
        if not result.done:
            return None
        return _per_block(result.states, task)

    def _poll(self, task: _Task) -> list[bool] | bool | None:
        """Like ``_wait`` without blocking: False while still running (and before its deadline)."""
        if task.task_id is None:
            return None
        if time.monotonic() >= task.deadline:
            return self._wait(task, 0.001)
        client = self._link.client()
        if client is None:
            return None
        try:
            result = client.check(task.task_id)
        except UcmError as exc:
            self._link.failed(exc)
            return None
        if not result.done:
            return False
        return _per_block(result.states, task)

    def _finish_load(self, task: _Task, ok: list[bool] | None) -> None:
        block_ids = task.transfer.block_ids
        if ok is None:
            ok = [False] * len(block_ids)
        failed = [b for b, good in zip(block_ids, ok, strict=True) if not good]
        loaded = len(block_ids) - len(failed)
        if task.slots is not None and self._staging is not None:
            good = [(slot, b) for slot, b, g in zip(task.slots, block_ids, ok, strict=True) if g]
            if good:
                self._staging.to_kv([slot for slot, _ in good], [b for _, b in good])
            self._staging.release(task.slots)
        self._stats.add(
            load_blocks=loaded,
            load_bytes=loaded * task.block_bytes,
            load_seconds=time.monotonic() - task.started,
        )
        if failed:
            self._fail_load(failed)

    def _fail_load(self, block_ids: Iterable[int]) -> None:
        failed = set(block_ids)
        self._load_errors |= failed
        self._stats.add(load_failed_blocks=len(failed))

    def save(self, meta: UcmConnectorMetadata) -> None:
        """Dump this step's completed blocks in one task; returns at once (the daemon copies later).

        One dump per step, not per request: each RPC costs about a millisecond, and on a busy
        step those milliseconds are the connector's whole direct overhead.
        """
        self.wait_for_layer_load()  # a step whose forward skipped attention still finishes its loads
        if not meta.saves:
            return
        if self._cuda_kv is not None:
            producers_done()  # the daemon reads the blocks the forward's kernels just wrote
        combined = BlockTransfer(
            "step-save",
            tuple(b for t in meta.saves for b in t.block_ids),
            tuple(k for t in meta.saves for k in t.keys),
        )
        task = self._submit(combined, load=False)
        if task is None:
            self._stats.add(save_failed_blocks=len(combined.block_ids))
        else:
            self._save_tasks.append(task)
        for transfer in meta.saves:
            state = self._saves.setdefault(transfer.req_id, _SaveState())
            if task is not None:
                state.pending.append(task)

    def handle_preemptions(self, meta: UcmConnectorMetadata) -> None:
        """Blocks of preempted requests are about to be reused: their saves must finish first."""
        for req_id in meta.preempted_req_ids:
            state = self._saves.get(req_id)
            for task in list(state.pending) if state is not None else []:
                remaining = max(task.deadline - time.monotonic(), 0.001)
                self._complete_save(task, self._wait(task, remaining))

    def _complete_save(self, task: _Task, ok: list[bool] | None) -> None:
        """Account a finished dump once and take it off every request waiting for it."""
        if task not in self._save_tasks:
            return
        self._save_tasks.remove(task)
        for state in self._saves.values():
            if task in state.pending:
                state.pending.remove(task)
        if task.slots is not None and self._staging is not None:
            self._staging.release(task.slots)
        n = len(task.transfer.block_ids)
        done = sum(ok) if ok else 0
        self._stats.add(
            save_blocks=done,
            save_bytes=done * task.block_bytes,
            save_seconds=time.monotonic() - task.started,
            save_failed_blocks=n - done,
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose delayed free may happen now (saves done) and whose async loads are done."""
        recving: set[str] = set()
        for req_id, task in list(self._async_loads.items()):
            if task.task_id is None:  # never submitted: its blocks are already reported failed
                del self._async_loads[req_id]
                recving.add(req_id)
                continue
            outcome: list[bool] | bool | None = self._poll(task)
            if outcome is False:
                continue
            del self._async_loads[req_id]
            self._finish_load(task, outcome if isinstance(outcome, list) else None)
            recving.add(req_id)

        # Dumps finish in submission order, so polling stops at the first one still running.
        for task in list(self._save_tasks):
            polled = self._poll(task)
            if polled is False:
                break
            self._complete_save(task, polled if isinstance(polled, list) else None)

        for req_id in finished_req_ids:
            if req_id in self._saves:
                self._saves[req_id].finished = True
        sending: set[str] = set()
        for req_id, state in list(self._saves.items()):
            if state.finished and not state.pending:
                del self._saves[req_id]
                sending.add(req_id)
        return sending or None, recving or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    @property
    def stats(self) -> UcmConnectorStats:
        return self._stats

    def take_stats(self) -> UcmConnectorStats | None:
        return self._stats.take()

    def unregister(self) -> None:
        """Finish every transfer touching the KV memory, then forget it and its daemon region."""
        self.wait_for_layer_load()
        for task in list(self._async_loads.values()):
            self._wait(task, max(task.deadline - time.monotonic(), 0.001))
        for task in list(self._save_tasks):
            self._complete_save(task, self._wait(task, max(task.deadline - time.monotonic(), 0.001)))
        client = self._link.client()
        regions = list(self._cuda_kv.regions.values()) if self._cuda_kv is not None else []
        if self._region is not None:
            regions.append(self._region)
        if client is not None:
            try:
                for region in regions:
                    client.unregister(region)
            except UcmError as exc:
                self._link.failed(exc)
        self._region = None
        self._registered = False
        self._memory = None
        self._staging = None
        self._cuda_kv = None
        self._kv_caches = {}
        self._alloc = None

    def shutdown(self) -> None:
        """Give in-flight saves a short grace period, then let go of the daemon."""
        deadline = time.monotonic() + min(self._config.save_timeout_s, 5.0)
        for task in list(self._save_tasks):
            self._complete_save(task, self._wait(task, max(deadline - time.monotonic(), 0.001)))
        self._saves.clear()
        self._link.close()
