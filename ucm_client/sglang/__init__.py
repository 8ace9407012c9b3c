"""SGLang integration: ``UcmHiCacheStorage`` (``ucm_client.sglang.backend``), SGLang's HiCache L3
storage backend, loaded by SGLang by module path (``--hicache-storage-backend dynamic``).

Nothing is imported here, so ``import ucm_client.sglang`` never pulls in SGLang or torch.
"""
