"""Compression at rest: a wrapper tier that stores KV blocks as fp8 (:mod:`ucm_server.store.codec`).

The tiers named in ``codec_tiers`` (below the Cache: Posix, DS3FS, ...) are wrapped in
:class:`CompressedTier`. The daemon stores opaque bytes, so the operator says what the KV elements
are (``codec_dtype``: bfloat16 or float16); a block is encoded if the codec takes it, and stored raw
otherwise (a length that is not a multiple of 128, an inf or NaN element). Every stored block says
how it is encoded: an encoded one starts with the codec's head (magic, codec, dtype, original
length, checksums) and has a stored size of 36 (mod 64), which no raw KV block has, so lookups
translate sizes without reading anything.

Either way round, a block loads: one written raw (before the codec was on, or not encodable) is read
straight into the reader's memory; one written encoded is decoded wherever the tier is wrapped —
and a tier that ever held encoded blocks stays wrapped, decoding only, once ``codec_tiers`` no
longer names it (the engine remembers those tiers in ``<data_dir>/codec_tiers.json``).

Never garbage for a block: the wrapped tier's header and checksum cover the stored bytes as for any
block, and the codec's head CRC and body hash cover the encoding itself, whatever tier holds it;
a block failing either is FAILED, its destination zeroed.

The one limit: the sizes of encoded blocks (36 mod 64, from 164 bytes) are theirs. A block of such
a size that the codec cannot take is refused at write (a KV block never has one): stored raw, a
lookup would report it as the encoded block its size stands for. For the same reason, blocks of
such sizes stored before the codec was turned on do not load once it is.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor

from ucm_protocol.keys import BlockKey
from ucm_server.store import codec
from ucm_server.store.base import OK, BlockResult, IoVec, Tier, failed
from ucm_server.store.copying import copy_iov, iov_len
from ucm_server.store.transform import TransformTier


def _reserved(size: int) -> BlockResult:
    return failed(
        f"a {size}-byte block the codec cannot take: that size (36 mod 64) is reserved for encoded "
        "blocks in a tier with compression at rest"
    )


class ScratchPool:
    """Scratch buffers kept for reuse, up to ``max_bytes``: fresh memory costs a page fault per
    4 KiB on first touch (about as much as encoding it), so buffers that held one batch's encoded
    blocks hold the next one's."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if n <= len(buf) <= 2 * n:
                    return self._free.pop(i)
        return bytearray(n)

    def give(self, bufs: Iterable[bytearray]) -> None:
        with self._lock:
            held = sum(len(b) for b in self._free)
            for buf in bufs:
                if held + len(buf) <= self.max_bytes:
                    self._free.append(buf)
                    held += len(buf)


class CompressedTier(TransformTier):
    """``inner`` with blocks encoded by the codec for ``dtype`` (see the module docstring);
    ``dtype=None``: decode what is there, write raw (the codec was turned off for this tier)."""

    def __init__(self, inner: Tier, dtype: str | None, executor: Executor | None = None) -> None:
        super().__init__(inner, executor)
        self.scratch = ScratchPool()
        if dtype is not None and dtype not in codec.DTYPES:
            raise ValueError(f"codec dtype {dtype!r}: expected one of {', '.join(codec.DTYPES)}")
        self.dtype = dtype

    def reader_size(self, namespace: bytes, stored: int | None) -> int | None:
        if stored is None:
            return None
        original = codec.original_size(stored)
        return stored if original is None else original

    async def verify(self, key: BlockKey, *, quarantine: bool = True) -> BlockResult:
        """The inner tier's check of the stored object, then, for an encoded block, the codec's
        (head CRC, length, body hash): a scrub finds what a read would refuse."""
        result = await self.inner.verify(key, quarantine=quarantine)
        (stored,) = await self.inner.lookup([key])
        if not result.ok or stored is None or codec.original_size(stored) is None:
            return result
        buf = self.scratch.take(stored)
        try:
            got = await self.inner.read_into(key, [memoryview(buf)[:stored]])
            if not got.ok:
                return got

            def check() -> BlockResult:
                try:
                    codec.check(memoryview(buf)[:stored])
                except codec.CodecError as exc:
                    return failed(f"encoded block: {exc}")
                return OK

            return await self._run(check)
        finally:
            self.scratch.give([buf])

    async def write_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Encode what the codec takes (off the loop), then one batch to the inner tier."""
        dtype = self.dtype
        taken: list[bytearray] = []

        def encode_all() -> list[BlockResult | IoVec]:
            out: list[BlockResult | IoVec] = []
            for _, src in items:
                data = b"".join(src) if len(src) != 1 else src[0]
                size = codec.encoded_size(len(data)) if dtype is not None else None
                buf = self.scratch.take(size) if size is not None and dtype is not None else None
                encoded = codec.encode(data, dtype, buf) if buf is not None and dtype is not None else None
                if buf is not None:
                    taken.append(buf)
                if encoded is not None:
                    out.append([encoded])
                elif codec.original_size(len(data)) is not None:
                    out.append(_reserved(len(data)))
                else:
                    out.append(src)
            return out

        prepared = await self._run(encode_all)
        todo = [i for i, p in enumerate(prepared) if not isinstance(p, BlockResult)]
        results = [p if isinstance(p, BlockResult) else OK for p in prepared]  # OK: set below
        batch = [(items[i][0], prepared[i]) for i in todo]
        try:
            for i, r in zip(todo, await self.inner.write_many(batch), strict=True):  # type: ignore[arg-type]
                results[i] = r
        finally:
            self.scratch.give(taken)
        return results

    async def read_many(self, items: Sequence[tuple[BlockKey, IoVec]]) -> list[BlockResult]:
        """Encoded blocks (by their stored size) are read whole into scratch memory and decoded into
        ``dest``; raw ones straight into ``dest``."""
        stored = await self.inner.lookup([k for k, _ in items])
        encoded = [
            s is not None and codec.original_size(s) == iov_len(dest)
            for (_, dest), s in zip(items, stored, strict=True)
        ]
        if not any(encoded):
            return await self.inner.read_many(items)
        bufs = [
            self.scratch.take(s) if enc and s is not None else None
            for s, enc in zip(stored, encoded, strict=True)
        ]
        reads = [
            (k, [memoryview(buf)[:s]] if buf is not None and s is not None else dest)
            for (k, dest), s, buf in zip(items, stored, bufs, strict=True)
        ]
        try:
            got = await self.inner.read_many(reads)

            def decode_all() -> list[BlockResult]:
                out: list[BlockResult] = []
                for (_, dest), buf, (_, view), r in zip(items, bufs, reads, got, strict=True):
                    out.append(_decode(view[0], dest) if buf is not None and r.ok else r)
                return out

            return await self._run(decode_all)
        finally:
            self.scratch.give(b for b in bufs if b is not None)


def _decode(stored: memoryview, dest: IoVec) -> BlockResult:
    """``stored`` (an encoded block) decoded into ``dest``; FAILED with the reason, ``dest`` zeroed."""
    whole = dest[0] if len(dest) == 1 else memoryview(bytearray(iov_len(dest)))
    try:
        codec.decode_into(stored, whole)
    except codec.CodecError as exc:
        for seg in dest:
            seg[:] = bytes(seg.nbytes)
        return failed(f"encoded block: {exc}")
    if len(dest) != 1:
        copy_iov(dest, [whole])
    return OK
