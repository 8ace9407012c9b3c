"""The encryption-at-rest wrapper passes the conformance suite over a Posix tier (every block sealed
with one tenant key), and what it stores holds no plaintext."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from ucm_server.store.base import Tier
from ucm_server.store.encrypted import MAGIC, OVERHEAD, EncryptedTier, TenantKey
from ucm_server.store.format import HEADER_SIZE, decode_header
from ucm_server.store.posix import PosixTier
from ucm_server.testing.tier_suite import TierSuite, key, payload

KEY = TenantKey.from_bytes(os.urandom(32))


class OneKey:
    def key_for(self, namespace: bytes) -> TenantKey | None:
        return KEY


class TestEncryptedPosixConformance(TierSuite):
    stored_overhead = OVERHEAD  # its stats are the disk's: envelopes included

    async def make_tier(self, path: Path) -> Tier:
        return EncryptedTier(PosixTier(roots=[path / "blocks"], durable=False), OneKey())


def test_the_stored_file_is_an_envelope_with_no_plaintext(tmp_path: Path) -> None:
    async def main() -> None:
        posix = PosixTier(roots=[tmp_path], durable=False)
        tier = EncryptedTier(posix, OneKey())
        await tier.open()
        data = payload(1, 8192)
        assert (await tier.write_from(key(1), [memoryview(data)])).ok
        assert await tier.lookup([key(1)]) == [8192]  # the plaintext's size
        assert await posix.lookup([key(1)]) == [8192 + OVERHEAD]
        raw = posix.path_of(key(1)).read_bytes()
        header = decode_header(raw[:HEADER_SIZE])
        stored = raw[header.header_len :]
        assert stored.startswith(MAGIC) and data[:64] not in stored
        await tier.close()

    asyncio.run(main())
