"""Worker half of the connector: schedule the moves of block bytes between the daemon and vLLM's KV cache.

Runs in every worker process, on its own TP rank's shard. Per step it is told (metadata) which
blocks to load and which to save; it never decides what, only when: the moving itself, and the
memory registration it needs, are :class:`~ucm_client.vllm.transfers.DaemonTransfers`' (vLLM's
verbs: submit, get finished, wait). Loads that feed this step's forward are waited
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

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ucm_client import tracing
from ucm_client.vllm.config import LOGGER_NAME, ConnectorConfig
from ucm_client.vllm.identity import KeySpace
from ucm_client.vllm.jobs import TransferJob
from ucm_client.vllm.kv_memory import KVMemory, ShmAllocation, state_pages
from ucm_client.vllm.metadata import BlockTransfer, UcmConnectorMetadata
from ucm_client.vllm.staging import StagingArea
from ucm_client.vllm.stats import UcmConnectorStats
from ucm_client.vllm.transfers import DaemonTransfers

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
    """Schedules one rank's loads and saves; the daemon conversation is its ``DaemonTransfers``."""

    def __init__(
        self, vllm_config: Any, keyspace: KeySpace, config: ConnectorConfig, tp_rank: int, pp_rank: int = 0
    ):
        self._config = config
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
        self._stats = UcmConnectorStats()
        self._io = DaemonTransfers(
            vllm_config,
            config,
            self._stats,
            namespaces=[keyspace.namespace(tp_rank, group.index, pp_rank) for group in keyspace.groups],
            layer_names=self._layers,
            role=f"worker rank {tp_rank}",
        )
        self._suspended: tuple[dict[str, torch.Tensor], KVMemory | None] | None = None
        """What ``unregister`` dropped (sleep mode), for ``restore`` to register again."""
        self._sync_loads: list[TransferJob] = []
        self._async_loads: dict[str, list[TransferJob]] = {}
        """Per request, one job per KV cache group; the request is loaded once all have ended."""
        self._saves: dict[str, _SaveState] = {}
        self._save_jobs: list[TransferJob] = []
        """Dumps in flight, oldest first; each may hold blocks of several requests."""
        self._layer_save: tuple[UcmConnectorMetadata, TransferJob] | None = None
        """This step's layerwise dump, filled layer by layer until ``save`` seals it."""
        self._layer_marks: list[tuple[int, Any]] = []
        """Layers written but not yet dumped: on CUDA, until their kernels have finished."""
        self._pressure_step: UcmConnectorMetadata | None = None
        self._pressure = False
        """Whether the step ``_pressure_step`` skips its saves (see ``_saturated``)."""
        self._loads_started: UcmConnectorMetadata | None = None
        """This step's metadata when ``handle_preemptions`` already submitted its loads."""

    # ------------------------------------------------------------------ registration

    def mem_pool_context(self) -> ShmAllocation | None:
        """Have vLLM allocate its CPU KV cache in shared memory (see ``kv_memory``)."""
        return self._io.mem_pool_context()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Check the layers and groups, then let the transfers make the KV cache reachable by the daemon."""
        if not kv_caches:
            return
        if missing := [name for name in self._layers if name not in kv_caches]:
            raise RuntimeError(f"use_layerwise: no KV cache tensor for layers {missing} of the KV config")
        caches = {
            name: state_pages(kv) if isinstance(kv, list | tuple) else kv for name, kv in kv_caches.items()
        }
        if self._groups and (problem := group_layout_problem(caches, self._groups)):
            logger.error("UCM worker: %s", problem)
            self._io.refuse(caches, problem)
            return
        self._io.register(caches)

    @property
    def memory(self) -> KVMemory | None:
        """The zero-copy KV cache in shared memory (None on the staging and CUDA paths)."""
        return self._io.memory

    @property
    def staging(self) -> StagingArea | None:
        """The staging buffer (None on the zero-copy paths)."""
        return self._io.staging

    # ------------------------------------------------------------------ per step

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
        if load:
            self._io.submit_load(job)
        else:
            self._io.submit_store(job)
        return job

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
            if layer_name is not None and self._io.layer_copied(job, layer_name):
                self._stats.add(load_layers_ahead=1)
                continue  # this layer's pages are in; the job is waited for to its end later
            self._io.wait(job, layer)
            if job.ended:
                self._sync_loads.remove(job)
                self._account(job)
        self._stats.add(load_wait_seconds=time.monotonic() - started)

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
        self._io.before_dump()  # CUDA: the daemon reads the blocks the forward's kernels just wrote
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
            self._layer_marks.append((layer, self._io.mark()))
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
            self._io.submit_store(job, layer)

    def _seal_layer_saves(self) -> None:
        """End of step: submit what is left (layers whose attention did not run) and track the dump."""
        if self._layer_save is None:
            return
        meta, job = self._layer_save
        self._flush_layer_saves(job, block=True)
        if None in job.parts:
            self._io.before_dump()
        for layer, part in enumerate(job.parts):
            if part is None:
                self._io.submit_store(job, layer)
        self._layer_save = None
        self._track_save(job, meta.saves)

    def _saturated(self, meta: UcmConnectorMetadata) -> bool:
        """The daemon said it cannot keep up with dumps (``store_saturated``, read off the session
        stream and the last Load/Dump answer: no call); decided once per step. A daemon known to be
        down is not asked (nor reconnected to): the step's saves take the link's retry."""
        if self._pressure_step is not meta:
            self._pressure_step, self._pressure = meta, self._io.store_saturated
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
                self._io.wait(job)
                self._complete_save(job)
        if meta.allocated_block_ids:
            for job in list(self._save_jobs):
                if not meta.allocated_block_ids.isdisjoint(job.transfer.block_ids):
                    self._io.wait(job)
                    self._complete_save(job)
        if self._io.zero_copy_host and not self._states_first:
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
            if len(self._io.get_finished(jobs)) == len(jobs):  # every job polled, none skipped
                del self._async_loads[req_id]
                for job in jobs:
                    self._account(job)
                recving.add(req_id)

        # Dumps finish in submission order, so polling stops at the first one still running.
        for job in self._io.get_finished(list(self._save_jobs), in_order=True):
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
        return self._io.take_load_errors()

    @property
    def stats(self) -> UcmConnectorStats:
        return self._stats

    def take_stats(self) -> UcmConnectorStats | None:
        return self._stats.take()

    def unregister(self) -> None:
        """Finish every transfer touching the KV memory, then forget it and its daemon region."""
        self.wait_for_layer_load()
        for job in (job for jobs in self._async_loads.values() for job in jobs):
            self._io.wait(job)  # reported by the next get_finished
        self._seal_layer_saves()
        for job in list(self._save_jobs):
            self._io.wait(job)
            self._complete_save(job)
        if self._io.kv_caches:
            self._suspended = (self._io.kv_caches, self.memory)
        self._io.unregister()

    def restore(self) -> None:
        """Register the KV caches ``unregister`` dropped again (vLLM woke up; same addresses)."""
        suspended, self._suspended = self._suspended, None
        if suspended is None or self._io.kv_caches:
            return
        kv_caches, memory = suspended
        if memory is not None:  # CPU zero copy: the same shared buffer, registered anew on next use
            self._io.adopt(kv_caches, memory)
        else:  # CUDA IPC or staging: new handles / staging area for the remapped memory
            self.register_kv_caches(kv_caches)

    def shutdown(self) -> None:
        """Give in-flight saves a short grace period, then let go of the daemon."""
        deadline = time.monotonic() + min(self._config.save_timeout_s, 5.0)
        self._seal_layer_saves()
        for job in list(self._save_jobs):
            self._io.wait(job, deadline=deadline)
            self._complete_save(job)
        self._saves.clear()
        self._io.close()
