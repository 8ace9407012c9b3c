"""KV blocks compressed at rest (fp8 e4m3), against real daemons.

``codec_tiers: Posix``, ``codec_dtype: bfloat16``: a KV-like block round-trips through the disk
(Cache evicted) within the codec's documented bound, its file holding half the bytes; a block the
codec cannot take (a NaN) is stored raw and loads exact. Every stored block says how it is encoded.
A damaged encoded block is never served, whether the tier's own checksum catches it or only the
codec's (the outer header rewritten to match). Blocks written with the codec off load once it is on,
and the other way round (the tier stays wrapped, decoding only). Bad settings stop start-up naming
the setting.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.blocks import NS, blocks_in

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient
from ucm_protocol.errors import InvalidArgument
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.store import codec
from ucm_server.store.format import HEADER_SIZE, decode_header, encode_header, payload_checksum
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 64 << 10
CODEC_ON = ["--codec-tiers", "Posix", "--codec-dtype", "bfloat16", "--cache-capacity", "8MiB"]
CODEC_OFF = ["--cache-capacity", "8MiB"]


def kv_block(seed: int) -> bytes:
    """bf16 values like a KV block's: normal, with a scale per 4 KiB (heads differ in range)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(BLOCK // 2) * np.repeat(np.exp(rng.uniform(-4, 4, BLOCK // 4096)), 2048)
    f = x.astype(np.float32).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def as_float(data: bytes) -> np.ndarray:
    return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def within_bound(original: bytes, decoded: bytes) -> bool:
    x, y = as_float(original), as_float(decoded)
    return bool(np.all(np.abs(y - x) <= codec.error_bound(x, "bfloat16")))


def _dump(client: UcmClient, data: bytes, first: int) -> bytes:
    with SharedBuffer(BLOCK) as buf:
        region = client.register(buf)
        buf.buf[:BLOCK] = data
        (block,) = blocks_in(region, 1, BLOCK, first=first)
        result = client.wait(client.dump(NS, [block], wait_durable=True), 30)
        assert result.ok, result
        client.unregister(region)
    return block.key


def _load(d: DaemonProcess, digest: bytes) -> tuple[bool, bytes, str]:
    """(ok, bytes, reasons) of one block loaded from below the Cache (evicted first)."""
    with grpc.insecure_channel(d.target) as channel:
        rpc.AdminStub(channel).Evict(pb.EvictRequest(tier="Cache", all=True), timeout=10)
    with UcmClient(d.target) as client, SharedBuffer(BLOCK) as buf:
        region = client.register(buf)
        buf.buf[:BLOCK] = b"\xee" * BLOCK
        result = client.wait(client.load(NS, [BlockIO(digest, (Segment(region, 0, BLOCK),))]), 30)
        data = bytes(buf.buf[:BLOCK])
        client.unregister(region)
    return result.ok, data, " ".join(result.reasons.values())


def _stored(d: DaemonProcess) -> dict[bytes, tuple[Path, bytes]]:
    """Each block file by its digest: (path, stored payload)."""
    out = {}
    for path in d.data_dir.rglob("*.blk"):
        raw = path.read_bytes()
        header = decode_header(raw[:HEADER_SIZE])
        out[bytes(header.key)[-32:]] = (path, raw[header.header_len :])
    return out


def test_blocks_round_trip_within_the_bound_in_half_the_bytes_and_say_how_they_are_encoded(
    tmp_path: Path,
) -> None:
    kv = kv_block(1)
    odd = bytearray(kv_block(2))
    odd[100:102] = b"\xc0\x7f"  # a NaN: the codec cannot take it, the block is stored raw
    with DaemonProcess(tmp_path / "ucm", args=CODEC_ON) as d, UcmClient(d.target) as client:
        a, b = _dump(client, kv, 0), _dump(client, bytes(odd), 1)
        stored = _stored(d)
        assert codec.describe(stored[a][1]) == f"fp8_e4m3 (bfloat16, {BLOCK} bytes)"
        assert codec.describe(stored[b][1]) == "raw" and stored[b][1] == bytes(odd)
        assert BLOCK / len(stored[a][1]) >= 1.9, len(stored[a][1])
        ok, data, _ = _load(d, a)
        assert ok and within_bound(kv, data)
        assert data != kv, "lossy codec: an exact copy means the block was never encoded"
        assert _load(d, b)[:2] == (True, bytes(odd))
        assert "compression at rest: Posix (fp8_e4m3, bfloat16)" in d.log()


def test_sizes_the_codec_does_not_take_are_stored_raw_except_those_of_encoded_blocks(tmp_path: Path) -> None:
    """A 1000-byte block is stored raw and loads exact; one of an encoded block's size (36 mod 64)
    is refused (write-through: the refusal reaches the writer) rather than stored as something a
    lookup would misread."""
    args = [*CODEC_ON, "--write-mode", "write-through"]
    odd_size, reserved = os.urandom(1000), os.urandom(codec.encoded_size(128) or 0)
    with DaemonProcess(tmp_path / "ucm", args=args) as d, UcmClient(d.target) as client:
        put = client.put_blocks(NS, [(b"o" * 32, odd_size), (b"r" * 32, reserved)])
        assert not put.ok and list(put.reasons) == [1] and "reserved for encoded" in put.reasons[1], put
        with grpc.insecure_channel(d.target) as channel:
            rpc.AdminStub(channel).Evict(pb.EvictRequest(tier="Cache", all=True), timeout=10)
        assert client.get_blocks(NS, [b"o" * 32, b"r" * 32]) == [odd_size, None]
        assert [p for _, p in _stored(d).values()] == [odd_size]


def test_a_damaged_encoded_block_is_never_served(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm", args=CODEC_ON) as d, UcmClient(d.target) as client:
        flipped, forged, intact = (_dump(client, kv_block(i), i) for i in range(3))
        stored = _stored(d)
        path, payload = stored[flipped]
        raw = bytearray(path.read_bytes())
        raw[len(raw) - 5] ^= 0x10  # one fp8 element: the tier's checksum catches it
        path.write_bytes(bytes(raw))
        # A forger who fixes the tier's header and checksum: only the codec's own hash is left.
        path, payload = stored[forged]
        body = bytearray(payload)
        body[-7] ^= 0x01
        old = decode_header(path.read_bytes()[:HEADER_SIZE])
        header = encode_header(
            old.key,
            len(body),
            payload_checksum([memoryview(body)]),
            old.created_ns,
            header_len=old.header_len,
        )
        path.write_bytes(header + bytes(body))
        with grpc.insecure_channel(d.target) as channel:  # a scrub finds both, without a reader
            replies = list(rpc.AdminStub(channel).Verify(pb.VerifyRequest(tier="Posix"), timeout=30))
        bad = [k for r in replies for k in r.corrupt_keys]
        assert replies[-1].corrupt == 2 and replies[-1].checked == 3, replies[-1]
        assert any(flipped.hex() in k for k in bad) and any(
            forged.hex() in k and "fails its checksum" in k for k in bad
        )
        for digest, words in ((flipped, ""), (forged, "fails its checksum")):
            ok, data, reasons = _load(d, digest)
            assert not ok, reasons
            assert set(data) <= {0, 0xEE}, "bytes of a damaged block reached the reader"
            assert words in reasons, reasons
        ok, data, _ = _load(d, intact)  # negative control: an undamaged block still loads
        assert ok and within_bound(kv_block(2), data)


@pytest.mark.slow
def test_blocks_load_whether_written_with_the_codec_or_without(tmp_path: Path) -> None:
    work = tmp_path / "ucm"
    with DaemonProcess(work, args=CODEC_OFF) as d, UcmClient(d.target) as client:
        plain = _dump(client, kv_block(0), 0)
        assert codec.describe(_stored(d)[plain][1]) == "raw"
    with DaemonProcess(work, args=CODEC_ON) as d, UcmClient(d.target) as client:
        assert _load(d, plain)[:2] == (True, kv_block(0)), "a raw block loads once the codec is on"
        encoded = _dump(client, kv_block(1), 1)
        assert codec.describe(_stored(d)[encoded][1]).startswith("fp8_e4m3")
    with DaemonProcess(work, args=CODEC_OFF) as d, UcmClient(d.target) as client:
        ok, data, reasons = _load(d, encoded)
        assert ok and within_bound(kv_block(1), data), reasons
        assert _load(d, plain)[:2] == (True, kv_block(0))
        later = _dump(client, kv_block(2), 2)
        assert codec.describe(_stored(d)[later][1]) == "raw", "the codec is off: written raw"
        assert "decoding only: Posix" in d.log()
    # Negative control: without the daemon's memory of encoded tiers, the encoded block would be
    # taken for a raw block of another size (refused): the memory is what keeps it loading.
    (work / "data" / "codec_tiers.json").unlink()
    with DaemonProcess(work, args=CODEC_OFF) as d:
        with pytest.raises(InvalidArgument, match=f"stored block is {codec.encoded_size(BLOCK)} bytes"):
            _load(d, encoded)


@pytest.mark.slow
def test_bad_codec_settings_stop_start_up_naming_the_setting(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCM_")}
    base = DaemonProcess(tmp_path / "ucm").command()
    for args, words in (
        (["--codec-tiers", "Cache"], "codec_tiers: 'Cache' is not a tier below"),
        (["--codec-tiers", "Posix", "--codec-dtype", "float32"], "codec_dtype: 'float32'"),
        (["--codec-tiers", "Posix", "--codec", "zstd"], "codec: unknown codec 'zstd'"),
    ):
        proc = subprocess.run([*base, *args], capture_output=True, text=True, timeout=60, env=env)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_compressed_then_encrypted_for_a_tenant_with_a_key(tmp_path: Path) -> None:
    """Both at rest on one tier: the codec runs outside the cipher (ciphertext does not compress),
    so the file is an AEAD envelope of half the block, and the block loads within the bound."""
    from support.tokens import tokens_file

    key_file = tmp_path / "alice.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    tokens = tokens_file(
        tmp_path / "tokens.yaml",
        [("tok-alice", "alice", {"key_file": str(key_file)}), ("tok-admin", "", {"admin": True})],
    )
    args = [*CODEC_ON, "--encrypt-tiers", "Posix", "--auth-tokens-file", str(tokens)]
    kv = kv_block(5)
    with DaemonProcess(tmp_path / "ucm", args=args) as d, UcmClient(d.target, token="tok-alice") as alice:
        digest = _dump(alice, kv, 0)
        (payload,) = [p for _, p in _stored(d).values()]
        assert payload.startswith(b"UCMAEAD1") and codec.MAGIC not in payload, "sealed after encoding"
        assert len(payload) < BLOCK * 0.51, len(payload)
        with grpc.insecure_channel(d.target) as channel:
            rpc.AdminStub(channel).Evict(
                pb.EvictRequest(tier="Cache", all=True),
                metadata=[("authorization", "Bearer tok-admin")],
                timeout=10,
            )
        with SharedBuffer(BLOCK) as buf:
            region = alice.register(buf)
            result = alice.wait(alice.load(NS, [BlockIO(digest, (Segment(region, 0, BLOCK),))]), 30)
            data = bytes(buf.buf[:BLOCK])
            alice.unregister(region)
        assert result.ok and within_bound(kv, data) and data != kv
