"""The scheduler bridge on hand-written scheduler outputs: which block names which request.

The records below carry the fields of vLLM 0.32's ``SchedulerOutput`` that the bridge reads; the
real engine path is covered by ``test_sparse_vllm_prefix.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.errors import SparseInputError
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.vllm.bridge import SparseSchedulerBridge

BS = 4


def _out(
    new: list[Any], cached: list[tuple[str, list[int] | None, int]], sched: dict[str, int], **kw: Any
) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[c[0] for c in cached],
            new_block_ids=[None if c[1] is None else (c[1],) for c in cached],
            num_computed_tokens=[c[2] for c in cached],
            resumed_req_ids=kw.get("resumed", set()),
        ),
        num_scheduled_tokens=sched,
        finished_req_ids=kw.get("finished", set()),
    )


def _new(req_id: str, blocks: list[int], computed: int, prompt: int) -> Any:
    return SimpleNamespace(
        req_id=req_id, prompt_token_ids=list(range(prompt)), block_ids=(blocks,), num_computed_tokens=computed
    )


def _bridge() -> SparseSchedulerBridge:
    method = UcmSparseFactory.create_sparse_method("ESA", UcmSparseRole.SCHEDULER, {"retrieval_stride": 2})
    return SparseSchedulerBridge(method, BS)


def test_shared_prefix_requests_are_told_apart_by_the_block_they_write() -> None:
    bridge = _bridge()
    # Both prompts are 10 tokens; blocks 7 and 8 (the shared prefix) are common, the third is each one's.
    meta = bridge.build(
        _out([_new("a", [7, 8, 9], 0, 10), _new("b", [7, 8, 11], 8, 10)], [], {"a": 10, "b": 2})
    )
    assert dict(meta.write_blocks) == {9: "a", 11: "b"}
    assert set(meta.requests) == {"a", "b"} and meta.requests["a"].num_tokens == 10
    # Decode: "a" fills block 9 (token 12 → block index 2), "b" crosses into a new block 12.
    meta = bridge.build(_out([], [("a", None, 11), ("b", [12], 12)], {"a": 1, "b": 1}))
    assert dict(meta.write_blocks) == {9: "a", 12: "b"}
    assert meta.requests["a"].retrieve is False  # stride 2: step 0 retrieved, step 1 reuses


def test_resumed_request_replaces_its_blocks_restarts_and_finished_ones_are_forwarded() -> None:
    bridge = _bridge()
    bridge.build(_out([_new("a", [1, 2], 0, 6)], [], {"a": 6}))
    meta = bridge.build(_out([], [("a", [5, 6], 0)], {"a": 7}, resumed={"a"}))
    assert dict(meta.write_blocks) == {6: "a"}  # not 2: the old list was replaced
    # Preempted and recomputed from scratch: its sparse state starts over on both sides (the worker
    # drops it like a finished request's; the retrieval count restarts, so step 0 retrieves again).
    assert meta.finished == frozenset({"a"}) and bridge.trace["request_restarted"] == 1
    assert meta.requests["a"].retrieve is True
    meta = bridge.build(_out([], [("a", None, 7)], {"a": 1}))
    assert meta.requests["a"].retrieve is False and meta.finished == frozenset()
    meta = bridge.build(_out([], [], {}, finished={"a"}))
    assert meta.finished == frozenset({"a"}) and not bridge.tracked()
    assert bridge.trace["request_finished_in_scheduler"] == 1
    bridge.finish("a")  # idempotent: a second report of the same finish does nothing
    assert bridge.trace["request_finished_in_scheduler"] == 1


def test_bridge_refuses_a_worker_instance() -> None:
    method = UcmSparseFactory.create_sparse_method("ESA", UcmSparseRole.WORKER, {})
    with pytest.raises(SparseInputError, match="SCHEDULER"):
        SparseSchedulerBridge(method, BS)


def test_step_meta_survives_pickling_to_a_worker_process() -> None:
    # vLLM pickles connector metadata when the workers are separate processes.
    import pickle

    meta = _bridge().build(_out([_new("a", [7, 8, 9], 0, 10)], [], {"a": 10}, finished={"z"}))
    again = pickle.loads(pickle.dumps(meta))
    assert again == meta and dict(again.write_blocks) == {9: "a"}
