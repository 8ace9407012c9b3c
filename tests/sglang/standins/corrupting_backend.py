"""Test double for the serving test's negative control: UCM's backend, but every page it reads is
overwritten with zeros after the daemon copied it in. If the served output still matched, the test's
equality would prove nothing; with this backend it must differ."""

from __future__ import annotations

from typing import Any

from ucm_client.sglang.backend import UcmHiCacheStorage


class CorruptingUcmStorage(UcmHiCacheStorage):
    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        ok = super().batch_get_v1(keys, host_indices, extra_info)
        assert self.pages is not None and self._pool_bytes is not None
        offsets, lengths = self.pages.ranges(self.pages.page_starts(host_indices, len(keys)))
        for row in offsets.tolist():
            for start, length in zip(row, lengths.tolist(), strict=True):
                self._pool_bytes[start : start + length] = 0
        return ok
