"""Cold KV: a long sparse request's unselected blocks live in ``ucm-server``, not in vLLM's pool.

``orders`` holds what the scheduler and the workers agree on (settings, per-step orders, keys),
``scheduler`` the scheduler half (vLLM's scheduler, subclassed; its public path for ``scheduler_cls``
is ``ucm_client.sparse.coldkv_scheduler.ColdKVScheduler``), ``worker`` the worker half.
"""
