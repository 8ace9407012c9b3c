"""How the client reads a task's result off the wire (``TaskResult.from_pb``): every state as the
daemon sent it, in order, and a value no state has refused by name rather than read as another."""

from __future__ import annotations

from ucm_client.types import BlockState, TaskResult
from ucm_protocol.ucm.v1 import ucm_pb2 as pb


def test_states_arrive_in_order_as_block_states() -> None:
    sent = [int(s) for s in BlockState] * 60
    result = TaskResult.from_pb(pb.TaskStatus(task_id=7, state=pb.TASK_DONE, block_status=sent))
    assert result.states == [BlockState(v) for v in sent]
    assert all(type(s) is BlockState for s in result.states)
    assert result.done and not result.ok  # negative control: FAILED/MISSING blocks are not ok


def test_all_ok_is_ok() -> None:
    result = TaskResult.from_pb(pb.TaskStatus(task_id=1, state=pb.TASK_DONE, block_status=[2] * 256))
    assert result.ok and result.states == [BlockState.OK] * 256


def test_an_unknown_state_value_reads_as_failed_by_name() -> None:
    result = TaskResult.from_pb(pb.TaskStatus(task_id=1, state=pb.TASK_DONE, block_status=[2, 99]))
    assert result.states == [BlockState.OK, BlockState.FAILED] and not result.ok
    assert "99" in result.reasons[1]
