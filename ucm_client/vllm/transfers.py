"""The worker's conversation with the daemon, with vLLM's offloading verbs: submit, get finished, wait.

:class:`~ucm_client.vllm.worker.UcmWorker` decides what moves when (this step's loads, which layer
waits for what, which requests' saves are done); this room does the moving, the way vLLM's own
``OffloadingWorker`` keeps transfers apart from its connector: :meth:`DaemonTransfers.submit_load`
and :meth:`~DaemonTransfers.submit_store` hand a job's parts to the daemon without waiting for its
answer, :meth:`~DaemonTransfers.get_finished` collects the jobs that ended without blocking, and
:meth:`~DaemonTransfers.wait` blocks until a job (or one layer of it) ended. It also owns what the
daemon needs to reach the KV cache: the link (``link``), the memory registration and the
:class:`~ucm_client.vllm.kv_access.KVAccess` chosen for it, and the progress words a whole-block
load counts its copied layers in.

Failures are data here too: a part that could not be sent, was refused, or did not end in time ends
with every block failed; failed loads are collected for ``get_block_ids_with_load_errors``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ucm_client import BlockIO, UcmClient, tracing
from ucm_client.cuda_ipc import CudaUnavailable, StreamMark
from ucm_client.errors import UcmError, Unavailable
from ucm_client.load_progress import LOAD_PROGRESS_DONE
from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig
from ucm_client.vllm.identity import layer_key
from ucm_client.vllm.jobs import PartTask, TransferJob, per_block
from ucm_client.vllm.kv_access import (
    KVAccess,
    LayerKVAccess,
    SharedMemoryKV,
    StagedKV,
    choose_kv_access,
    staged_kv_access,
)
from ucm_client.vllm.kv_memory import KVMemory, ShmAllocation
from ucm_client.vllm.link import DaemonLink
from ucm_client.vllm.staging import StagingArea
from ucm_client.vllm.stats import UcmConnectorStats

__all__ = ["DaemonTransfers"]

logger = logging.getLogger(LOGGER_NAME)


class DaemonTransfers:
    """One rank's transfers to and from the daemon, and the memory registration they need."""

    def __init__(
        self,
        vllm_config: Any,
        config: ConnectorConfig,
        stats: UcmConnectorStats,
        *,
        namespaces: Sequence[bytes],
        layer_names: Sequence[str],
        role: str,
    ) -> None:
        self._vllm_config = vllm_config
        self._config = config
        self._stats = stats
        self._namespaces = list(namespaces)
        """Per KV cache group (one unless the model is hybrid)."""
        self._layers = tuple(layer_names)
        """Layer names by layer index (layerwise only): layer ``i``'s objects are ``layer_key(key, i)``."""
        self._link = DaemonLink(
            config.target,
            reconnect_interval_s=config.reconnect_interval_s,
            connect_timeout_s=config.connect_timeout_s,
            rpc_timeout_s=config.rpc_timeout_s,
            on_connect=self._on_connect,
            role=role,
        )
        self._alloc: ShmAllocation | None = None
        self._kv: KVAccess | None = None
        """How the daemon reaches the KV cache (chosen once per registration; see ``kv_access``)."""
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._registered = False
        self._io_off: str | None = None
        """Why this worker moves no bytes at all (set once, logged once); None normally."""
        self._segment_of: dict[str, int] = {}
        """Zero copy on CPU: which segment of a whole block holds each layer's page (empty when a
        block's segments do not follow its layers: whole-block loads are then waited for whole)."""
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ memory

    def mem_pool_context(self) -> ShmAllocation | None:
        """Have vLLM allocate its CPU KV cache in shared memory (see ``kv_memory``)."""
        if self._vllm_config.device_config.device_type != "cpu" or not self._config.zero_copy:
            return None
        self._alloc = ShmAllocation()
        return self._alloc

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Choose how the daemon reaches ``kv_caches`` and register that memory with it once.

        CPU: the KV cache itself is put in shared memory (zero copy). CUDA: each KV storage is
        registered by CUDA IPC and the daemon copies with ``cudaMemcpyAsync`` (zero copy). Otherwise
        (``zero_copy: false``, or CUDA IPC refused) blocks go through a shared-memory staging buffer.
        """
        self._kv_caches = kv_caches
        chosen = choose_kv_access(
            kv_caches,
            zero_copy=self._config.zero_copy,
            staging_bytes=self._staging_bytes,
            layerwise=bool(self._layers),
            alloc=self._alloc,
            vllm_config=self._vllm_config,
        )
        self._use(chosen)
        self._segment_of = self._segments_by_layer()
        self._link.client()  # registers now if the daemon is up; otherwise on reconnect

    def refuse(self, kv_caches: dict[str, torch.Tensor], reason: str) -> None:
        """Move no bytes at all for ``kv_caches`` (a layout no transfer can serve), for ``reason``."""
        self._kv_caches = kv_caches
        self._use(reason)

    def adopt(self, kv_caches: dict[str, torch.Tensor], memory: KVMemory) -> None:
        """Zero copy again over ``memory`` (same addresses after a wake-up), registered on next use."""
        self._kv_caches, self._kv = kv_caches, SharedMemoryKV(memory)
        self._link.client()

    def unregister(self) -> None:
        """Forget the KV memory and its daemon regions (every transfer touching it has ended)."""
        client = self._link.client()
        regions = self._kv.regions() if self._kv is not None else []
        if client is not None:
            try:
                for region in regions:
                    client.unregister(region)
            except UcmError as exc:
                self._link.failed(exc)
        self._registered = False
        self._kv = None
        self._kv_caches = {}
        self._alloc = None

    @property
    def kv_caches(self) -> dict[str, torch.Tensor]:
        return self._kv_caches

    @property
    def _staging_bytes(self) -> int:
        return int(self._config.staging_buffer_gib * (1 << 30))

    def _segments_by_layer(self) -> dict[str, int]:
        memory = self.memory
        if memory is None or self._layers:
            return {}
        found = {name: memory.segment_of(name) for name in self._kv_caches}
        return {name: i for name, i in found.items() if i is not None}

    def _use(self, chosen: KVAccess | str) -> None:
        """Hold the chosen access, or remember why this worker moves no bytes at all."""
        if isinstance(chosen, str):
            self._io_off, self._kv = chosen, None
        else:
            self._kv = chosen

    def _on_connect(self, client: UcmClient) -> None:
        """Register the memory the daemon copies to and from (once; the client re-registers later)."""
        if self._registered or self._kv is None:
            return
        try:
            self._kv.register(client)
        except CudaUnavailable as exc:
            logger.warning("UCM worker: CUDA IPC refused (%s); using a staging buffer instead", exc)
            layerwise = bool(self._layers)
            staged = staged_kv_access(self._kv_caches, "cuda", self._staging_bytes, layerwise=layerwise)
            self._use(staged)
            if self._kv is None:
                return
            self._kv.register(client)
        self._registered = True

    @property
    def memory(self) -> KVMemory | None:
        """The zero-copy KV cache in shared memory (None on the staging and CUDA paths)."""
        return self._kv.memory if isinstance(self._kv, SharedMemoryKV) else None

    @property
    def staging(self) -> StagingArea | None:
        """The staging buffer (None on the zero-copy paths)."""
        return self._kv.staging if isinstance(self._kv, StagedKV) else None

    @property
    def zero_copy_host(self) -> bool:
        """The daemon copies straight into a CPU KV cache (loads may be sent before the forward)."""
        return isinstance(self._kv, SharedMemoryKV)

    def before_dump(self) -> None:
        """Before a dump of pages the forward just wrote: let those kernels finish (CUDA)."""
        if self._kv is not None:
            self._kv.before_dump()

    def mark(self) -> StreamMark | None:
        """A mark recorded after the kernels queued so far (CUDA), to dump a layer once it is reached."""
        return self._kv.mark() if self._kv is not None else None

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

    def _layer_access(self) -> LayerKVAccess | None:
        """The access as one that moves single layers (always so when layerwise: staging is refused)."""
        return self._kv if isinstance(self._kv, LayerKVAccess) else None

    def part_bytes(self, layer: int | None) -> int:
        """Bytes one part moves per block: a whole block, or layer ``layer``'s page."""
        if layer is None:
            return self._kv.block_bytes if self._kv is not None else 0
        kv = self._layer_access()
        return kv.layer_bytes(self._layers[layer]) if kv is not None else 0

    # ------------------------------------------------------------------ the verbs

    def submit_load(self, job: TransferJob) -> None:
        """Send every part of a load (whole blocks, or all layers at once) without waiting."""
        self._submit_all(job)

    def submit_store(self, job: TransferJob, layer: int | None = None) -> None:
        """Send a dump: every part, or only layer ``layer``'s (layerwise, as the layer is written)."""
        if layer is None:
            self._submit_all(job)
        else:
            job.parts[layer] = self._submit_part(job, layer)

    def _submit_all(self, job: TransferJob) -> None:
        layers: list[int | None] = list(range(len(self._layers))) if self._layers else [None]
        job.parts = [self._submit_part(job, layer) for layer in layers]

    def get_finished(self, jobs: Iterable[TransferJob], *, in_order: bool = False) -> list[TransferJob]:
        """The ``jobs`` that have ended, polled without blocking (a job past its deadline is waited
        for briefly and ends failed). ``in_order``: they end in submission order, so polling stops
        at the first one still running (each poll is an RPC)."""
        ended: list[TransferJob] = []
        running = False
        for job in jobs:
            if not job.ended and not (in_order and running):
                running = not self._poll(job)
            if job.ended:
                ended.append(job)
        return ended

    def wait(self, job: TransferJob, layer: int | None = None, deadline: float | None = None) -> None:
        """Block until a job's parts ended (only layer ``layer``'s when given and the job is layerwise)."""
        parts = job.parts if layer is None or len(job.parts) == 1 else [job.parts[layer]]
        for part in parts:
            if part is None or part.ended:
                continue
            self._answer(job, part, block=True)
            if part.ended:
                continue
            remaining = max((deadline or job.deadline) - time.monotonic(), 0.001)
            self._end_part(job, part, self._wait_task(part.task_id, job.count, remaining))

    def layer_copied(self, job: TransferJob, layer_name: str) -> bool:
        """Whole blocks: wait on the job's progress word until ``layer_name``'s segment of every
        block is copied (True), while the daemon goes on copying the later layers. False (wait
        for the whole job) without a word, for a layer whose page is not a segment of its own, or
        once the task ended first (its result then says which blocks failed)."""
        part = job.parts[0] if len(job.parts) == 1 else None
        segment = self._segment_of.get(layer_name)
        words = self._kv.progress if isinstance(self._kv, SharedMemoryKV) else None
        if part is None or part.word is None or part.ended or segment is None or words is None:
            return False
        return words.wait(part.word, segment + 1, job.deadline)

    @property
    def store_saturated(self) -> bool:
        """The daemon said it cannot keep up with dumps (read off the session stream and the last
        Load/Dump answer: no call); False while no bytes move or the daemon is known to be down (it
        is not reconnected to here: the step's saves take the link's retry)."""
        client = None if self._io_off else self._link.current()
        return client is not None and client.store_saturated

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def close(self) -> None:
        self._link.close()

    # ------------------------------------------------------------------ one part

    def _submit_part(self, job: TransferJob, layer: int | None) -> PartTask:
        """Hand one part (whole blocks, or one layer) to the daemon; a failed part if it could not be."""
        transfer, op = job.transfer, ("load" if job.load else "save")
        part = PartTask(None, self.part_bytes(layer))
        client = None if self._io_off else self._client()
        kv = self._kv
        if client is None or not self._registered or kv is None:
            if not self._io_off:
                self._stats.add(daemon_unavailable=1)
            self._end_part(job, part, None)
            return part
        if layer is None:
            part.slots = kv.acquire(transfer.block_ids, save=not job.load)
            if part.slots is None:
                logger.warning("UCM worker: staging buffer full, %s of %s skipped", op, transfer.req_id)
                self._end_part(job, part, None)
                return part
        try:
            if layer is None:
                assert part.slots is not None
                blocks = kv.blocks(transfer.keys, transfer.block_ids, part.slots)
            else:
                blocks = self._layer_blocks(layer, job)
            namespace = self._namespaces[transfer.group]
            if job.load:  # the answer is taken when the part is first waited for (``_answer``)
                words = kv.progress if layer is None and isinstance(kv, SharedMemoryKV) else None
                part.word = words.take() if words is not None and self._segment_of else None
                progress = words.segment(part.word) if words is not None and part.word is not None else None
                with tracing.job_context(job):  # the daemon's task joins the job's trace
                    part.submitted = client.load_nowait(namespace, blocks, progress=progress)
                return part
            with tracing.job_context(job):
                part.submitted = client.dump_nowait(namespace, blocks)  # answered like a load's
        except UcmError as exc:
            self._refused(job, part, exc)
        return part

    def _layer_blocks(self, layer: int, job: TransferJob) -> list[BlockIO]:
        """Layer ``layer``'s object of each block: its page, under ``layer_key(key, layer)``."""
        kv = self._layer_access()
        assert kv is not None
        keys = [layer_key(key, layer) for key in job.transfer.keys]
        return kv.layer_blocks(self._layers[layer], keys, job.transfer.block_ids)

    def _refused(self, job: TransferJob, part: PartTask, exc: UcmError) -> None:
        """A part the daemon did not take: its blocks fail (loads are recomputed)."""
        if self._link.failed(exc):
            self._stats.add(daemon_unavailable=1)
        else:
            op = "load" if job.load else "save"
            logger.warning("UCM worker: %s of %s refused: %s", op, job.transfer.req_id, exc)
        self._end_part(job, part, None)

    def _answer(self, job: TransferJob, part: PartTask, *, block: bool) -> bool:
        """Take a part's task id from the daemon's answer to its ``Load`` or ``Dump`` (sent without
        waiting: the forward started meanwhile); False while it is still on its way and ``block`` is
        off. A refused part ends as failed (a load is recomputed, a save is not stored)."""
        future = part.submitted
        if future is None:
            return True
        if not block and not future.done():
            return False
        part.submitted = None
        try:
            part.task_id = future.result(timeout=2 * self._config.rpc_timeout_s)
        except UcmError as exc:
            self._refused(job, part, exc)
            return True
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            op = "Load" if job.load else "Dump"
            self._refused(job, part, Unavailable(f"the {op} call got no answer"))
            return True
        self._link.succeeded()
        return True

    def _end_part(self, job: TransferJob, part: PartTask, ok: list[bool] | None) -> None:
        """Record a part's outcome: its failed loads become load errors, its staging slots are freed.

        Its progress word is given back only once it reads ``LOAD_PROGRESS_DONE`` (the daemon's
        task ended, or the call never reached it): a task still running after a lost connection
        might otherwise count into the word of a later load."""
        flags = part.end(ok, job.count)
        words = self._kv.progress if isinstance(self._kv, SharedMemoryKV) else None
        if part.word is not None and words is not None and words.read(part.word) == LOAD_PROGRESS_DONE:
            words.give_back(part.word)
        part.word = None
        block_ids = job.transfer.block_ids
        if part.slots is not None and self._kv is not None:
            self._kv.finish(part.slots, block_ids, flags, load=job.load)
            part.slots = None
        if job.load:
            self._load_errors.update(b for b, good in zip(block_ids, flags, strict=True) if not good)

    def _poll(self, job: TransferJob) -> bool:
        """Collect the parts that ended, without blocking; True once the whole job has ended.

        Stops at the first part still running: later ones are asked next step (each ask is an RPC).
        """
        for part in job.parts:
            if part is None or part.ended:
                continue
            if not self._answer(job, part, block=time.monotonic() >= job.deadline):
                break
            if part.ended:
                continue
            outcome = self._check_task(part.task_id, job.count, job.deadline)
            if outcome is False:
                break
            self._end_part(job, part, outcome if isinstance(outcome, list) else None)
        return job.ended

    def _wait_task(self, task_id: int | None, count: int, timeout_s: float) -> list[bool] | None:
        """Per-block success once the task is done; None if it failed as a whole or timed out."""
        client = self._link.client()
        if client is None or task_id is None:
            return None
        try:
            result = client.wait(task_id, timeout_s, cancel_on_timeout=True)
        except UcmError as exc:
            self._link.failed(exc)
            return None
        if not result.done:
            return None
        return per_block(result.states, count)

    def _check_task(self, task_id: int | None, count: int, deadline: float) -> list[bool] | bool | None:
        """Like ``_wait_task`` without blocking: False while still running (and before its deadline)."""
        if task_id is None:
            return None
        if time.monotonic() >= deadline:
            return self._wait_task(task_id, count, 0.001)
        client = self._link.client()
        if client is None:
            return None
        try:
            result = client.check(task_id)
        except UcmError as exc:
            self._link.failed(exc)
            return None
        if not result.done:
            return False
        return per_block(result.states, count)
