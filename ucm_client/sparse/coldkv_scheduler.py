"""The public path of ``ColdKVScheduler`` (what ``scheduler_cls`` names); the scheduler half of cold KV
is :mod:`ucm_client.sparse.coldkv.scheduler`."""

from ucm_client.sparse.coldkv.scheduler import ColdKVPlanner, ColdKVScheduler

__all__ = ["ColdKVPlanner", "ColdKVScheduler"]
