"""Sparse attention inside vLLM: the attention backend, the per-process runtime it drives, the
scheduler → worker channel, and the plugin that registers the backend.

Nothing is imported here: ``ucm_client.sparse.vllm.backend`` and ``.connector`` import vLLM, the
rest does not. The paths vLLM's configuration names stay at ``ucm_client.sparse.vllm_connector``
(``kv_connector_module_path``) and ``ucm_client.sparse.vllm_plugin`` (the entry point).
"""
