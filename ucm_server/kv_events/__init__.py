"""KV events: what every tier holds, published in vLLM's own wire format for KV-aware routers.

:mod:`.wire` encodes vLLM's ``KVEventBatch`` without importing vLLM, :mod:`.ledger` turns the
tiers' index changes into ``BlockStored`` / ``BlockRemoved`` per medium, :mod:`.audience` keeps one
stream per audience (who may see which tenant's namespaces), :mod:`.access` decides who reaches the
sockets and as which audience (:mod:`.zap` for CURVE keys), :mod:`.publisher` sends the streams over
ZeroMQ with sequence numbers and heartbeats and answers replay requests (:mod:`.replay`) with the
missed batches or a snapshot.
"""
