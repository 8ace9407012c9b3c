"""The worker half of cold KV: dump cold blocks, then load the selected ones into scratch blocks.

Everything here moves whole block pages (``kv_cache[block]`` of one layer), which is layout-agnostic:
the bytes that come back are the bytes that went out, whatever order vLLM's CPU backend keeps K and
V in. Dumps happen when the step's metadata is bound (before the forward; the blocks are full and
were written by earlier steps); loads happen inside the attention backend, per layer, after the
sparse method chose its blocks and before the kernel reads them. A scratch slot keeps the block it
holds across steps, so a selection ESA reuses (between retrievals) costs no load at all.

Per-layer objects in ``ucm-server`` (``cold_block_key(nonce, request, layer, block)``) are what make
that possible: each layer's selection differs, and each layer loads only its own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ucm_client.buffers import SharedBuffer
from ucm_client.sparse.coldkv import ColdDump, ColdKVConfig, ColdKVStepMeta, cold_block_key
from ucm_client.sparse.errors import SparseInputError
from ucm_client.sparse.vllm_runtime import layer_index
from ucm_client.sync import UcmClient
from ucm_client.types import BlockIO, BlockState, Segment

__all__ = ["ColdKVWorker"]

STAGING_BLOCKS = 64
"""Block pages in the shared staging buffer: one dump or load task moves at most this many."""


@dataclass(slots=True)
class _ColdRequest:
    first: int
    last: int
    scratch: tuple[int, ...]
    held: dict[int, dict[int, int]] = field(default_factory=dict)
    """Per layer: scratch slot → logical block it holds now."""


class ColdKVWorker:
    """One per worker process, bound to that worker's KV caches (``register_kv_caches``)."""

    def __init__(self, config: ColdKVConfig, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if not kv_caches:
            raise SparseInputError("cold KV needs the worker's KV caches, got none")
        self.config = config
        self.caches = {layer_index(name): cache for name, cache in kv_caches.items()}
        page = next(iter(self.caches.values()))[0]
        self.page_shape, self.dtype = tuple(page.shape), page.dtype
        self.page_bytes = page.numel() * page.element_size()
        self.client = UcmClient(config.target, client_name="ucm-cold-kv-worker")
        self._buffer = SharedBuffer(STAGING_BLOCKS * self.page_bytes, label="cold-kv")
        self._region = self.client.register(self._buffer)
        self._view = self._buffer.torch()
        self._nonce = ""
        self._namespace = b""
        self._cold: dict[str, _ColdRequest] = {}
        self.stats: Counter[str] = Counter()
        """``dumped_pages``, ``loaded_pages``, ``reused_pages``, ``dump_tasks``, ``load_tasks``."""
        self.seconds: dict[str, float] = {"dump": 0.0, "load": 0.0}
        """Wall time spent in ``dump`` and ``load`` (copies and the daemon's task), for the benchmark."""

    # ------------------------------------------------------------ per step, before the forward
    def apply(self, meta: ColdKVStepMeta) -> None:
        """Forget, dump and take over released ranges, in that order."""
        if meta.nonce != self._nonce:
            self._nonce, self._namespace = meta.nonce, self.config.namespace_bytes(meta.nonce)
        for req_id in meta.forget:
            self._cold.pop(req_id, None)
        for dump in meta.dumps:
            self._dump(dump)
        for rel in meta.releases:
            self._cold[rel.request_id] = _ColdRequest(rel.first, rel.last, rel.scratch)

    def _dump(self, dump: ColdDump) -> None:
        pages = [
            (cold_block_key(self._nonce, dump.request_id, layer, logical), cache[physical])
            for layer, cache in self.caches.items()
            for logical, physical in zip(dump.logical, dump.physical, strict=True)
        ]
        for start in range(0, len(pages), STAGING_BLOCKS):
            batch = pages[start : start + STAGING_BLOCKS]
            for slot, (_, page) in enumerate(batch):
                self._page(slot).copy_(page)
            self._run("dump", [key for key, _ in batch])
        self.stats["dumped_pages"] += len(pages)

    # ------------------------------------------------------------ per layer, inside attention
    def is_cold(self, request_id: str) -> bool:
        return request_id in self._cold

    def resolve_rows(
        self, layer_idx: int, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Physical blocks per row's selection; every row's cold blocks are loaded in one task first."""
        out = [physical[logical] for _, logical, physical in rows]
        loads: list[tuple[str, int, int]] = []  # (request, logical block, scratch block)
        placed: list[tuple[int, int, int]] = []  # (row, position in the selection, scratch block)
        for row, (request_id, logical, _) in enumerate(rows):
            req = self._cold.get(request_id)
            if req is None:
                continue
            wanted = [(i, b) for i, b in enumerate(logical.tolist()) if req.first <= b < req.last]
            if len(wanted) > len(req.scratch):
                raise SparseInputError(
                    f"request {request_id} layer {layer_idx} selected {len(wanted)} cold blocks, "
                    f"but it has {len(req.scratch)} scratch blocks"
                )
            held = req.held.setdefault(layer_idx, {})
            where = {b: slot for slot, b in held.items()}
            chosen = {b for _, b in wanted}
            free = iter(s for s in range(len(req.scratch)) if held.get(s) not in chosen)
            need = sorted(chosen - set(where))
            for b in need:
                slot = next(free)
                held[slot], where[b] = b, slot
                loads.append((request_id, b, req.scratch[slot]))
            self.stats["loaded_pages"] += len(need)
            self.stats["reused_pages"] += len(wanted) - len(need)
            placed.extend((row, i, req.scratch[where[b]]) for i, b in wanted)
        self._load(layer_idx, loads)
        for row, i, scratch in placed:
            out[row][i] = scratch
        return out

    def _load(self, layer_idx: int, loads: list[tuple[str, int, int]]) -> None:
        cache = self.caches[layer_idx]
        for start in range(0, len(loads), STAGING_BLOCKS):
            batch = loads[start : start + STAGING_BLOCKS]
            self._run("load", [cold_block_key(self._nonce, req, layer_idx, b) for req, b, _ in batch])
            for slot, (_, _, scratch) in enumerate(batch):
                cache[scratch].copy_(self._page(slot))

    # ------------------------------------------------------------ plumbing
    def _page(self, slot: int) -> torch.Tensor:
        raw = self._view[slot * self.page_bytes : (slot + 1) * self.page_bytes]
        return raw.view(self.dtype).view(self.page_shape)

    def _run(self, op: str, keys: Iterable[bytes]) -> None:
        """One dump or load task over the first staging slots; any block not OK fails the step.

        A cold block that cannot be written or read back would make attention silently differ from
        the sparse result it replaces, so it is an error naming the block count and the reasons.
        """
        ios = [
            BlockIO(key, (Segment(self._region, slot * self.page_bytes, self.page_bytes),))
            for slot, key in enumerate(keys)
        ]
        submit = self.client.dump if op == "dump" else self.client.load
        start = time.perf_counter()
        result = self.client.wait(submit(self._namespace, ios), self.config.timeout_s)
        self.seconds[op] = self.seconds.get(op, 0.0) + time.perf_counter() - start
        self.stats[f"{op}_tasks"] += 1
        if not result.ok:
            bad = [i for i, s in enumerate(result.states) if s is not BlockState.OK]
            raise RuntimeError(
                f"cold KV {op} of {len(ios)} blocks failed for {len(bad)} of them (done={result.done}): "
                f"{result.reasons or [result.states[i].name for i in bad]}"
            )

    def close(self) -> None:
        self.client.unregister(self._region)
        del self._view
        self._buffer.close()
        self.client.close()
