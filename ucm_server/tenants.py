"""Per-tenant byte quotas, each tenant evicting its own least-recently-used blocks.

The ledger knows which (private) namespace belongs to which tenant — persisted in
``<data_dir>/tenants.json`` so usage can be rebuilt from the persistent tiers after a restart — and
how many bytes each tenant keeps. A dump that takes a tenant over its quota evicts that tenant's
oldest blocks, never another tenant's.
"""

from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict
from pathlib import Path

from ucm_server.keys import BlockKey

log = logging.getLogger(__name__)


class TenantLedger:
    def __init__(self, path: Path, quotas: dict[str, int]) -> None:
        self.path = path
        self.quotas = quotas
        self._owner: dict[bytes, str] = {}
        self._blocks: dict[str, OrderedDict[BlockKey, int]] = {}
        self._bytes: dict[str, int] = {}
        if path.exists():
            raw = json.loads(path.read_text())
            self._owner = {bytes.fromhex(ns): tenant for ns, tenant in raw.get("namespaces", {}).items()}

    def usage(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def claim(self, tenant: str, namespace: bytes) -> None:
        """Remember that ``namespace`` is ``tenant``'s (persisted on first sight)."""
        if not tenant or self._owner.get(namespace) == tenant:
            return
        self._owner[namespace] = tenant
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"namespaces": {ns.hex(): t for ns, t in self._owner.items()}}))
        os.replace(tmp, self.path)

    def owner(self, key: BlockKey) -> str | None:
        return self._owner.get(key.namespace)

    def stored(self, key: BlockKey, size: int) -> list[BlockKey]:
        """Account a stored block; returns the owner's blocks to evict to get back under quota."""
        tenant = self.owner(key)
        if tenant is None:
            return []
        blocks = self._blocks.setdefault(tenant, OrderedDict())
        old = blocks.pop(key, None)
        blocks[key] = size
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size - (old or 0)
        quota = self.quotas.get(tenant, 0)
        victims: list[BlockKey] = []
        if quota:
            for victim, vsize in list(blocks.items()):
                if self._bytes[tenant] <= quota or victim == key:
                    break
                victims.append(victim)
                del blocks[victim]
                self._bytes[tenant] -= vsize
        return victims

    def touched(self, keys: list[BlockKey]) -> None:
        for key in keys:
            tenant = self.owner(key)
            blocks = self._blocks.get(tenant) if tenant else None
            if blocks is not None and key in blocks:
                blocks.move_to_end(key)

    def forgot(self, keys: list[BlockKey]) -> None:
        for key in keys:
            tenant = self.owner(key)
            blocks = self._blocks.get(tenant) if tenant else None
            if blocks is not None and (size := blocks.pop(key, None)) is not None:
                self._bytes[tenant] -= size  # type: ignore[index]
