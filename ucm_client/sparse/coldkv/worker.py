"""The worker half of cold KV: dump cold blocks, then load the selected ones into scratch blocks.

Everything here moves whole block pages (``kv_cache[block]`` of one layer), which is layout-agnostic:
the bytes that come back are the bytes that went out, whatever order vLLM's CPU backend keeps K and
V in. Dumps happen when the step's metadata is bound (before the forward; the blocks are full and
were written by earlier steps); loads happen inside the attention backend, per layer, after the
sparse method chose its blocks and before the kernel reads them. A scratch slot keeps the block it
holds across steps, so a selection ESA reuses (between retrievals) costs no load at all.

Per-layer objects in ``ucm-server`` (``cold_block_key(nonce, request, layer, block)``) are what make
that possible: each layer's selection differs, and each layer loads only its own.

A layer's selection needs that layer's query, which exists only once the layer runs, so its loads
cannot all be known a layer ahead. What can be is a guess: with ``cold_kv.prefetch`` (the default)
layer L, once its own blocks are in place, sends a load of the blocks *it* selected for layer L+1's
objects without waiting for it; the daemon copies them into a second staging area while layer L's
attention and MLP run. Layer L+1 takes the pages its selection shares with the guess from there
(a local copy) and loads only the rest. Adjacent layers of trained models attend to largely the
same blocks (the observation InfiniGen builds on); a wrong guess costs daemon bandwidth, never a
wrong byte: a page is used only for the (request, block) it was loaded for, and only if its load
ended OK.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ucm_client.mover import BlockMover, Moved
from ucm_client.sparse.base import layer_index
from ucm_client.sparse.coldkv.orders import ColdDump, ColdKVConfig, ColdKVStepMeta, cold_block_key
from ucm_client.sparse.errors import SparseInputError
from ucm_client.sync import UcmClient
from ucm_client.types import BlockState

__all__ = ["ColdKVWorker"]

_log = logging.getLogger(__name__)

STAGING_BLOCKS = 64
"""Block pages one dump or load task moves at most (the mover's slots a layer's own loads use)."""
PREFETCH_BLOCKS = 64
"""Block pages a layer's guess for the next layer holds at most (the mover's other slots)."""


@dataclass(slots=True)
class _ColdRequest:
    first: int
    last: int
    scratch: tuple[int, ...]
    held: dict[tuple[int, int | None], dict[int, int]] = field(default_factory=dict)
    """Per (layer, KV head; ``None``: every head, whole pages): scratch slot → logical block it holds."""


@dataclass(frozen=True, slots=True)
class _Target:
    """Where a loaded page goes: a scratch block, whole (``head`` None) or one KV head's page of it."""

    scratch: int
    head: int | None


@dataclass(slots=True)
class _Prefetch:
    """A load sent for the next layer while this one runs, and the mover slot each of its pages lands in."""

    layer: int
    task: concurrent.futures.Future[int]
    pages: list[tuple[str, int]]
    """(request, logical block) of ``slots[i]``."""
    slots: list[int]


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
        self.mover = BlockMover(self.page_bytes, STAGING_BLOCKS + PREFETCH_BLOCKS, label="cold-kv")
        self.mover.register(self.client)
        self._nonce = ""
        self._namespace = b""
        self._cold: dict[str, _ColdRequest] = {}
        layers = sorted(self.caches)
        self._next_layer = dict(itertools.pairwise(layers))
        self._prefetch: _Prefetch | None = None
        self._prefetching = config.prefetch
        """Turned off for good after a prefetch fails: a task that did not end may still write its pages."""
        self.stats: Counter[str] = Counter()
        """``dumped_pages``, ``loaded_pages`` (loaded on the layer's own path), ``reused_pages`` (already
        in scratch), ``prefetched_pages`` (sent a layer ahead), ``prefetch_hits`` (of those, taken by the
        layer's selection), ``dump_tasks``, ``load_tasks``, ``prefetch_tasks``, ``prefetch_failed``."""
        self.seconds: dict[str, float] = {"dump": 0.0, "load": 0.0, "prefetch_wait": 0.0}
        """Wall time spent in ``dump`` and ``load`` (copies and the daemon's task) and waiting for a
        prefetch the layer then used (near zero when it overlapped the layer before), for the benchmark."""

    # ------------------------------------------------------------ per step, before the forward
    def apply(self, meta: ColdKVStepMeta) -> None:
        """Forget, dump and take over released ranges, in that order."""
        self._drop_guess(self._take_prefetch(None)[1])  # a step that ended early may have left one in flight
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
        self._move(
            "dump",
            [key for key, _ in pages],
            fill=lambda i, slot: self.mover.copy_in([slot], [[pages[i][1]]]),
        )
        self.stats["dumped_pages"] += len(pages)

    # ------------------------------------------------------------ per layer, inside attention
    def is_cold(self, request_id: str) -> bool:
        return request_id in self._cold

    def resolve_rows(
        self, layer_idx: int, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Physical blocks per row's selection; every row's cold blocks are in scratch blocks first,
        copied from the previous layer's guess where it brought them, loaded in one task otherwise.
        Then the next layer's guess is sent.

        A selection is ``[k]`` (every KV head attends to the same blocks: whole pages move) or
        ``[kv_heads, k]`` (each head its own: a head's page of a cold block goes to the head's page of
        one of the request's scratch blocks, so each head needs no more scratch than a shared
        selection would). A block is loaded once however many heads selected it.

        The blocks the guess does not cover are sent first and the guess is waited for while the
        daemon loads them: a guess still running never delays a load the layer surely needs."""
        fetch = self._prefetch
        guessed = set(fetch.pages) if fetch is not None and fetch.layer == layer_idx else set()
        out = [physical[logical] for _, logical, physical in rows]
        wanted: dict[tuple[str, int], list[_Target]] = {}  # (request, block) → where it goes
        placed: list[tuple[int, int | None, int, int]] = []  # (row, head, position, scratch block)
        changed: list[int] = []  # rows whose selection at this layer brought in new blocks
        for row, (request_id, logical, _) in enumerate(rows):
            req = self._cold.get(request_id)
            if req is None:
                continue
            per_head = [(None, logical)] if logical.dim() == 1 else list(enumerate(logical))
            new_blocks = False
            for head, selection in per_head:
                need = self._place(req, request_id, layer_idx, head, selection, placed, row)
                for b, scratch in need:
                    wanted.setdefault((request_id, b), []).append(_Target(scratch, head))
                new_blocks = new_blocks or bool(need)
            if new_blocks:
                changed.append(row)
        loads = [(page, targets) for page, targets in wanted.items() if page not in guessed]
        from_guess = [(page, targets) for page, targets in wanted.items() if page in guessed]
        staged: dict[tuple[str, int], int] = {}
        guess_slots: list[int] = []

        def take_guess() -> None:
            nonlocal guess_slots
            got, guess_slots = self._take_prefetch(layer_idx)
            staged.update(got)

        try:
            self._load(layer_idx, loads, meanwhile=take_guess)
            if self._prefetch is not None:  # no load ran: the guess is still to be waited for
                take_guess()
            # In the guess, but its load did not end OK: the layer loads them itself.
            missed: list[tuple[tuple[str, int], list[_Target]]] = []
            for page, targets in from_guess:
                slot = staged.get(page)
                if slot is None:
                    missed.append((page, targets))
                else:
                    self._place_page(layer_idx, slot, targets)
        finally:
            self._drop_guess(guess_slots)
        self._load(layer_idx, missed)
        self.stats["prefetch_hits"] += len(from_guess) - len(missed)
        self.stats["loaded_pages"] += len(loads) + len(missed)
        for row, head, i, scratch in placed:
            if head is None:
                out[row][i] = scratch
            else:
                out[row][head, i] = scratch
        self._send_prefetch(layer_idx, [rows[row] for row in changed])
        return out

    def _place(
        self,
        req: _ColdRequest,
        request_id: str,
        layer_idx: int,
        head: int | None,
        selection: torch.Tensor,
        placed: list[tuple[int, int | None, int, int]],
        row: int,
    ) -> list[tuple[int, int]]:
        """Give each cold block of one head's ``selection`` a scratch slot (keeping the ones it holds);
        the (block, scratch block) pairs that must be brought in."""
        wanted = [(i, b) for i, b in enumerate(selection.tolist()) if req.first <= b < req.last]
        if len(wanted) > len(req.scratch):
            raise SparseInputError(
                f"request {request_id} layer {layer_idx} selected {len(wanted)} cold blocks, "
                f"but it has {len(req.scratch)} scratch blocks"
            )
        held = req.held.setdefault((layer_idx, head), {})
        where = {b: slot for slot, b in held.items()}
        chosen = {b for _, b in wanted}
        free = iter(s for s in range(len(req.scratch)) if held.get(s) not in chosen)
        need = []
        for b in sorted(chosen - set(where)):
            slot = next(free)
            held[slot], where[b] = b, slot
            need.append((b, req.scratch[slot]))
        self.stats["reused_pages"] += len(wanted) - len(need)
        placed.extend((row, head, i, req.scratch[where[b]]) for i, b in wanted)
        return need

    def _place_page(self, layer_idx: int, slot: int, targets: Sequence[_Target]) -> None:
        """Copy a loaded page from mover ``slot`` where its heads want it: whole, or one head's page."""
        cache = self.caches[layer_idx]
        page = self.mover.view(slot, self.dtype, self.page_shape)
        for target in targets:
            if target.head is None:
                cache[target.scratch].copy_(page)
            else:
                cache[target.scratch, target.head].copy_(page[target.head])

    def _send_prefetch(self, layer_idx: int, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        """Send a load of this layer's cold selection, as the next layer's objects, without waiting.

        Only for ``rows`` whose selection changed at this layer: where it did not (ESA between
        retrievals), the next layer most likely keeps its own too, and a guess would only cost
        daemon bandwidth."""
        after = self._next_layer.get(layer_idx)
        if not self._prefetching or after is None:
            return
        pages: list[tuple[str, int]] = []
        for request_id, logical, _ in rows:
            req = self._cold.get(request_id)
            if req is None:
                continue
            there: set[int] = set()  # held by the next layer (by any of its heads: a guess, not a promise)
            for (layer, _), held in req.held.items():
                if layer == after:
                    there.update(held.values())
            blocks = sorted(set(logical.flatten().tolist()))  # a block once, however many heads chose it
            pages.extend((request_id, b) for b in blocks if req.first <= b < req.last and b not in there)
        pages = pages[:PREFETCH_BLOCKS]
        slots = self.mover.acquire(len(pages)) if pages else None
        if not slots:
            return
        keys = [cold_block_key(self._nonce, request_id, after, b) for request_id, b in pages]
        try:
            task = self.mover.submit(self.client, "load", self._namespace, keys, slots)
        except Exception:
            self.mover.release(slots)
            raise
        self._prefetch = _Prefetch(after, task, pages, slots)
        self.stats["prefetched_pages"] += len(pages)
        self.stats["prefetch_tasks"] += 1

    def _take_prefetch(self, layer_idx: int | None) -> tuple[dict[tuple[str, int], int], list[int]]:
        """The prefetch in flight, finished: the mover slot per (request, block) that arrived OK for
        ``layer_idx`` (none for another layer, or when it failed: the layer then loads them itself),
        and the slots it holds, for the caller to release once it copied what it uses.

        It is always waited for, used or not: its slots cannot be handed out while it may write them."""
        fetch, self._prefetch = self._prefetch, None
        if fetch is None:
            return {}, []
        start = time.perf_counter()
        try:
            task_id = fetch.task.result(self.config.timeout_s)
            result = self.client.wait(task_id, self.config.timeout_s, cancel_on_timeout=True)
            if not result.done:
                raise TimeoutError(f"task {task_id} did not end within {self.config.timeout_s} s")
        except Exception as exc:  # refused or timed out: only a guess, the layer's own load decides
            self.stats["prefetch_failed"] += 1
            self._prefetching = False
            _log.warning("cold KV prefetch failed (%s); layers load their own blocks from now on", exc)
            # A task that did not end may still write its slots: they are never handed out again.
            return {}, []
        finally:
            self.seconds["prefetch_wait"] += time.perf_counter() - start
        if fetch.layer != layer_idx:
            return {}, fetch.slots
        staged = {
            page: slot
            for page, slot, state in zip(fetch.pages, fetch.slots, result.states, strict=True)
            if state is BlockState.OK
        }
        return staged, fetch.slots

    def _drop_guess(self, slots: list[int]) -> None:
        self.mover.release(slots)
        slots.clear()

    def _load(
        self,
        layer_idx: int,
        loads: Sequence[tuple[tuple[str, int], list[_Target]]],
        *,
        meanwhile: Callable[[], None] | None = None,
    ) -> None:
        """Load (request, block) pages into their targets, as many per task as the mover has slots free;
        ``meanwhile`` runs while the daemon works on the first task."""
        if not loads:
            return
        keys = [cold_block_key(self._nonce, req, layer_idx, b) for (req, b), _ in loads]
        self._move(
            "load",
            keys,
            take=lambda i, slot: self._place_page(layer_idx, slot, loads[i][1]),
            meanwhile=meanwhile,
        )

    def _move(
        self,
        op: str,
        keys: list[bytes],
        *,
        fill: Callable[[int, int], None] | None = None,
        take: Callable[[int, int], None] | None = None,
        meanwhile: Callable[[], None] | None = None,
    ) -> Moved:
        """A dump or load through the mover, at most ``STAGING_BLOCKS`` blocks per task; any block not
        OK fails the step.

        A cold block that cannot be written or read back would make attention silently differ from
        the sparse result it replaces, so it is an error naming the block count and the reasons.
        """
        start = time.perf_counter()
        moved = Moved()
        for first in range(0, len(keys), STAGING_BLOCKS):
            part = self.mover.move(
                self.client,
                op,
                self._namespace,
                keys[first : first + STAGING_BLOCKS],
                timeout_s=self.config.timeout_s,
                fill=_shifted(fill, first),
                take=_shifted(take, first),
                meanwhile=meanwhile if first == 0 else None,
            )
            moved.states += part.states
            moved.reasons += part.reasons
            moved.tasks += part.tasks
        self.seconds[op] = self.seconds.get(op, 0.0) + time.perf_counter() - start
        self.stats[f"{op}_tasks"] += moved.tasks
        if not moved.ok:
            bad = moved.failed()
            raise RuntimeError(
                f"cold KV {op} of {len(keys)} blocks failed for {len(bad)} of them: "
                f"{moved.reasons or [moved.states[i].name for i in bad]}"
            )
        return moved

    def close(self) -> None:
        self._drop_guess(self._take_prefetch(None)[1])
        self.mover.unregister(self.client)
        self.mover.close()
        self.client.close()


def _shifted(call: Callable[[int, int], None] | None, by: int) -> Callable[[int, int], None] | None:
    """``call`` for a chunk that starts at index ``by`` of the whole transfer."""
    if call is None:
        return None
    return lambda i, slot: call(by + i, slot)
