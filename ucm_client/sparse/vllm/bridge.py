"""The scheduler half of sparse attention in vLLM: request-level hooks and the per-step metadata.

vLLM's scheduler knows which request owns which KV blocks; the attention backend sees only rows of
block ids. With prefix caching on, requests that share a prefix share their first blocks, so a
worker cannot tell them apart by any block of the shared part. This bridge runs the method's
scheduler hooks (``request_begin``, ``build_sparse_meta``, ``request_finished_in_scheduler``) from
vLLM's ``SchedulerOutput`` and adds, per scheduled request, the physical block its last token is
written to this step: that block is exclusively the request's, so the worker maps each batch row to
its request id exactly. The result travels as :class:`~ucm_client.sparse.base.SparseMeta` inside the
connector metadata (:mod:`ucm_client.sparse.vllm.connector`).

Nothing here imports vLLM; ``SchedulerOutput`` is read by attribute, as vLLM 0.32 and 0.33 define it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ucm_client.sparse.base import SparseMeta, UcmSparseBase, UcmSparseRole
from ucm_client.sparse.errors import SparseInputError

__all__ = ["ScheduledRequest", "SparseSchedulerBridge"]


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """What ``build_sparse_meta`` reads about one scheduled request (the ``SparseRequest`` protocol)."""

    request_id: str
    num_tokens: int
    """Tokens in the KV cache once this step ran (computed before + scheduled now)."""


class SparseSchedulerBridge:
    """Tracks each request's blocks from ``SchedulerOutput`` and builds the step's ``SparseMeta``."""

    def __init__(self, method: UcmSparseBase, block_size: int) -> None:
        if method.role is not UcmSparseRole.SCHEDULER:
            raise SparseInputError(f"the scheduler bridge needs a SCHEDULER instance, got {method.role.name}")
        if block_size < 1:
            raise SparseInputError(f"block_size must be >= 1, got {block_size}")
        self.method = method
        self.block_size = block_size
        self._blocks: dict[str, list[int]] = {}
        self._prompts: dict[str, list[int]] = {}
        """Prompt of each tracked request, to begin it again when vLLM resumes it after preemption."""
        self.trace: Counter[str] = Counter()
        """Hook calls, by hook name (what the tests read)."""

    def build(self, scheduler_output: Any) -> SparseMeta:
        """The step's metadata; call once per ``build_connector_meta``."""
        finished = frozenset(getattr(scheduler_output, "finished_req_ids", ()) or ())
        for req_id in finished:
            self.finish(req_id)
        computed: dict[str, int] = {}
        for new in scheduler_output.scheduled_new_reqs:
            self._prompts[new.req_id] = list(new.prompt_token_ids or ())
            self.method.request_begin(new.req_id, self._prompts[new.req_id])
            self.trace["request_begin"] += 1
            self._blocks[new.req_id] = list(new.block_ids[0]) if new.block_ids else []
            computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
        restarted: set[str] = set()
        for i, req_id in enumerate(cached.req_ids):
            groups = cached.new_block_ids[i]
            new_ids = list(groups[0]) if groups else []
            if req_id in resumed or req_id not in self._blocks:
                self._blocks[req_id] = new_ids  # a resumed request's list replaces the old one
                if req_id in resumed and req_id in self._prompts:
                    # Preempted, now recomputed from scratch: its sparse state starts over on both
                    # sides (retrieval steps counted from here, features of the new KV), exactly as
                    # for a request that never was preempted.
                    self.method.request_finished_in_scheduler(req_id)
                    self.method.request_begin(req_id, self._prompts[req_id])
                    self.trace["request_restarted"] += 1
                    restarted.add(req_id)
            else:
                self._blocks[req_id].extend(new_ids)
            computed[req_id] = cached.num_computed_tokens[i]
        scheduled: list[ScheduledRequest] = []
        write_blocks: dict[int, str] = {}
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            if req_id not in computed:
                continue
            total = computed[req_id] + int(num_new)
            scheduled.append(ScheduledRequest(req_id, total))
            blocks = self._blocks.get(req_id, [])
            last = (total - 1) // self.block_size
            if total > 0 and last < len(blocks):
                write_blocks[blocks[last]] = req_id
        meta = self.method.build_sparse_meta(scheduler_output, scheduled, {})
        self.trace["build_sparse_meta"] += 1
        return dataclasses.replace(meta, write_blocks=write_blocks, finished=finished | restarted)

    def finish(self, request_id: str) -> None:
        """The request left the scheduler (finished or aborted); idempotent."""
        self._prompts.pop(request_id, None)
        if self._blocks.pop(request_id, None) is not None:
            self.method.request_finished_in_scheduler(request_id)
            self.trace["request_finished_in_scheduler"] += 1

    def tracked(self) -> Sequence[str]:
        return sorted(self._blocks)
