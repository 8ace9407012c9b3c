"""The P/D proxy example's two request rewrites (examples/pd_proxy.py): the prefill gets one token
and the do_remote_decode note, the decode gets the client's request plus the prefill's params."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from pd_proxy import decode_request, prefill_request


def test_prefill_request_is_one_token_and_marked_for_remote_decode() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64, "stream": True, "stream_options": {}}
    out = prefill_request(body)
    assert out["max_tokens"] == 1 and out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 64  # the client's request is left as it was


def test_decode_request_carries_the_prefills_params_or_none() -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 64}
    params = {"do_remote_prefill": True, "ucm_blocks": 3}
    assert decode_request(body, {"kv_transfer_params": params})["kv_transfer_params"] == params
    assert "kv_transfer_params" not in decode_request(body, {})  # failed prefill: decode computes
    assert decode_request(body, {"kv_transfer_params": params})["max_tokens"] == 64
