"""The KV block codec: bf16/fp16 -> fp8 e4m3 with a power-of-two scale per group, in numpy.

A block compressed at rest is an *encoded block*, laid out (little endian)::

    head (36 bytes): magic "UCMCODEC" | version u8 | codec u8 | dtype u8 | 0 u8 | group u32 |
                     original length u64 | xxh3-64 of the body u64 | crc32 of the 32 bytes before u32
    body: one i16 exponent per group, zero padded to a multiple of 64 bytes | one fp8 byte per element

Every ``group`` elements (:data:`GROUP` = 16,384, 32 KiB of bf16: about one layer's K or V of a
vLLM block) share a scale ``2**k``, ``k`` chosen so the group's largest magnitude lands in e4m3's
top binade (<= 448). Scaling by a power of two is exact, so the only loss is e4m3's rounding:

    |decoded - x| <= 2**-4 * |x|   where |x| >= 2**(k-6)     (3 mantissa bits, round to nearest even)
    |decoded - x| <= 2**(k-10)     below (e4m3 subnormals), with 2**k <= group amax / 2**7

i.e. every element is within 6.25 % of itself or 2**-17 of its group's largest magnitude
(:func:`error_bound` computes it). Zeros stay zeros, signs are kept.

Why these choices: numpy has no fp8, and a cast through ``ml_dtypes`` runs at ~0.8 GB/s a core;
with power-of-two scales, encoding is one ``take`` through a 64 Ki-entry table per exponent (bf16
bits -> e4m3 bits, built once) and decoding one ``take`` through a table of byte pairs: GB/s a
core. The head makes a stored block say how it is encoded; its CRC and the body's hash make it
check itself whatever tier holds it, so a damaged encoded block is never decoded into a plausible
wrong tensor.

A block the codec cannot take is stored raw, unchanged (:func:`encode` returns ``None``): a length
that is not a multiple of :data:`ALIGN`, an element that is inf or NaN, or values spread wider than
e4m3 holds (:data:`FLUSH_LIMIT`: what bytes of another element type look like). Encoded sizes are always
``36 (mod 64)`` and invertible (:func:`original_size`), while raw KV blocks are multiples of 64
bytes: the stored size alone tells which a block is, so lookups answer without reading.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import xxhash

MAGIC = b"UCMCODEC"
VERSION = 1
CODEC_FP8_E4M3 = 1
CODECS = {"fp8_e4m3": CODEC_FP8_E4M3}
DTYPES = {"bfloat16": 1, "float16": 2}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
GROUP = 16384
"""Elements sharing one scale."""
ALIGN = 128
"""Blocks are encoded only when their length is a multiple of this (every KV block is)."""
_HEAD = struct.Struct("<8sBBBxIQQ")
HEAD_BYTES = _HEAD.size + 4
SIZE_RESIDUE = HEAD_BYTES % 64
"""Every encoded block's stored size is this modulo 64 (36); raw KV blocks are multiples of 64."""
FLUSH_LIMIT = 64
"""A block where more than 1/64 of the elements are non-zero but would decode as zero (their
group spans more than e4m3's 2**17) is stored raw: real KV never does, while bytes of another
type do (float32 KV declared as bfloat16: the low halves' exponents are noise)."""
E4M3_MAX = 448.0
_TOP_EXP = 8
"""448 = 1.75 * 2**8: the exponent a group's largest magnitude is scaled to (7 if its mantissa > 1.75)."""


class CodecError(ValueError):
    """A stored block claiming to be encoded that does not check out; the message says why."""


@dataclass(frozen=True, slots=True)
class Encoding:
    """What an encoded block's head says."""

    codec: int
    dtype: int
    group: int
    original_len: int


# -- sizes -------------------------------------------------------------------------------------------


def _exp_bytes(elements: int) -> int:
    groups = -(-elements // GROUP)
    return -(-2 * groups // 64) * 64


def encoded_size(original: int) -> int | None:
    """Stored bytes of an encoded block of ``original`` bytes (2-byte elements); ``None``: not encodable."""
    if original <= 0 or original % ALIGN:
        return None
    n = original // 2
    return HEAD_BYTES + _exp_bytes(n) + n


def original_size(stored: int) -> int | None:
    """The original length of an encoded block of ``stored`` bytes; ``None``: no encoded block has
    that size (so the block is raw). Constant time: it runs for every key of a lookup."""
    if stored % 64 != SIZE_RESIDUE or stored < HEAD_BYTES + 128:
        return None
    body = stored - HEAD_BYTES  # = n + 64 m, m = ceil(n / (32 GROUP)) (32 exponents per 64 bytes)
    guess = -(-body // (32 * GROUP + 64))
    for m in (guess - 1, guess, guess + 1):
        n = body - 64 * m
        if m >= 1 and n > 0 and encoded_size(2 * n) == stored:
            return 2 * n
    return None


# -- tables ------------------------------------------------------------------------------------------


def _e4m3_values() -> np.ndarray:
    """The 256 e4m3fn values (float64; 0x7F/0xFF are NaN)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = (b & 7).astype(np.float64)
    v = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * np.exp2(e.astype(np.float64) - 7))
    v = sign * v
    v[(b & 0x7F) == 0x7F] = np.nan
    return np.asarray(v, np.float64)


_E4M3 = _e4m3_values()
_POS = _E4M3[:127]  # 0x00..0x7E: the non-negative finite values, increasing


def _to_e4m3(x: np.ndarray) -> np.ndarray:
    """float64 -> e4m3 bits, round to nearest even, saturating at 448 (``x`` finite)."""
    mag = np.minimum(np.abs(x), E4M3_MAX)
    hi = np.clip(np.searchsorted(_POS, mag), 1, 126)
    lo = hi - 1
    dlo, dhi = mag - _POS[lo], _POS[hi] - mag
    pick = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    pick = np.where(mag >= _POS[126], 126, pick)
    pick = np.where(mag == 0, 0, pick)
    return np.asarray(pick | np.where(np.signbit(x), 0x80, 0), np.uint8)


def _decode_bits(dtype: int, bits: np.ndarray) -> np.ndarray:
    """uint16 bit patterns of ``dtype`` -> float64."""
    if dtype == DTYPES["float16"]:
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _encode_bits(dtype: int, x: np.ndarray) -> np.ndarray:
    """float64 (exactly representable, finite) -> uint16 bit patterns of ``dtype``, saturating."""
    if dtype == DTYPES["float16"]:
        return np.clip(x, -65504.0, 65504.0).astype(np.float16).view(np.uint16)
    big = float(np.float32(3.3895313892515355e38))
    f = np.clip(x, -big, big).astype(np.float32).view(np.uint32)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)


@lru_cache(maxsize=128)
def _encode_table(dtype: int, k: int) -> np.ndarray:
    """bits of ``dtype`` -> e4m3 bits of ``value / 2**k`` (64 Ki entries)."""
    with np.errstate(invalid="ignore", over="ignore"):
        x = _decode_bits(dtype, np.arange(65536, dtype=np.uint32).astype(np.uint16)) * 2.0**-k
    return _to_e4m3(np.nan_to_num(x, nan=0.0))


@lru_cache(maxsize=512)
def _decode_table(dtype: int, k: int) -> np.ndarray:
    """e4m3 bits -> bits of ``dtype`` of ``value * 2**k`` (256 entries; NaN codes decode to 0)."""
    return _encode_bits(dtype, np.nan_to_num(_E4M3, nan=0.0) * 2.0**k)


@lru_cache(maxsize=32)
def _pair_table(dtype: int, k: int) -> np.ndarray:
    """Two e4m3 bytes (one u16, little endian) -> two elements of ``dtype`` (one u32): decoding
    takes half as many lookups (256 KiB, in L2)."""
    one = _decode_table(dtype, k).astype(np.uint32)
    i = np.arange(65536, dtype=np.uint32)
    return np.asarray(one[i & 0xFF] | (one[i >> 8] << 16), np.uint32)


def _exponents(dtype: int, amax_bits: np.ndarray) -> np.ndarray:
    """``k`` per group whose largest magnitude has the bits ``amax_bits``: amax / 2**k <= 448."""
    m, e = np.frexp(_decode_bits(dtype, amax_bits))  # amax = m * 2**e, 0.5 <= m < 1
    k = e - 1 - np.where(m * 2 <= 1.75, _TOP_EXP, _TOP_EXP - 1)
    return np.where(m == 0, 0, k).astype(np.int16)


def _exponent_of(amax: float) -> int:
    if amax == 0.0:
        return 0
    m, e = np.frexp(amax)  # amax = m * 2**e, 0.5 <= m < 1
    top = _TOP_EXP if m * 2 <= 1.75 else _TOP_EXP - 1
    return int(e - 1 - top)


def error_bound(x: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """The documented per-element bound on ``|decode(encode(x)) - x|`` (``x`` float64, one group
    or a block cut in groups as :func:`encode` does): ``max(2**-4 |x|, 2**(k-10))`` plus the
    rounding of the decoded value back to ``dtype``."""
    flat = np.asarray(x, np.float64).ravel()
    out = np.empty_like(flat)
    ulp = 2.0**-8 if dtype == "bfloat16" else 2.0**-11
    for start in range(0, flat.size, GROUP):
        g = flat[start : start + GROUP]
        k = _exponent_of(float(np.abs(g).max()))
        out[start : start + GROUP] = np.maximum(2.0**-4 * np.abs(g), 2.0 ** (k - 10)) * (
            1 + ulp
        ) + ulp * np.abs(g)
    return out.reshape(np.shape(x))


# -- encode / decode ---------------------------------------------------------------------------------


def encode(data: bytes | memoryview, dtype: str, into: bytearray | None = None) -> memoryview | None:
    """The encoded block of ``data`` (elements of ``dtype``), written in ``into`` if given (at least
    :func:`encoded_size` bytes: scratch memory reused saves a page fault per 4 KiB) or in new
    memory; ``None``: store it raw (a length the codec does not take, or an inf/NaN element)."""
    code = DTYPES[dtype]
    size = encoded_size(len(data))
    if size is None:
        return None
    bits = np.frombuffer(data, np.uint16)
    n = bits.size
    mag = bits & np.uint16(0x7FFF)
    nonfinite = 0x7F80 if code == DTYPES["bfloat16"] else 0x7C00
    groups = -(-n // GROUP)
    amax = np.maximum.reduceat(mag, np.arange(0, n, GROUP))
    if int(amax.max()) >= nonfinite:
        return None
    out = memoryview(into if into is not None else bytearray(size))[:size]
    exps = _exponents(code, amax)
    exp_section = np.frombuffer(out, np.uint8, _exp_bytes(n), HEAD_BYTES)
    exp_section[:] = 0
    exp_section[: 2 * groups] = exps.view(np.uint8)
    fp8 = np.frombuffer(out, np.uint8, n, size - n)
    for g, k in enumerate(exps.tolist()):
        s = slice(g * GROUP, min(n, (g + 1) * GROUP))
        np.take(_encode_table(code, k), bits[s], out=fp8[s], mode="clip")
    lost = np.count_nonzero(mag) - np.count_nonzero(fp8 & np.uint8(0x7F))
    if lost * FLUSH_LIMIT > n:  # wider than e4m3 within groups: not KV of ``dtype`` (float32?)
        return None
    digest = xxhash.xxh3_64_intdigest(out[HEAD_BYTES:])
    _HEAD.pack_into(out, 0, MAGIC, VERSION, CODEC_FP8_E4M3, code, GROUP, len(data), digest)
    struct.pack_into("<I", out, _HEAD.size, zlib.crc32(out[: _HEAD.size]))
    return out


def read_head(stored: bytes | memoryview) -> Encoding | None:
    """What ``stored`` says of its encoding; ``None``: it does not start with the codec's magic
    (a raw block). A head with the magic that does not check out raises :class:`CodecError`."""
    if len(stored) < HEAD_BYTES or bytes(stored[:8]) != MAGIC:
        return None
    _, version, codec, dtype, group, original, _ = _HEAD.unpack_from(stored)
    (crc,) = struct.unpack_from("<I", stored, _HEAD.size)
    if crc != zlib.crc32(bytes(stored[: _HEAD.size])):
        raise CodecError("encoded block head fails its CRC")
    if version != VERSION or codec != CODEC_FP8_E4M3 or dtype not in DTYPE_NAMES or group != GROUP:
        raise CodecError(f"unknown encoding (version {version}, codec {codec}, dtype {dtype}, group {group})")
    return Encoding(codec, dtype, group, original)


def check(stored: bytes | memoryview) -> Encoding:
    """What ``stored`` (an encoded block) says of itself, once its head, length and body check
    out; :class:`CodecError` saying which does not."""
    enc = read_head(stored)
    if enc is None:
        raise CodecError("not an encoded block")
    if encoded_size(enc.original_len) != len(stored):
        raise CodecError(
            f"length mismatch: encoded block of {enc.original_len} bytes stored in {len(stored)}"
        )
    (want,) = struct.unpack_from("<Q", stored, _HEAD.size - 8)
    if xxhash.xxh3_64_intdigest(memoryview(stored)[HEAD_BYTES:]) != want:
        raise CodecError("encoded block body fails its checksum")
    return enc


def decode_into(stored: bytes | memoryview, out: memoryview) -> Encoding:
    """Check ``stored`` (an encoded block) and decode it into ``out`` (its original length);
    :class:`CodecError` saying what is wrong otherwise, ``out`` then untouched."""
    enc = read_head(stored)
    if enc is not None and enc.original_len != out.nbytes:
        raise CodecError(
            f"length mismatch: encoded block of {enc.original_len} bytes, destination {out.nbytes}"
        )
    enc = check(stored)
    body = memoryview(stored)[HEAD_BYTES:]
    n = enc.original_len // 2
    groups = -(-n // GROUP)
    exps = np.frombuffer(body, np.int16, groups)
    pairs = np.frombuffer(body, np.uint16, n // 2, _exp_bytes(n))  # n is even: ALIGN
    dst = np.frombuffer(out, np.uint32)
    half = GROUP // 2
    for g, k in enumerate(exps.tolist()):
        s = slice(g * half, min(n // 2, (g + 1) * half))
        np.take(_pair_table(enc.dtype, k), pairs[s], out=dst[s], mode="clip")
    return enc


def describe(stored: bytes | memoryview) -> str:
    """How a stored payload is encoded, for people: ``raw`` or ``fp8_e4m3 (bfloat16, 2 MiB)``."""
    try:
        enc = read_head(stored)
    except CodecError as exc:
        return f"damaged encoded block: {exc}"
    if enc is None:
        return "raw"
    return f"fp8_e4m3 ({DTYPE_NAMES[enc.dtype]}, {enc.original_len} bytes)"
