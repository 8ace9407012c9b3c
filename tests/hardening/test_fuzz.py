"""Fuzzing a live daemon with malformed requests, and the configuration loader with random documents.

gRPC: hypothesis builds requests the client library never would (mismatched BlockBatch columns, huge
offsets, zero lengths, foreign or random region and task ids, odd key and namespace sizes, NaN and
infinite timeouts, random admin requests, raw bytes that are not protobuf at all) and sends them with
and without a session. Every reply must be OK or one of the precise refusals in ``ALLOWED``; every
call has a deadline, so a hang fails as DEADLINE_EXCEEDED; afterwards the daemon is healthy, logged
no internal error, and an ordinary dump/load round trip still works.

Configuration: random YAML documents (flat and ``ucm_connectors`` form, known and unknown keys, values of
every YAML type, and plain random text) must either load or raise ``ConfigError`` naming what is wrong; a few
also go through the real ``ucm-server --config`` process (exit 2 and the message on stderr).

Daemon bugs these found (now fixed) are reproduced deterministically as tests at the end of this
file; while they stand, the fuzzers count inputs that hit them (by their exact signature) instead of
failing. Case counts are printed in the terminal summary (``FUZZ_COUNTS``).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.hardening import content

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest, namespace_id
from ucm_client.handover import hand_over
from ucm_client.trust import trusted_uids
from ucm_protocol.errors import ConfigError
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.config_sources import load_config
from ucm_server.server_settings import FIELDS
from ucm_server.testing.daemon import DaemonProcess

NS = namespace_id(test="hardening-fuzz")
DEADLINE_S = 10.0
OK = grpc.StatusCode.OK
ALLOWED = {
    OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FINAL_BLOCK_STATES = {pb.BLOCK_OK, pb.BLOCK_MISSING, pb.BLOCK_FAILED, pb.BLOCK_CANCELLED}
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

FUZZ_COUNTS: Counter[str] = Counter()
"""Cases the fuzzers ran, by target; printed in the terminal summary so reports can cite them."""


class _FuzzCountReport:
    """A plugin registered by this module: prints ``FUZZ_COUNTS`` in pytest's terminal summary."""

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not FUZZ_COUNTS:
            return
        terminalreporter.section("fuzz cases run")
        for name, count in sorted(FUZZ_COUNTS.items()):
            terminalreporter.write_line(f"{count:6d}  {name}")
        total = sum(n for name, n in FUZZ_COUNTS.items() if ", of which" not in name)
        terminalreporter.write_line(f"{total:6d}  total requests and documents (sub-counts excluded)")


@pytest.fixture(scope="module", autouse=True)
def _report_fuzz_counts(request: pytest.FixtureRequest) -> None:
    manager = request.config.pluginmanager
    if not manager.has_plugin("ucm-fuzz-counts"):
        manager.register(_FuzzCountReport(), "ucm-fuzz-counts")


# Signatures of bugs found earlier (fixed; see the tests at the end): inputs hitting them are counted.
# Bytes that are not protobuf: answered UNKNOWN (INTERNAL for the streaming PutBlocks), not INVALID_ARGUMENT.
UNDECODABLE = re.compile(r"not a valid protobuf message")


@dataclass
class Live:
    """A daemon and raw stubs: session A (a region and a finished task), B (another tenant's task),
    and R (no regions: the raw-bytes fuzzer may unregister or cancel whatever it likes there)."""

    daemon: DaemonProcess
    kv: rpc.KVStoreStub
    admin: rpc.AdminStub
    channel: grpc.Channel
    md_a: tuple[tuple[str, str], ...]
    md_b: tuple[tuple[str, str], ...]
    md_r: tuple[tuple[str, str], ...]
    region: int
    region_size: int
    task_a: int
    task_b: int


def _attach(kv: rpc.KVStoreStub, name: str) -> tuple[Any, tuple[tuple[str, str], ...]]:
    stream = kv.Attach(pb.AttachRequest(client_name=name), timeout=600)
    return stream, (("ucm-session", next(stream).session_id),)


def _finished_dump(kv: rpc.KVStoreStub, md: tuple[tuple[str, str], ...], region: int) -> int:
    batch = pb.BlockBatch(
        namespace=NS, keys=[key_digest("fuzz-seed")], region_ids=[region], offsets=[0], lengths=[4096]
    )
    task = kv.Dump(pb.DumpRequest(blocks=batch), metadata=md, timeout=DEADLINE_S).task_id
    status = kv.Wait(pb.WaitRequest(task_id=task, timeout_s=5), metadata=md, timeout=DEADLINE_S)
    assert status.state == pb.TASK_DONE
    return int(task)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    workdir = tmp_path_factory.mktemp("fuzz")
    with DaemonProcess(workdir / "ucm", args=["--cache-capacity", "16MiB"]) as d:
        channel = grpc.insecure_channel(d.target)
        kv, admin = rpc.KVStoreStub(channel), rpc.AdminStub(channel)
        streams = []
        try:
            with (
                SharedBuffer(1 << 20, label="fuzz-a") as buf_a,
                SharedBuffer(1 << 16, label="fuzz-b") as buf_b,
            ):
                (sa, md_a), (sb, md_b), (sr, md_r) = (_attach(kv, n) for n in ("fuzz-a", "fuzz-b", "fuzz-r"))
                streams = [sa, sb, sr]
                tok_a = hand_over(d.socket, buf_a.fileno(), buf_a.size, trusted_uids())
                tok_b = hand_over(d.socket, buf_b.fileno(), buf_b.size, trusted_uids())
                region = kv.RegisterRegion(
                    pb.RegisterRegionRequest(memfd_token=tok_a, size=buf_a.size), metadata=md_a, timeout=5
                ).region_id
                region_b = kv.RegisterRegion(
                    pb.RegisterRegionRequest(memfd_token=tok_b, size=buf_b.size), metadata=md_b, timeout=5
                ).region_id
                yield Live(
                    daemon=d,
                    kv=kv,
                    admin=admin,
                    channel=channel,
                    md_a=md_a,
                    md_b=md_b,
                    md_r=md_r,
                    region=int(region),
                    region_size=buf_a.size,
                    task_a=_finished_dump(kv, md_a, region),
                    task_b=_finished_dump(kv, md_b, region_b),
                )
        finally:
            for s in streams:
                s.cancel()
            channel.close()


def _call(
    name: str, fn: Any, request: Any, md: Any, *, undecodable_ok: bool = False
) -> tuple[grpc.StatusCode, Any]:
    """One RPC with a deadline; the status must be an expected one. Returns (code, response)."""
    FUZZ_COUNTS[name] += 1
    try:
        return OK, fn(request, metadata=md, timeout=DEADLINE_S)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
    if undecodable_ok and UNDECODABLE.search(details):  # bytes that are not the method's message
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{name}: undecodable answered {code.name}"
        FUZZ_COUNTS[f"{name}, of which undecodable (INVALID_ARGUMENT)"] += 1
    assert code in ALLOWED, f"{name}: {code.name}: {details}"
    return code, None


# -- strategies ------------------------------------------------------------------------------------

u64 = st.one_of(st.sampled_from([0, 1, 4095, 4096, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
namespaces = st.one_of(st.just(NS), st.binary(max_size=20))
digests = st.one_of(st.binary(min_size=32, max_size=32), st.binary(max_size=40))
REAL = -1  # placeholder for the session's real region / task id, replaced at run time
region_ids = st.one_of(st.just(REAL), st.integers(0, 8), u64)
offsets = st.one_of(st.integers(0, 1 << 20), u64)
lengths = st.one_of(st.sampled_from([0, 1, 4096]), st.integers(0, 1 << 20), u64)
timeouts = st.one_of(
    st.floats(-5, 1.5), st.sampled_from([0.0, math.nan, math.inf, -math.inf, -0.0, 5e-324, 1e308])
)
tier_names = st.one_of(
    st.sampled_from(["", "Cache", "Posix", "cache", "S3", "Posix|Cache"]), st.text(max_size=12)
)
page_tokens = st.one_of(
    st.just(""),
    st.text(max_size=40),
    st.builds(lambda n, k: f"{n.hex()}/{k.hex()}", st.binary(max_size=20), st.binary(max_size=40)),
)


@st.composite
def block_batches(draw: st.DrawFn) -> dict[str, Any]:
    """BlockBatch fields (region ids may be ``REAL``); columns agree in length only now and then."""
    nkeys = draw(st.integers(0, 6))
    nseg = draw(st.integers(0, 8))
    return {
        "namespace": draw(namespaces),
        "keys": draw(st.lists(digests, min_size=nkeys, max_size=nkeys)),
        "segment_counts": draw(st.one_of(st.just([]), st.lists(st.integers(0, 4), max_size=7))),
        "region_ids": draw(st.lists(region_ids, min_size=nseg, max_size=nseg + 1)),
        "offsets": draw(st.lists(offsets, min_size=nseg, max_size=nseg)),
        "lengths": draw(st.lists(lengths, min_size=nseg, max_size=nseg + 1)),
    }


def _real(fields: dict[str, Any], region: int) -> pb.BlockBatch:
    ids = [region if r == REAL else r for r in fields["region_ids"]]
    return pb.BlockBatch(**{**fields, "region_ids": ids})


# -- gRPC fuzzers ----------------------------------------------------------------------------------


@settings(FUZZ, max_examples=1000)
@given(
    fields=block_batches(),
    kind=st.sampled_from(["Load", "Dump", "Lookup", "Delete", "Prefetch", "GetBlocks"]),
    session=st.sampled_from(["a", "b", "none"]),
    durable=st.booleans(),
)
@pytest.mark.slow
def test_fuzz_block_requests(
    live: Live, fields: dict[str, Any], kind: str, session: str, durable: bool
) -> None:
    """Random BlockBatches (and their keys/namespace alone for Lookup, Delete, Prefetch, GetBlocks):
    refused precisely, or run as a task that finishes with a final state for every block."""
    md = {"a": live.md_a, "b": live.md_b, "none": ()}[session]
    batch = _real(fields, live.region)
    kv = live.kv
    if kind in ("Load", "Dump"):
        request: Any = (
            pb.LoadRequest(blocks=batch)
            if kind == "Load"
            else pb.DumpRequest(blocks=batch, wait_durable=durable)
        )
        code, handle = _call(kind, getattr(kv, kind), request, md)
        if code != OK:
            return
        _, status = _call("Wait", kv.Wait, pb.WaitRequest(task_id=handle.task_id, timeout_s=5), md)
        assert status.state != pb.TASK_RUNNING, f"a {len(batch.keys)}-block {kind} did not finish in 5 s"
        assert len(status.block_status) == len(batch.keys)
        assert set(status.block_status) <= FINAL_BLOCK_STATES
    elif kind == "GetBlocks":
        request = pb.GetBlocksRequest(namespace=batch.namespace, keys=batch.keys)
        _call(kind, lambda r, **kw: list(kv.GetBlocks(r, **kw)), request, md)
    else:
        req_type = {"Lookup": pb.LookupRequest, "Delete": pb.DeleteRequest, "Prefetch": pb.PrefetchRequest}[
            kind
        ]
        code, resp = _call(kind, getattr(kv, kind), req_type(namespace=batch.namespace, keys=batch.keys), md)
        if code == OK and kind == "Lookup":
            assert len(resp.present) == len(batch.keys) and resp.hit_prefix <= len(batch.keys)
        if code == OK and kind == "Prefetch":
            _, status = _call("Wait", kv.Wait, pb.WaitRequest(task_id=resp.task_id, timeout_s=5), md)
            assert status.state != pb.TASK_RUNNING


@settings(FUZZ, max_examples=400)
@given(
    which=st.sampled_from(["Wait", "Check", "Cancel"]),
    task=st.one_of(st.sampled_from(["a", "b"]), u64),
    timeout=timeouts,
    cancel_on_timeout=st.booleans(),
    session=st.sampled_from(["a", "b", "none"]),
)
def test_fuzz_task_calls(
    live: Live, which: str, task: str | int, timeout: float, cancel_on_timeout: bool, session: str
) -> None:
    """Wait/Check/Cancel on own, foreign and random task ids with NaN, infinite and negative timeouts."""
    md = {"a": live.md_a, "b": live.md_b, "none": ()}[session]
    task_id = task if isinstance(task, int) else {"a": live.task_a, "b": live.task_b}[task]
    if which == "Wait":
        request: Any = pb.WaitRequest(task_id=task_id, timeout_s=timeout, cancel_on_timeout=cancel_on_timeout)
    elif which == "Check":
        request = pb.TaskHandle(task_id=task_id)
    else:
        request = pb.CancelRequest(task_id=task_id)
    code, status = _call(which, getattr(live.kv, which), request, md)
    if code == OK:
        assert status.task_id == task_id and status.state != pb.TASK_RUNNING


@settings(FUZZ, max_examples=500)
@given(
    op=st.sampled_from(["ListBlocks", "Evict", "Inspect", "Verify", "Stats", "Unregister"]),
    namespace=namespaces,
    tier=tier_names,
    number=u64,
    page_token=page_tokens,
    keys=st.lists(digests, max_size=4),
    flag=st.booleans(),
)
@pytest.mark.slow
def test_fuzz_admin_requests(
    live: Live,
    op: str,
    namespace: bytes,
    tier: str,
    number: int,
    page_token: str,
    keys: list[bytes],
    flag: bool,
) -> None:
    """Random admin requests: page sizes and tokens, Evict combinations, Inspect keys, Verify scopes."""
    admin = live.admin
    if op == "ListBlocks":
        req: Any = pb.ListBlocksRequest(
            namespace=namespace, tier=tier, page_size=number % 2**32, page_token=page_token
        )
        code, resp = _call(op, admin.ListBlocks, req, ())
        if code == OK:
            assert len(resp.blocks) <= (number % 2**32 or 100)
    elif op == "Evict":
        req = pb.EvictRequest(tier=tier, min_bytes=number, namespace=namespace, keys=keys, all=flag)
        _call(op, admin.Evict, req, ())
    elif op == "Inspect":
        _call(op, admin.Inspect, pb.InspectRequest(namespace=namespace, key=(keys or [b""])[0]), ())
    elif op == "Verify":
        req = pb.VerifyRequest(tier=tier, namespace=namespace, quarantine=flag)
        _call(op, lambda r, **kw: list(admin.Verify(r, **kw)), req, ())
    elif op == "Stats":
        _call(op, admin.Stats, pb.StatsRequest(), ())
    else:  # a random region id from the region-less session R: never another session's region
        _call(op, live.kv.UnregisterRegion, pb.UnregisterRegionRequest(region_id=number), live.md_r)


METHODS = [
    (f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming)
    for service in pb.DESCRIPTOR.services_by_name.values()
    for m in service.methods
]


@settings(FUZZ, max_examples=1000)
@given(method=st.sampled_from(METHODS), data=st.binary(max_size=200), with_session=st.booleans())
@pytest.mark.slow
def test_fuzz_raw_bytes(live: Live, method: tuple[str, bool, bool], data: bytes, with_session: bool) -> None:
    """Bytes that may not be protobuf at all, sent to every method of both services."""
    path, client_streaming, server_streaming = method
    md = live.md_r if with_session else ()
    ch = live.channel
    if client_streaming:
        call: Any = ch.stream_unary(path, request_serializer=None, response_deserializer=None)

        def send(r: bytes, **kw: Any) -> Any:
            return call(iter([r]), **kw)

        _call(path, send, data, md, undecodable_ok=True)
    elif server_streaming:
        stream_call = ch.unary_stream(path, request_serializer=None, response_deserializer=None)

        def first_items(r: bytes, **kw: Any) -> list[bytes]:
            stream = stream_call(r, **kw)
            try:  # Attach never ends (it is the session): a first message is enough
                return [next(stream)] if path.endswith("/Attach") else list(stream)
            except StopIteration:
                return []
            finally:
                stream.cancel()

        _call(path, first_items, data, md, undecodable_ok=True)
    else:
        unary = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
        _call(path, unary, data, md, undecodable_ok=True)


def test_daemon_is_healthy_and_works_after_fuzzing(live: Live) -> None:
    """Runs after the fuzzers (file order): healthy, no internal error logged, a round trip works."""
    d = live.daemon
    assert d.healthy()
    log = d.log_path.read_text(errors="replace")
    internal = set(re.findall(r"internal error in (\w+)", log))
    # PutBlocks' undecodable stream items are the known bug below; any other internal error is new.
    assert internal <= {"PutBlocks"}, log[-3000:]
    size, n = 64 << 10, 8
    keys = [key_digest("after-fuzz", i) for i in range(n)]
    with UcmClient(d.target) as c, SharedBuffer(2 * n * size) as buf:
        region = c.register(buf)
        for i, k in enumerate(keys):
            buf.buf[i * size : (i + 1) * size] = content(k, size)
        assert c.wait(
            c.dump(NS, [BlockIO(k, (Segment(region, i * size, size),)) for i, k in enumerate(keys)]), 10
        ).ok
        loaded = [BlockIO(k, (Segment(region, (n + i) * size, size),)) for i, k in enumerate(keys)]
        assert c.wait(c.load(NS, loaded), 10).ok
        assert bytes(buf.buf[n * size :]) == bytes(buf.buf[: n * size])


# -- configuration fuzzers -------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
    st.sampled_from(["64MiB", "1.5 GB", "4096", "-1", "Cache|Posix", "Posix", "Cache", "Cache|Posix|Posix",
                     "Posix|Cache", "x:y", "write-back", "write-through", "text", "json", "auto", "on", "off",
                     "DEBUG", "127.0.0.1:0", "host:99999", "yes", "0", "2001-02-30", "~/x", "[1, 2]"]),
)  # fmt: skip
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
config_keys = st.one_of(st.sampled_from(sorted(FIELDS)), st.text(max_size=10), st.integers(-3, 3))


@st.composite
def config_texts(draw: st.DrawFn) -> str:
    """A YAML document: a flat or ``ucm_connectors``-form mapping of random keys and values, or random
    text."""
    shape = draw(st.sampled_from(["flat", "flat", "seed", "text"]))
    if shape == "text":
        return draw(st.text(max_size=80))
    doc: Any = draw(st.dictionaries(config_keys, values, max_size=4))
    if shape == "seed":
        doc = {"ucm_connectors": [{"ucm_connector_name": "UcmPosix", "ucm_connector_config": doc}]}
    return yaml.safe_dump(doc)


def _check_config(path: Path, text: str) -> str | None:
    """Load ``text``; return the ConfigError message, or None if it loaded. Other exceptions fail,
    except the known bugs (counted)."""
    path.write_text(text)
    FUZZ_COUNTS["config: load_config"] += 1
    try:
        load_config(path, environ={})
    except ConfigError as exc:
        msg = str(exc)
        named = any(f in msg for f in FIELDS) or "unknown key" in msg or msg.startswith(f"config file {path}")
        assert named, f"ConfigError names no key: {msg!r} for {text!r}"
        return msg
    except Exception as exc:  # anything but ConfigError is a bug
        raise AssertionError(f"{type(exc).__name__}: {exc} for {text!r}") from exc
    return None


@settings(FUZZ, max_examples=1500)
@given(text=config_texts())
@pytest.mark.slow
def test_fuzz_config_documents(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    _check_config(tmp_path_factory.getbasetemp() / "fuzz-config.yaml", text)


@settings(FUZZ, max_examples=6)
@given(text=config_texts())
@example(text="cache_capacity: 64MiB\nstore_pipeline: Cache|Posix\n")
@example(text="cache_capacity: lots\n")
@example(text="ucm_connectors: [{ucm_connector_config: {no_such_key: 1}}]\n")
@pytest.mark.slow
def test_fuzz_config_through_the_real_process(tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    """``ucm-server --config F --print-config``: exit 2 with the reason on stderr when load_config
    refuses F, exit 0 when it accepts it (nothing is started either way)."""
    path = tmp_path_factory.getbasetemp() / "fuzz-config-process.yaml"
    msg = _check_config(path, text)
    FUZZ_COUNTS["config: ucm-server --config process"] += 1
    r = subprocess.run(
        [sys.executable, "-m", "ucm_server", "--config", str(path), "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith(("UCM_", "UNIFIED_CACHE_"))},
    )
    if msg is None:
        assert r.returncode == 0, r.stderr
    else:
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert "configuration error" in r.stderr and msg.splitlines()[0] in r.stderr


# -- the bugs the fuzzers found, as deterministic reproductions -------------------------------------


@pytest.mark.parametrize("method", ["Lookup", "PutBlocks"])
def test_undecodable_request_is_invalid_argument(live: Live, method: str) -> None:
    path = f"/ucm.v1.KVStore/{method}"
    with pytest.raises(grpc.RpcError) as info:
        if method == "PutBlocks":
            put = live.channel.stream_unary(path, request_serializer=None, response_deserializer=None)
            put(iter([b"\xff\xff\xff"]), metadata=live.md_r, timeout=DEADLINE_S)
        else:
            lookup = live.channel.unary_unary(path, request_serializer=None, response_deserializer=None)
            lookup(b"\xff\xff\xff", metadata=live.md_r, timeout=DEADLINE_S)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("document", "bug"),
    [
        ("io_threads: .inf\n", "config._coerce: int(inf) raises OverflowError"),
        ("data_dir: 2001-02-30\n", "read_yaml: PyYAML's ValueError for an impossible date escapes"),
        (
            "tier_settings: {1: {}, a: {}}\n",
            "validate: sorted() of mixed-type tier_settings keys raises TypeError",
        ),
        ("tier_settings: '{a: ['\n", "_coerce: yaml.safe_load of a tier_settings string raises YAMLError"),
    ],
)
def test_config_errors_are_config_errors(tmp_path: Path, document: str, bug: str) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text(document)
    with pytest.raises(ConfigError):
        load_config(path, environ={})


def test_empty_module_tier_is_a_configuration_error(tmp_path: Path) -> None:
    (tmp_path / "ucm.yaml").write_text("store_pipeline: ':Cls'\n")
    r = subprocess.run(
        [
            sys.executable, "-m", "ucm_server", "--config", str(tmp_path / "ucm.yaml"),
            "--socket", str(tmp_path / "s.sock"), "--data-dir", str(tmp_path / "data"),
            "--metrics-address", "off",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    assert "store_pipeline" in r.stderr
