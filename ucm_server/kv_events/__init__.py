"""KV events: what every tier holds, published in vLLM's own wire format for KV-aware routers.

:mod:`.wire` encodes vLLM's ``KVEventBatch`` without importing vLLM, :mod:`.ledger` turns the
tiers' index changes into ``BlockStored`` / ``BlockRemoved`` per medium, :mod:`.publisher` sends
them over ZeroMQ PUB with sequence numbers and answers replay requests with a snapshot.
"""
