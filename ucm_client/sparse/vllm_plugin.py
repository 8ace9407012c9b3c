"""The public path of the ``vllm.general_plugins`` entry point (``ucm_client.sparse.vllm_plugin:register``);
the plugin itself is :mod:`ucm_client.sparse.vllm.plugin`."""

from ucm_client.sparse.vllm.plugin import BACKEND_PATH, SUPPORTED_VLLM, HookStatus, register, verify_patches

__all__ = ["BACKEND_PATH", "SUPPORTED_VLLM", "HookStatus", "register", "verify_patches"]
