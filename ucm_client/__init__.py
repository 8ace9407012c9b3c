"""UCM's client library: talk to ``ucm-server`` from Python (blocking or asyncio).

from ucm_client import UcmClient, SharedBuffer, BlockIO, Segment, namespace_id

with UcmClient() as client, SharedBuffer(64 << 20) as buf:
    region = client.register(buf)
    ns = namespace_id(model="my-model", dtype="float16")
    task = client.dump(ns, [BlockIO(key, (Segment(region, 0, 1 << 20),))])
    assert client.wait(task, timeout_s=10).ok
"""

from ucm_client.buffers import SharedBuffer, SharedMemoryError
from ucm_client.client import AsyncUcmClient
from ucm_client.sync import UcmClient
from ucm_client.types import BlockIO, BlockState, LookupResult, Segment, TaskResult, key_digest, namespace_id

__all__ = [
    "AsyncUcmClient",
    "BlockIO",
    "BlockState",
    "LookupResult",
    "Segment",
    "SharedBuffer",
    "SharedMemoryError",
    "TaskResult",
    "UcmClient",
    "key_digest",
    "namespace_id",
]
