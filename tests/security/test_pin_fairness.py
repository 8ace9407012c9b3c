"""Pins cannot lock others out: one principal pins all it can, another still stores.

A pinned block is never evicted, so a principal that pins everything takes the tiers from everyone
else. Against real daemons with a small Cache (16 blocks) and Posix tier (32 blocks), a principal
without a quota — a tenant, a token without a tenant, a local client of a daemon without tokens —
pins every block it stored, one by one, until the daemon refuses (RESOURCE_EXHAUSTED naming the
setting); another principal then stores 8 of 8 blocks and finds them, while the first one's pins
all hold. Two such principals together cannot take the tier's reserve either; a pinned block
rewritten larger is held to the same budget; and the budget survives a restart.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.blocks import NS, blocks_in
from support.tokens import tokens_file

from ucm_client import SharedBuffer, UcmClient, key_digest
from ucm_client.errors import ResourceExhausted
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 64 << 10
SMALL = ["--cache-capacity", "1MiB", "--cache-page-size", "64KiB", "--posix-capacity", "2MiB"]
"""16 blocks fit the Cache, 32 the Posix tier; a principal may pin half of a tier (8 in the Cache),
all of them together three quarters (12)."""
TOKENS = {"hog": "tok-hog", "hog2": "tok-hog2", "other": "tok-other", "": "tok-tenantless"}


def _tokens(path: Path) -> Path:
    return tokens_file(path, [(token, tenant, {}) for tenant, token in TOKENS.items()])


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[DaemonProcess]:
    args = [*SMALL, "--auth-tokens-file", str(_tokens(tmp_path / "tokens.yaml"))]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        yield d


def _store(client: UcmClient, first: int, count: int) -> list[bytes]:
    """``count`` blocks keyed ``first...``, durable (in the Posix tier too); their keys."""
    keys: list[bytes] = []
    with SharedBuffer(8 * BLOCK) as buf:
        region = client.register(buf)
        for start in range(0, count, 8):
            n = min(8, count - start)
            buf.buf[: n * BLOCK] = os.urandom(n * BLOCK)
            batch = blocks_in(region, n, BLOCK, first=first + start)
            result = client.wait(client.dump(NS, batch, wait_durable=True), 30)
            assert result.ok, result
            keys += [b.key for b in batch]
        client.unregister(region)
    return keys


def _pin_all_it_can(client: UcmClient, keys: list[bytes]) -> tuple[list[bytes], str]:
    """Pin ``keys`` one by one until refused; the keys pinned and the refusal's message."""
    pinned: list[bytes] = []
    for key in keys:
        try:
            assert client.set_retention(NS, [key], pin=True).applied == 1
        except ResourceExhausted as exc:
            return pinned, str(exc)
        pinned.append(key)
    raise AssertionError(f"all {len(keys)} blocks were pinned: nothing bounds a principal's pins")


def _still_stores(client: UcmClient, first: int) -> None:
    """8 new blocks are stored, and found."""
    keys = _store(client, first, 8)
    assert client.lookup(NS, keys).hits == 8


@pytest.mark.parametrize("hog", ["hog", ""], ids=["tenant-without-quota", "token-without-tenant"])
def test_a_principal_without_a_quota_cannot_pin_the_others_out(tenants: DaemonProcess, hog: str) -> None:
    with (
        UcmClient(tenants.target, token=TOKENS[hog]) as pinner,
        UcmClient(tenants.target, token=TOKENS["other"]) as other,
    ):
        keys = _store(pinner, 0, 32)  # fills the Posix tier
        pinned, refusal = _pin_all_it_can(pinner, keys)
        assert len(pinned) == 8, "half of the Cache, the smaller tier"
        assert "pin_share" in refusal and "Cache" in refusal
        _still_stores(other, 1000)
        assert pinner.lookup(NS, pinned).hits == 8, "a pin was not held"


def test_all_principals_together_leave_the_reserve(tenants: DaemonProcess) -> None:
    with (
        UcmClient(tenants.target, token=TOKENS["hog"]) as hog,
        UcmClient(tenants.target, token=TOKENS["hog2"]) as hog2,
        UcmClient(tenants.target, token=TOKENS["other"]) as other,
    ):
        first, _ = _pin_all_it_can(hog, _store(hog, 0, 12))
        second, refusal = _pin_all_it_can(hog2, _store(hog2, 100, 12))
        assert (len(first), len(second)) == (8, 4), "pins took more than three quarters of the Cache"
        assert "pin_reserve" in refusal
        _still_stores(other, 1000)
        assert hog.lookup(NS, first).hits == 8 and hog2.lookup(NS, second).hits == 4


def test_a_local_client_of_a_daemon_without_tokens_has_a_share_too(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "ucm", args=SMALL) as d,
        UcmClient(d.target) as one,
        UcmClient(d.target) as another,
    ):
        pinned, refusal = _pin_all_it_can(one, _store(one, 0, 32))
        assert len(pinned) == 8 and "pin_share" in refusal
        _still_stores(another, 1000)
        assert one.lookup(NS, pinned).hits == 8


def test_a_pinned_block_rewritten_larger_is_held_to_the_budget(tenants: DaemonProcess) -> None:
    with UcmClient(tenants.target, token=TOKENS["hog"]) as hog:
        pinned, _ = _pin_all_it_can(hog, _store(hog, 0, 12))
        with pytest.raises(ResourceExhausted, match="pin_share"):
            hog.put_blocks(NS, [(pinned[0], os.urandom(2 * BLOCK))])  # two Cache pages for one
        assert hog.lookup(NS, [pinned[0]]).hits == 1
        (data,) = hog.get_blocks(NS, [pinned[0]])
        assert data is not None and len(data) == BLOCK  # the pinned block as it was
        assert hog.put_blocks(NS, [(pinned[1], os.urandom(BLOCK))]).ok  # same size: fine


def test_pins_still_count_after_a_restart(tmp_path: Path) -> None:
    args = [*SMALL, "--auth-tokens-file", str(_tokens(tmp_path / "tokens.yaml"))]
    d = DaemonProcess(tmp_path / "ucm", args=args)
    with d, UcmClient(d.target, token=TOKENS["hog"]) as hog:
        keys = _store(hog, 0, 12)
        pinned, _ = _pin_all_it_can(hog, keys)
    with d, UcmClient(d.target, token=TOKENS["hog"]) as hog:
        with pytest.raises(ResourceExhausted, match="pin_share"):
            hog.set_retention(NS, [k for k in keys if k not in pinned][:1], pin=True)
        assert hog.set_retention(NS, pinned[:2], pin=False).applied == 2  # unpinning makes room
        assert hog.set_retention(NS, [k for k in keys if k not in pinned][:2], pin=True).applied == 2
        assert hog.lookup(NS, [key_digest("block", 0)]).hits == 1
