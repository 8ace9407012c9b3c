"""A minimal prefill/decode proxy for two vLLM OpenAI servers that share one ``ucm-server``.

    vllm serve MODEL --port 8100 --kv-transfer-config '{"kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm_client.vllm.connector", "kv_role": "kv_producer"}'
    vllm serve MODEL --port 8200 --kv-transfer-config '{"kv_connector": "UCMConnector",
        "kv_connector_module_path": "ucm_client.vllm.connector", "kv_role": "kv_consumer"}'
    python examples/pd_proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each ``/v1/completions`` or ``/v1/chat/completions`` request is sent to the prefill server first
with ``max_tokens=1`` and ``kv_transfer_params: {"do_remote_decode": true}`` (the prefill stores the
prompt's KV in the daemon and answers with ``kv_transfer_params`` saying how many blocks it stores),
then, unchanged but for those ``kv_transfer_params``, to the decode server, whose answer is returned.
The decode server loads the blocks from the daemon (waiting until the prefill's saves are visible)
and generates. No KV moves between the two vLLMs. Streaming is passed through from the decode
server. Standard library only; one thread per request.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

PATHS = ("/v1/completions", "/v1/chat/completions")


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill server's request: one token, and a note that a decode server continues it."""
    out = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    out.pop("max_completion_tokens", None)
    out.pop("stream_options", None)
    return out


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode server's request: the client's own, with the prefill's ``kv_transfer_params``
    (none: the prefill stored nothing it could say, and the decode side computes on its own)."""
    params = prefill_response.get("kv_transfer_params")
    return dict(body, kv_transfer_params=params) if params else dict(body)


def _post(url: str, body: dict[str, Any], timeout_s: float) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout_s)


class Proxy(BaseHTTPRequestHandler):
    prefill = "http://127.0.0.1:8100"
    decode = "http://127.0.0.1:8200"
    timeout_s = 600.0

    def do_POST(self) -> None:
        if self.path not in PATHS:
            self.send_error(404, f"only {', '.join(PATHS)}")
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        try:
            with _post(self.prefill + self.path, prefill_request(body), self.timeout_s) as resp:
                first = json.loads(resp.read())
        except OSError:
            first = {}  # a failed prefill: the decode server computes the prompt itself
        with _post(self.decode + self.path, decode_request(body, first), self.timeout_s) as resp:
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.headers.get("Content-Type", "application/json"))
            self.end_headers()
            while chunk := resp.read(1 << 16):
                self.wfile.write(chunk)
                self.wfile.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefill", default=Proxy.prefill)
    p.add_argument("--decode", default=Proxy.decode)
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args()
    Proxy.prefill, Proxy.decode = args.prefill.rstrip("/"), args.decode.rstrip("/")
    ThreadingHTTPServer(("127.0.0.1", args.port), Proxy).serve_forever()


if __name__ == "__main__":
    main()
