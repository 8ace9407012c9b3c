"""The KV codec (fp8 e4m3, power-of-two scale per group) and its wrapper tier over Posix.

The conformance suite runs over the wrapper in its decoding-only form (the suite compares bytes
exactly, and the codec is lossy); the encoding form is checked here on KV-like data: within the
documented bound, sizes invertible, blocks the codec cannot take stored raw and exact.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from ucm_server.store import codec
from ucm_server.store.base import Tier
from ucm_server.store.compressed import CompressedTier
from ucm_server.store.posix import PosixTier
from ucm_server.testing.tier_suite import TierSuite, key


class TestDecodingOnlyPosixConformance(TierSuite):
    async def make_tier(self, path: Path) -> Tier:
        return CompressedTier(PosixTier(roots=[path / "blocks"], durable=False), None)


def _bits(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "float16":
        return np.clip(x, -6e4, 6e4).astype(np.float16).tobytes()
    f = x.astype(np.float32).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16).tobytes()


def _float(data: bytes, dtype: str) -> np.ndarray:
    if dtype == "float16":
        return np.frombuffer(data, np.float16).astype(np.float64)
    return (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


CASES = {
    "normal": lambda rng, n: rng.standard_normal(n),
    "range per head": lambda rng, n: (
        rng.standard_normal(n) * np.repeat(np.exp(rng.uniform(-3, 3, n)), 64)[:n]
    ),
    "outlier channels": lambda rng, n: np.where(np.arange(n) % 128 < 4, 100.0, 1.0) * rng.standard_normal(n),
    "zeros and tiny": lambda rng, n: np.where(rng.random(n) < 0.5, 0.0, 1e-30 * rng.standard_normal(n)),
}
TOO_WIDE = {  # more than e4m3's 2**17 within a group: stored raw rather than flushed to zeros
    "wide range": lambda rng, n: rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n)),
    "rare huge outliers": lambda rng, n: np.where(rng.random(n) < 0.001, 3e4, 1.0) * rng.standard_normal(n),
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_within_the_documented_bound(dtype: str, case: str) -> None:
    rng = np.random.default_rng(7)
    data = _bits(CASES[case](rng, 40_000 + 64), dtype)  # not a whole number of groups
    encoded = codec.encode(data, dtype)
    assert encoded is not None and len(encoded) == codec.encoded_size(len(data))
    assert codec.original_size(len(encoded)) == len(data)
    out = bytearray(len(data))
    assert codec.decode_into(encoded, memoryview(out)).original_len == len(data)
    x, y = _float(data, dtype), _float(bytes(out), dtype)
    err = np.abs(y - x)
    bound = codec.error_bound(x, dtype)
    assert np.all(err <= bound), f"{(err > bound).sum()} elements past the bound"
    assert np.all(np.signbit(y[x != 0]) == np.signbit(x[x != 0])) and np.all(y[x == 0] == 0)
    assert np.any(err > 0) or not np.any(x), "lossy: an exact copy means nothing was encoded"
    if case == "normal":  # the bound means something: fp8 keeps 3 mantissa bits, ~2**-6 typical
        assert np.median(err / np.abs(x)) < 2**-5


@pytest.mark.parametrize("case", list(TOO_WIDE))
def test_values_wider_than_e4m3_holds_are_left_raw(case: str) -> None:
    data = _bits(TOO_WIDE[case](np.random.default_rng(7), 40_064), "bfloat16")
    assert codec.encode(data, "bfloat16") is None


def test_encoding_matches_ml_dtypes_rounding() -> None:
    """An independent reference (JAX's fp8 types; a test dependency only, too slow for the daemon)."""
    import ml_dtypes

    vals = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    finite = np.isfinite(vals) & (np.abs(vals) <= 448)
    ours = codec._encode_table(codec.DTYPES["bfloat16"], 0)[finite]
    theirs = vals[finite].astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(ours, theirs)


def test_sizes_are_invertible_and_never_those_of_a_raw_kv_block() -> None:
    for n in [
        *range(128, 1 << 21, 128 * 97),
        *range((1 << 30) - 128 * 5000, (1 << 30) + 128 * 5000, 128 * 7),
    ]:
        s = codec.encoded_size(n)
        assert s is not None and s % 64 == codec.SIZE_RESIDUE and codec.original_size(s) == n
        assert codec.original_size(n) is None  # a raw KV block (a multiple of 64) is never taken for encoded
    assert codec.encoded_size(100) is None and codec.encoded_size(130) is None
    hits = [s for s in range(codec.HEAD_BYTES, 1 << 20) if codec.original_size(s) is not None]
    assert all(codec.encoded_size(codec.original_size(s) or 0) == s for s in hits)  # no false inverse
    assert len(hits) == len({codec.original_size(s) for s in hits})
    assert BLOCK_RATIO >= 1.9


BLOCK_RATIO = 2 * 1024 * 1024 / (codec.encoded_size(2 * 1024 * 1024) or 1)


@pytest.mark.parametrize("special", [np.inf, np.nan])
def test_blocks_the_codec_cannot_take_are_left_raw(special: float) -> None:
    x = np.ones(4096)
    x[17] = special
    assert codec.encode(_bits(x, "bfloat16"), "bfloat16") is None
    assert codec.encode(b"\x00" * 1000, "bfloat16") is None  # not a multiple of 128 bytes


def test_float32_bytes_declared_as_bfloat16_are_left_raw() -> None:
    """The operator's dtype is wrong (vLLM on CPU keeps a float32 KV cache): encoding would ruin
    the values, so the block is stored raw; the same values as bf16 are encoded (the control)."""
    x = np.random.default_rng(3).standard_normal(8192)
    x[np.abs(x) > 3] = 0.5  # no element whose low half happens to look like inf/NaN decides it
    f32 = x.astype(np.float32).view(np.uint32)
    f32[(f32 & 0x7F80) == 0x7F80] ^= 0x0080  # nor any low half with an all-ones exponent
    assert codec.encode(f32.tobytes(), "bfloat16") is None
    assert codec.encode(_bits(x, "bfloat16"), "bfloat16") is not None


def test_a_damaged_head_or_body_is_refused() -> None:
    data = _bits(np.random.default_rng(1).standard_normal(8192), "bfloat16")
    encoded = bytearray(codec.encode(data, "bfloat16") or b"")
    out = memoryview(bytearray(len(data)))
    for where, words in ((12, "CRC"), (len(encoded) - 1, "checksum"), (codec.HEAD_BYTES, "checksum")):
        bad = bytearray(encoded)
        bad[where] ^= 1
        with pytest.raises(codec.CodecError, match=words):
            codec.decode_into(bytes(bad), out)
    with pytest.raises(codec.CodecError, match="length mismatch"):
        codec.decode_into(bytes(encoded), memoryview(bytearray(len(data) - 128)))
    codec.decode_into(bytes(encoded), out)  # negative control: the intact block decodes


def test_the_wrapper_stores_encoded_blocks_and_refuses_raw_ones_of_an_encoded_size(tmp_path: Path) -> None:
    async def main() -> None:
        posix = PosixTier(roots=[tmp_path], durable=False)
        tier = CompressedTier(posix, "bfloat16")
        await tier.open()
        data = _bits(np.random.default_rng(2).standard_normal(32768), "bfloat16")
        assert (await tier.write_from(key(1), [memoryview(data[:1000]), memoryview(data[1000:])])).ok
        assert await tier.lookup([key(1)]) == [len(data)]
        assert await posix.lookup([key(1)]) == [codec.encoded_size(len(data))]
        out = bytearray(len(data))
        assert (await tier.read_into(key(1), [memoryview(out)[:5], memoryview(out)[5:]])).ok
        assert np.all(
            np.abs(_float(bytes(out), "bfloat16") - _float(data, "bfloat16"))
            <= codec.error_bound(_float(data, "bfloat16"))
        )
        stored = codec.encode(data, "bfloat16") or b""
        crafted = bytes(stored)  # raw bytes that are an encoded block: refused, never stored raw
        decoding = CompressedTier(posix, None)
        result = await decoding.write_from(key(2), [memoryview(crafted)])
        assert not result.ok and "is reserved for encoded blocks" in result.reason
        assert await posix.lookup([key(2)]) == [None]
        await tier.close()

    asyncio.run(main())
