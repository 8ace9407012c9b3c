"""``layer_key``'s old address, which the vLLM tests still import it from.

It lives in :mod:`ucm_client.vllm.identity`; once those tests import it from there, this module goes.
"""

from __future__ import annotations

from ucm_client.vllm.identity import layer_key

__all__ = ["layer_key"]
