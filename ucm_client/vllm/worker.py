"""Worker half of the connector: move block bytes between the daemon and vLLM's KV cache.

Runs in every worker process, on its own TP rank's shard. Per step it is told (metadata) which
blocks to load and which to save; it never decides. Loads that feed this step's forward are waited
for at the first attention layer; on CPU zero copy each layer waits only until its own pages of every
block are in (the Load's progress word, ``ucm_client.load_progress``: the daemon copies every block's
layer-0 page first, then layer 1's, ...), and the whole load is waited for at the end of the step.
Async loads and all saves are polled each step and never block decode. Failures are data: a block
that did not load is reported through ``get_block_ids_with_load_errors`` and vLLM recomputes it; a
save that failed is a future miss.

With ``use_layerwise`` every block is one object per attention layer. All layers' loads are
submitted before the forward (one task per layer), each attention layer waits for its own layer only,
so the copy of layer L+1 overlaps the compute of layer L; each layer's dump is submitted right after
its attention wrote the layer. A block counts as loaded only if every layer of it loaded.

Hybrid models (several KV cache groups) move each group's blocks under that group's namespace, one
task per group. vLLM's hybrid allocator lays every group over the same pages (a block id names the
same bytes whichever group holds it), so a group's block is the whole block's bytes; this is checked
at registration, and a layout where it does not hold moves nothing. vLLM frees a sliding-window
block while its request still runs, once it leaves the window: before a step's forward writes into
blocks handed out again, any dump still reading them is waited for. A Mamba group's block is one
page of state (vLLM's list of state tensors per layer is viewed as that page, ``state_pages``); as
Mamba layers never call ``wait_for_layer_load``, a model with one waits for its sync loads before
the forward.

Known, as on the whole-block path: when a full hit leaves the prompt's last token to recompute, the
forward writes that token's slot in the last loaded block while the daemon may still be copying the
same block. Both write the KV of the same token after the same prefix, so either value is right.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm_client import BlockIO, UcmClient, tracing
from ucm_client.cuda_ipc import CudaUnavailable, StreamMark
from ucm_client.errors import UcmError, Unavailable
from ucm_client.load_progress import LOAD_PROGRESS_DONE
from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig
from ucm_client.vllm.identity import KeySpace, layer_key
from ucm_client.vllm.jobs import PartTask, TransferJob, per_block
from ucm_client.vllm.kv_access import (
    KVAccess,
    LayerKVAccess,
    SharedMemoryKV,
    StagedKV,
    choose_kv_access,
    staged_kv_access,
)
from ucm_client.vllm.kv_memory import KVMemory, ShmAllocation, state_pages
from ucm_client.vllm.link import DaemonLink
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.staging import StagingArea
from ucm_client.vllm.stats import UcmConnectorStats

__all__ = ["UcmWorker"]

logger = logging.getLogger(LOGGER_NAME)


@dataclass(slots=True)
class _SaveState:
    pending: list[TransferJob] = field(default_factory=list)
    finished: bool = False


def _combine(req_id: str, transfers: Iterable[BlockTransfer]) -> BlockTransfer:
    """Several requests' blocks of one KV cache group as one transfer (one daemon task per step or layer)."""
    transfers = list(transfers)
    combined = BlockTransfer(
        req_id,
        tuple(b for t in transfers for b in t.block_ids),
        tuple(k for t in transfers for k in t.keys),
        group=transfers[0].group if transfers else 0,
    )
    tracing.combined_from(combined, transfers)  # its span names every request in it
    return combined


def _by_group(transfers: Iterable[BlockTransfer]) -> list[list[BlockTransfer]]:
    """Transfers split by KV cache group (a group's blocks live under its own namespace)."""
    groups: dict[int, list[BlockTransfer]] = {}
    for transfer in transfers:
        groups.setdefault(transfer.group, []).append(transfer)
    return [groups[g] for g in sorted(groups)]


def group_layout_problem(kv_caches: dict[str, torch.Tensor], groups: Iterable[tuple[str, ...]]) -> str | None:
    """Why a hybrid model's groups cannot be moved as whole blocks, or None when they can.

    Whole-block transfers move every distinct KV page of a block id. That is one group's block only
    when every group's layers cover all those pages, as vLLM's hybrid allocator lays them out (each
    KV tensor shared by one layer of every group).
    """
    every = {t.data_ptr() for t in kv_caches.values()}
    for index, layers in enumerate(groups):
        missing = [name for name in layers if name not in kv_caches]
        if missing:
            return f"KV cache group {index}: no KV cache tensor for layers {missing}"
        if {kv_caches[name].data_ptr() for name in layers} != every:
            return (
                f"KV cache group {index} ({', '.join(layers)}) does not cover every KV page of a block: "
                "this layout of vLLM's hybrid KV cache is not supported; loads and saves are off"
            )
    return None


class UcmWorker:
    """Schedules one rank's loads and saves; reaches its KV cache through one ``KVAccess``."""

    def __init__(
        self, vllm_config: Any, keyspace: KeySpace, config: ConnectorConfig, tp_rank: int, pp_rank: int = 0
    ):
        self._vllm_config = vllm_config
        self._config = config
        self._namespaces = [keyspace.namespace(tp_rank, group.index, pp_rank) for group in keyspace.groups]
        """Per KV cache group (one unless the model is hybrid)."""
        self._groups = tuple(group.layer_names for group in keyspace.groups) if keyspace.hybrid else ()
        self._writer = tp_rank == 0 or not keyspace.replicated
        """False on TP ranks > 0 of an MLA model: rank 0 stores the one copy of KV every rank holds."""
        self._states_first = keyspace.has_state_groups
        """Mamba layers read their state without waiting for loads (vLLM calls ``wait_for_layer_load``
        from attention layers only): this step's sync loads end before the forward."""
        self._layerwise = keyspace.layerwise
        self._layers = keyspace.layer_names if keyspace.layerwise else ()
        """Layer names by layer index (layerwise only): layer ``i``'s objects are ``layer_key(key, i)``."""
        self._layer_index = {name: i for i, name in enumerate(self._layers)}
        self._link = DaemonLink(
            config.target,
            reconnect_interval_s=config.reconnect_interval_s,
            connect_timeout_s=config.connect_timeout_s,
            rpc_timeout_s=config.rpc_timeout_s,
            on_connect=self._on_connect,
            role=f"worker rank {tp_rank}",
        )
        self._alloc: ShmAllocation | None = None
        self._kv: KVAccess | None = None
        """How the daemon reaches the KV cache (chosen once per registration; see ``kv_access``)."""
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._suspended: tuple[dict[str, torch.Tensor], KVMemory | None] | None = None
        """What ``unregister`` dropped (sleep mode), for ``restore`` to register again."""
        self._registered = False
        self._io_off: str | None = None
        """Why this worker moves no bytes at all (set once, logged once); None normally."""
        self._sync_loads: list[TransferJob] = []
        self._async_loads: dict[str, list[TransferJob]] = {}
        """Per request, one job per KV cache group; the request is loaded once all have ended."""
        self._saves: dict[str, _SaveState] = {}
        self._save_jobs: list[TransferJob] = []
        """Dumps in flight, oldest first; each may hold blocks of several requests."""
        self._layer_save: tuple[UcmConnectorMetadata, TransferJob] | None = None
        """This step's layerwise dump, filled layer by layer until ``save`` seals it."""
        self._layer_marks: list[tuple[int, StreamMark | None]] = []
        """Layers written but not yet dumped: on CUDA, until their kernels have finished."""
        self._load_errors: set[int] = set()
        self._pressure_step: UcmConnectorMetadata | None = None
        self._pressure = False
        """Whether the step ``_pressure_step`` skips its saves (see ``_saturated``)."""
        self._stats = UcmConnectorStats()
        self._loads_started: UcmConnectorMetadata | None = None
        """This step's metadata when ``handle_preemptions`` already submitted its loads."""
        self._segment_of: dict[str, int] = {}
        """Zero copy on CPU: which segment of a whole block holds each layer's page (empty when a
        block's segments do not follow its layers: whole-block loads are then waited for whole)."""

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
        if missing := [name for name in self._layers if name not in kv_caches]:
            raise RuntimeError(f"use_layerwise: no KV cache tensor for layers {missing} of the KV config")
        self._kv_caches = {
            name: state_pages(kv) if isinstance(kv, list | tuple) else kv for name, kv in kv_caches.items()
        }
        if self._groups and (problem := group_layout_problem(self._kv_caches, self._groups)):
            logger.error("UCM worker: %s", problem)
            self._use(problem)
            return
        chosen = choose_kv_access(
            self._kv_caches,
            zero_copy=self._config.zero_copy,
            staging_bytes=self._staging_bytes,
            layerwise=self._layerwise,
            alloc=self._alloc,
            vllm_config=self._vllm_config,
        )
        self._use(chosen)
        self._segment_of = self._segments_by_layer()
        self._link.client()  # registers now if the daemon is up; otherwise on reconnect

    @property
    def _staging_bytes(self) -> int:
        return int(self._config.staging_buffer_gib * (1 << 30))

    def _segments_by_layer(self) -> dict[str, int]:
        memory = self.memory
        if memory is None or self._layerwise:
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
            staged = staged_kv_access(self._kv_caches, "cuda", self._staging_bytes, layerwise=self._layerwise)
            self._use(staged)
            if self._kv is None:
                return
            self._kv.register(client)
        self._registered = True

    @property
    def _block_bytes(self) -> int:
        return self._kv.block_bytes if self._kv is not None else 0

    @property
    def memory(self) -> KVMemory | None:
        """The zero-copy KV cache in shared memory (None on the staging and CUDA paths)."""
        return self._kv.memory if isinstance(self._kv, SharedMemoryKV) else None

    @property
    def staging(self) -> StagingArea | None:
        """The staging buffer (None on the zero-copy paths)."""
        return self._kv.staging if isinstance(self._kv, StagedKV) else None

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

    def _layer_access(self) -> LayerKVAccess | None:
        """The access as one that moves single layers (always so when layerwise: staging is refused)."""
        return self._kv if isinstance(self._kv, LayerKVAccess) else None

    def _layer_blocks(self, layer: int, transfer: BlockTransfer) -> list[BlockIO]:
        """Layer ``layer``'s object of each block: its page, under ``layer_key(key, layer)``."""
        kv = self._layer_access()
        assert kv is not None
        keys = [layer_key(key, layer) for key in transfer.keys]
        return kv.layer_blocks(self._layers[layer], keys, transfer.block_ids)

    def _part_bytes(self, layer: int | None) -> int:
        """Bytes one part moves per block: a whole block, or layer ``layer``'s page."""
        if layer is None:
            return self._block_bytes
        kv = self._layer_access()
        return kv.layer_bytes(self._layers[layer]) if kv is not None else 0

    def _new_job(self, transfer: BlockTransfer, *, load: bool) -> TransferJob:
        now = time.monotonic()
        timeout = self._config.load_timeout_s if load else self._config.save_timeout_s
        job = TransferJob(transfer, load, now, now + timeout)
        parts = len(self._layers) if self._layerwise else 1
        tracing.job_started(job, parts=parts, is_async=transfer.is_async)  # its span, when tracing is on
        return job

    def _start(self, transfer: BlockTransfer, *, load: bool) -> TransferJob:
        """A job with every part submitted now: whole blocks, or all layers at once (layerwise)."""
        job = self._new_job(transfer, load=load)
        layers: list[int | None] = list(range(len(self._layers))) if self._layerwise else [None]
        job.parts = [self._submit_part(job, layer) for layer in layers]
        return job

    def _submit_part(self, job: TransferJob, layer: int | None) -> PartTask:
        """Hand one part (whole blocks, or one layer) to the daemon; a failed part if it could not be."""
        transfer, op = job.transfer, ("load" if job.load else "save")
        part = PartTask(None, self._part_bytes(layer))
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
                blocks = self._layer_blocks(layer, transfer)
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

    def _account(self, job: TransferJob) -> None:
        """Count an ended job once: a block counts as moved only if every part (layer) moved it."""
        if job.accounted:
            return
        job.accounted = True
        good = sum(job.block_ok())
        nbytes, seconds = good * job.block_bytes, time.monotonic() - job.started
        tracing.job_ended(job, good=good, count=job.count, nbytes=nbytes)
        if job.load:
            self._stats.add(
                load_blocks=good, load_bytes=nbytes, load_seconds=seconds, load_failed_blocks=job.count - good
            )
        else:
            self._stats.add(
                save_blocks=good, save_bytes=nbytes, save_seconds=seconds, save_failed_blocks=job.count - good
            )

    def start_load(self, meta: UcmConnectorMetadata) -> None:
        """Submit this step's loads; sync ones are waited for by the attention layers that read them.

        Layerwise, the step's sync loads are combined into one task per layer (all submitted now,
        before the forward), so a step costs one submission per layer however many requests hit.

        On CPU zero copy they are submitted from ``handle_preemptions``, which vLLM calls first
        thing in a step, before it prepares the step's inputs (about a millisecond for a long
        prompt), not from ``start_load_kv`` right before the forward: the daemon copies meanwhile.
        That is safe there: the previous forward has returned (CPU runs it synchronously), the
        dumps still reading reused blocks have been waited for, and nothing before the forward
        touches the KV cache. Not with Mamba state groups (vLLM copies state blocks in between),
        nor on CUDA (the previous step's kernels may still run)."""
        if meta is self._loads_started:
            self._loads_started = None
            return
        layerwise_sync: list[BlockTransfer] = []
        for transfer in meta.loads:
            if transfer.is_async:
                self._async_loads.setdefault(transfer.req_id, []).append(self._start(transfer, load=True))
            elif self._layerwise:
                layerwise_sync.append(transfer)
            else:
                self._sync_loads.append(self._start(transfer, load=True))
        if layerwise_sync:  # layerwise models have one KV cache group
            self._sync_loads.append(self._start(_combine("step-load", layerwise_sync), load=True))
        if self._states_first:
            self.wait_for_layer_load(None)

    @property
    def sync_loads(self) -> tuple[TransferJob, ...]:
        """This step's sync loads not yet waited for to the end (for tests and diagnostics)."""
        return tuple(self._sync_loads)

    def wait_for_layer_load(self, layer_name: str | None = None) -> None:
        """Before an attention layer reads the KV cache: finish the loads it needs.

        Whole blocks: every sync load, at the first layer. Layerwise: only ``layer_name``'s tasks,
        while the daemon goes on copying the following layers. ``None`` (end of step), or a layer
        without KV of its own (it shares another layer's), finishes every load.
        """
        if not self._sync_loads:
            return
        layer = self._layer_index.get(layer_name) if layer_name is not None else None
        started = time.monotonic()
        for job in list(self._sync_loads):
            if layer_name is not None and self._copied_for(job, layer_name):
                self._stats.add(load_layers_ahead=1)
                continue  # this layer's pages are in; the job is waited for to its end later
            self._wait_job(job, layer)
            if job.ended:
                self._sync_loads.remove(job)
                self._account(job)
        self._stats.add(load_wait_seconds=time.monotonic() - started)

    def _copied_for(self, job: TransferJob, layer_name: str) -> bool:
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

    def _wait_job(self, job: TransferJob, layer: int | None = None, deadline: float | None = None) -> None:
        """Wait for a job's parts (only layer ``layer``'s when given and the job is layerwise)."""
        parts = job.parts if layer is None or len(job.parts) == 1 else [job.parts[layer]]
        for part in parts:
            if part is None or part.ended:
                continue
            self._answer(job, part, block=True)
            if part.ended:
                continue
            remaining = max((deadline or job.deadline) - time.monotonic(), 0.001)
            self._end_part(job, part, self._wait(part.task_id, job.count, remaining))

    def _poll_job(self, job: TransferJob) -> bool:
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
            outcome = self._poll(part.task_id, job.count, job.deadline)
            if outcome is False:
                break
            self._end_part(job, part, outcome if isinstance(outcome, list) else None)
        return job.ended

    def _wait(self, task_id: int | None, count: int, timeout_s: float) -> list[bool] | None:
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

    def _poll(self, task_id: int | None, count: int, deadline: float) -> list[bool] | bool | None:
        """Like ``_wait`` without blocking: False while still running (and before its deadline)."""
        if task_id is None:
            return None
        if time.monotonic() >= deadline:
            return self._wait(task_id, count, 0.001)
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

    def save(self, meta: UcmConnectorMetadata) -> None:
        """End of the step: dump its completed blocks; returns at once (the daemon copies later).

        One dump per step (per layer, layerwise), not per request: each RPC costs about a
        millisecond, and on a busy step those milliseconds are the connector's whole direct overhead.
        """
        self.wait_for_layer_load()  # a step whose forward skipped attention still finishes its loads
        if not self._writer:
            self._skip_replica_saves(meta.saves)
            return
        if meta.saves and self._saturated(meta):
            self._skip_saturated_saves(meta.saves)
            return
        if self._layerwise:
            self._seal_layer_saves()
            return
        if not meta.saves:
            return
        if self._kv is not None:
            self._kv.before_dump()  # CUDA: the daemon reads the blocks the forward's kernels just wrote
        for transfers in _by_group(meta.saves):
            self._track_save(self._start(_combine("step-save", transfers), load=False), transfers)

    def save_layer(self, meta: UcmConnectorMetadata, layer_name: str) -> None:
        """Layerwise: dump ``layer_name``'s page of the step's completed blocks, now that it is written.

        vLLM calls this right after the layer's attention. On CUDA the dump is submitted once a mark
        recorded after the layer's kernels is reached (checked again at every later layer, waited for
        at the end of the step): the daemon never reads a page before the forward finished writing
        it, and the host is not stalled to get there.
        """
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves or not self._writer or self._saturated(meta):
            return
        job = self._layer_save_job(meta)
        if job.parts[layer] is None and all(pending != layer for pending, _ in self._layer_marks):
            self._layer_marks.append((layer, self._kv.mark() if self._kv is not None else None))
        self._flush_layer_saves(job, block=False)

    def _layer_save_job(self, meta: UcmConnectorMetadata) -> TransferJob:
        """This step's layerwise dump (one part per layer, submitted as the layers are written)."""
        if self._layer_save is not None and self._layer_save[0] is not meta:
            self._seal_layer_saves()  # a step that ended without wait_for_save
        if self._layer_save is None:
            job = self._new_job(_combine("step-save", meta.saves), load=False)
            job.parts = [None] * len(self._layers)
            self._layer_save = (meta, job)
        return self._layer_save[1]

    def _flush_layer_saves(self, job: TransferJob, *, block: bool) -> None:
        """Submit the layer dumps whose pages are written, in call order (all of them if ``block``)."""
        while self._layer_marks:
            layer, mark = self._layer_marks[0]
            if mark is not None and not mark.ready():
                if not block:
                    return
                mark.wait()
            self._layer_marks.pop(0)
            job.parts[layer] = self._submit_part(job, layer)

    def _seal_layer_saves(self) -> None:
        """End of step: submit what is left (layers whose attention did not run) and track the dump."""
        if self._layer_save is None:
            return
        meta, job = self._layer_save
        self._flush_layer_saves(job, block=True)
        if self._kv is not None and None in job.parts:
            self._kv.before_dump()
        job.parts = [part or self._submit_part(job, layer) for layer, part in enumerate(job.parts)]
        self._layer_save = None
        self._track_save(job, meta.saves)

    def _saturated(self, meta: UcmConnectorMetadata) -> bool:
        """The daemon said it cannot keep up with dumps (``store_saturated``, read off the session
        stream and the last Load/Dump answer: no call); decided once per step. A daemon known to be
        down is not asked (nor reconnected to): the step's saves take the link's retry."""
        if self._pressure_step is not meta:
            client = None if self._io_off else self._link.current()
            self._pressure_step, self._pressure = meta, client is not None and client.store_saturated
        return self._pressure

    def _skip_saturated_saves(self, transfers: Iterable[BlockTransfer]) -> None:
        """A saturated daemon: this step's saves are skipped, never waited for (counted); their
        requests are reported saved at once, so vLLM frees their blocks as usual."""
        for transfer in transfers:
            self._saves.setdefault(transfer.req_id, _SaveState())
            self._stats.add(save_skipped_blocks=len(transfer.block_ids))

    def _skip_replica_saves(self, transfers: Iterable[BlockTransfer]) -> None:
        """A replica rank (MLA, TP rank > 0) dumps nothing: rank 0 stores the same bytes. Its requests
        still enter the save bookkeeping, so their delayed frees are reported done like rank 0's."""
        for transfer in transfers:
            self._saves.setdefault(transfer.req_id, _SaveState())
            self._stats.add(save_replica_skipped_blocks=len(transfer.block_ids))

    def _track_save(self, job: TransferJob, transfers: Iterable[BlockTransfer]) -> None:
        self._save_jobs.append(job)
        for transfer in transfers:
            self._saves.setdefault(transfer.req_id, _SaveState()).pending.append(job)

    def handle_preemptions(self, meta: UcmConnectorMetadata) -> None:
        """Before the forward: blocks about to be written again must not still be read by a dump.

        Blocks of preempted requests are reused; so are, on hybrid models, sliding-window blocks vLLM
        freed under a running request and handed out again this step (``allocated_block_ids``).
        """
        for req_id in meta.preempted_req_ids:
            state = self._saves.get(req_id)
            for job in list(state.pending) if state is not None else []:
                self._wait_job(job)
                self._complete_save(job)
        if meta.allocated_block_ids:
            for job in list(self._save_jobs):
                if not meta.allocated_block_ids.isdisjoint(job.transfer.block_ids):
                    self._wait_job(job)
                    self._complete_save(job)
        if isinstance(self._kv, SharedMemoryKV) and not self._states_first:
            self.start_load(meta)  # early: see ``start_load``
            self._loads_started = meta

    def _complete_save(self, job: TransferJob) -> None:
        """Account an ended dump once and take it off every request waiting for it."""
        if job not in self._save_jobs:
            return
        self._save_jobs.remove(job)
        for state in self._saves.values():
            if job in state.pending:
                state.pending.remove(job)
        self._account(job)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose delayed free may happen now (saves done) and whose async loads are done."""
        recving: set[str] = set()
        for req_id, jobs in list(self._async_loads.items()):
            if all([self._poll_job(job) for job in jobs]):  # a list: every job polled, none skipped
                del self._async_loads[req_id]
                for job in jobs:
                    self._account(job)
                recving.add(req_id)

        # Dumps finish in submission order, so polling stops at the first one still running.
        running = False
        for job in list(self._save_jobs):
            if not running and not job.ended:
                running = not self._poll_job(job)
            if job.ended:
                self._complete_save(job)

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
        for job in (job for jobs in self._async_loads.values() for job in jobs):
            self._wait_job(job)  # reported by the next get_finished
        self._seal_layer_saves()
        for job in list(self._save_jobs):
            self._wait_job(job)
            self._complete_save(job)
        client = self._link.client()
        regions = self._kv.regions() if self._kv is not None else []
        if client is not None:
            try:
                for region in regions:
                    client.unregister(region)
            except UcmError as exc:
                self._link.failed(exc)
        if self._kv_caches:
            self._suspended = (self._kv_caches, self.memory)
        self._registered = False
        self._kv = None
        self._kv_caches = {}
        self._alloc = None

    def restore(self) -> None:
        """Register the KV caches ``unregister`` dropped again (vLLM woke up; same addresses)."""
        suspended, self._suspended = self._suspended, None
        if suspended is None or self._kv_caches:
            return
        kv_caches, memory = suspended
        if memory is not None:  # CPU zero copy: the same shared buffer, registered anew on next use
            self._kv_caches, self._kv = kv_caches, SharedMemoryKV(memory)
            self._link.client()
        else:  # CUDA IPC or staging: new handles / staging area for the remapped memory
            self.register_kv_caches(kv_caches)

    def shutdown(self) -> None:
        """Give in-flight saves a short grace period, then let go of the daemon."""
        deadline = time.monotonic() + min(self._config.save_timeout_s, 5.0)
        self._seal_layer_saves()
        for job in list(self._save_jobs):
            self._wait_job(job, deadline=deadline)
            self._complete_save(job)
        self._saves.clear()
        self._link.close()
