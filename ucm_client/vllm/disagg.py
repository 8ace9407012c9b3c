"""Prefill/decode disaggregation through the daemon: what ``kv_role`` changes in the scheduler half.

A prefill instance (``kv_role: kv_producer``) computes a prompt's KV and stores its full blocks in
``ucm-server``; a decode instance (``kv_role: kv_consumer``) on the same node (or on another node
sharing a Mooncake / S3 / 3FS tier) loads them and generates. No KV travels between the two vLLMs:
the blocks are keyed by vLLM's own block hashes, which the decode side computes for the same prompt
itself. What the decode side cannot know is *when* the prefill's saves became visible: vLLM answers
the prefill request as soon as its token is sampled, while the saves finish afterwards. So the
prefill's ``request_finished`` returns ``kv_transfer_params`` (vLLM hands them back with the output;
a proxy passes them to the decode request, as with vLLM's own P/D connectors) saying how many
blocks it stores, and the decode side's lookup answers "ask again later" (``None``) until that many
are visible, or until ``pd_wait_timeout_s`` has passed: then it takes the prefix that is there and
recomputes the rest. A prefill that failed, or stored only part of the prompt, costs time, never
correctness: a missing block is a miss, and a miss is recomputed.

Roles: ``kv_producer`` saves (and still loads what is stored: a prefix hit speeds up prefill),
``kv_consumer`` loads and never saves, ``kv_both`` (default) does both.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ucm_client.vllm.config import LOGGER_NAME

__all__ = ["PD_PARAM", "PdRole"]

logger = logging.getLogger(LOGGER_NAME)

PD_PARAM = "ucm_blocks"
"""The ``kv_transfer_params`` key with the number of prompt blocks the prefill stores."""


@dataclass(slots=True)
class PdRole:
    """The scheduler's view of its ``kv_role``, and the decode requests waiting for a prefill."""

    role: str = "kv_both"
    wait_timeout_s: float = 30.0
    block_size: int = 16
    _waiting_since: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_vllm(cls, vllm_config: Any, wait_timeout_s: float) -> PdRole:
        transfer = vllm_config.kv_transfer_config
        role = str(getattr(transfer, "kv_role", None) or "kv_both")
        return cls(role, wait_timeout_s, int(vllm_config.cache_config.block_size))

    @property
    def saves(self) -> bool:
        """A decode instance never stores: the prefill did, and its own blocks are the same."""
        return self.role != "kv_consumer"

    def finished_params(self, request: Any) -> dict[str, Any] | None:
        """A prefill's ``kv_transfer_params`` for the decode request (None for other roles)."""
        if self.role != "kv_producer":
            return None
        params = request.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return None  # a plain request on the prefill instance: nobody decodes it elsewhere
        return {"do_remote_prefill": True, PD_PARAM: request.num_prompt_tokens // self.block_size}

    def must_wait(self, request: Any, stored_blocks: int, total_blocks: int) -> bool:
        """Whether the decode request should be asked about again later: its prefill promised more
        blocks than are visible now, and the wait has not timed out."""
        params = request.kv_transfer_params or {}
        promised = params.get(PD_PARAM)
        if not params.get("do_remote_prefill") or not isinstance(promised, int):
            return False
        expected = min(promised, total_blocks)
        rid = request.request_id
        if stored_blocks >= expected:
            self._waiting_since.pop(rid, None)
            return False
        since = self._waiting_since.setdefault(rid, time.monotonic())
        if time.monotonic() - since < self.wait_timeout_s:
            return True
        self._waiting_since.pop(rid, None)
        logger.warning(
            "UCM: request %s: its prefill promised %d blocks, %d are stored after %.0fs; "
            "recomputing the rest",
            rid,
            expected,
            stored_blocks,
            self.wait_timeout_s,
        )
        return False

    def forget(self, request_id: str) -> None:
        self._waiting_since.pop(request_id, None)
