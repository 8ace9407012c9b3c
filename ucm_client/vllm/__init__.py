"""vLLM integration: ``UCMConnector`` (``ucm_client.vllm.connector``), loaded by vLLM by module path.

Nothing is imported here, so ``import ucm_client`` never pulls in vLLM or torch.
"""
