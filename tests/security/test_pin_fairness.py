"""Pins cannot lock others out: one principal pins all it can, another still stores.

A tier that holds pins never evicts a pinned block it must hold, so a principal that pins everything
takes that tier from everyone else. A pin is held where the block durably lives: in Cache|Posix the
Posix tier holds it, and the Cache evicts a pinned block safe on disk after every unpinned one. So
the budget of each principal without a quota (``pin_share``, half) and of all of them together
(``1 - pin_reserve``, three quarters) is counted in the Posix tier, not in the smaller Cache.

Against real daemons with a small Cache (16 blocks) and Posix tier (64 blocks), a principal without
a quota — a tenant, a token without a tenant, a local client of a daemon without tokens — pins every
block it stored, one by one, until the daemon refuses (RESOURCE_EXHAUSTED naming the setting and
the tier): 32 blocks, twice the Cache. It then reads them all, so the Cache holds nothing but pinned
blocks; another principal still stores 8 of 8 blocks, in the Cache and in the Posix tier, and the
first one's pins all hold, byte for byte. Two such principals together cannot take the tier's
reserve either; a pinned block rewritten larger is held to the same budget; the budget survives a
restart; and a Cache-only daemon, whose Cache must hold every pin, bounds them by the Cache.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support.blocks import NS, dump_random
from support.tokens import tokens_file

from ucm_client import UcmClient, key_digest
from ucm_client.errors import ResourceExhausted
from ucm_protocol.ucm.v1 import ucm_pb2 as pb
from ucm_protocol.ucm.v1 import ucm_pb2_grpc as rpc
from ucm_server.testing.daemon import DaemonProcess

BLOCK = 64 << 10
SMALL = ["--cache-capacity", "1MiB", "--cache-page-size", "64KiB", "--posix-capacity", "4MiB"]
"""16 blocks fit the Cache, 64 the Posix tier; a principal may pin half of the Posix tier (32
blocks), all of them together three quarters (48)."""
TOKENS = {"hog": "tok-hog", "hog2": "tok-hog2", "other": "tok-other", "": "tok-tenantless"}
ADMIN = "tok-admin"


def _tokens(path: Path) -> Path:
    entries = [(token, tenant, {}) for tenant, token in TOKENS.items()]
    return tokens_file(path, [*entries, (ADMIN, "ops", {"admin": True})])


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[DaemonProcess]:
    args = [*SMALL, "--auth-tokens-file", str(_tokens(tmp_path / "tokens.yaml"))]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        yield d


def _store(client: UcmClient, first: int, count: int) -> dict[bytes, bytes]:
    """``count`` blocks keyed ``first...``, durable (in the Posix tier too); their keys and bytes."""
    return dump_random(client, first, count, BLOCK)


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


def held(d: DaemonProcess, tier: str, token: str = "") -> set[bytes]:
    """The digests the tier called ``tier`` holds, as an admin lists them."""
    md = [("authorization", f"Bearer {token}")] if token else []
    with grpc.insecure_channel(d.target) as channel:
        request = pb.ListBlocksRequest(tier=tier, page_size=10000)
        listed = rpc.AdminStub(channel).ListBlocks(request, metadata=md, timeout=10).blocks
    return {bytes(b.key) for b in listed}


def _still_stores(d: DaemonProcess, client: UcmClient, first: int, admin: str = "") -> None:
    """8 new blocks are stored, found, and held in the Cache and in the Posix tier."""
    keys = list(_store(client, first, 8))
    assert client.lookup(NS, keys).hits == 8
    assert set(keys) <= held(d, "Cache", admin), "the Cache refused another principal's blocks"
    assert set(keys) <= held(d, "Posix", admin), "the Posix tier refused another principal's blocks"


def _pins_hold(d: DaemonProcess, client: UcmClient, blocks: dict[bytes, bytes], admin: str = "") -> None:
    """Every pinned block is in the Posix tier and reads back as stored (from the Posix tier, for
    those the Cache let go)."""
    keys = list(blocks)
    assert set(keys) <= held(d, "Posix", admin), "a pinned block left the Posix tier"
    assert client.lookup(NS, keys).hits == len(keys), "a pin was not held"
    assert client.get_blocks(NS, keys) == [blocks[k] for k in keys]


def _cache_full_of_pins(d: DaemonProcess, client: UcmClient, pinned: list[bytes], admin: str = "") -> None:
    """Read every pinned block: the Cache (16 blocks) then holds pinned blocks only."""
    client.get_blocks(NS, pinned)
    cached = held(d, "Cache", admin)
    assert len(cached) == 16 and cached <= set(pinned), "the Cache holds something but pins"


@pytest.mark.parametrize("hog", ["hog", ""], ids=["tenant-without-quota", "token-without-tenant"])
def test_a_principal_without_a_quota_cannot_pin_the_others_out(tenants: DaemonProcess, hog: str) -> None:
    with (
        UcmClient(tenants.target, token=TOKENS[hog]) as pinner,
        UcmClient(tenants.target, token=TOKENS["other"]) as other,
    ):
        blocks = _store(pinner, 0, 64)  # fills the Posix tier
        pinned, refusal = _pin_all_it_can(pinner, list(blocks))
        assert len(pinned) == 32, "half of the Posix tier, where pins are held (twice the Cache)"
        assert "pin_share" in refusal and "Posix" in refusal, refusal
        _cache_full_of_pins(tenants, pinner, pinned, ADMIN)
        _still_stores(tenants, other, 1000, ADMIN)
        _pins_hold(tenants, pinner, {k: blocks[k] for k in pinned}, ADMIN)


def test_all_principals_together_leave_the_reserve(tenants: DaemonProcess) -> None:
    with (
        UcmClient(tenants.target, token=TOKENS["hog"]) as hog,
        UcmClient(tenants.target, token=TOKENS["hog2"]) as hog2,
        UcmClient(tenants.target, token=TOKENS["other"]) as other,
    ):
        first, _ = _pin_all_it_can(hog, list(_store(hog, 0, 40)))
        second, refusal = _pin_all_it_can(hog2, list(_store(hog2, 100, 24)))  # the Posix tier full
        assert (len(first), len(second)) == (32, 16), "pins took more than three quarters of the Posix tier"
        assert "pin_reserve" in refusal and "Posix" in refusal, refusal
        _still_stores(tenants, other, 1000, ADMIN)
        assert hog.lookup(NS, first).hits == 32 and hog2.lookup(NS, second).hits == 16


def test_a_local_client_of_a_daemon_without_tokens_has_a_share_too(tmp_path: Path) -> None:
    with (
        DaemonProcess(tmp_path / "ucm", args=SMALL) as d,
        UcmClient(d.target) as one,
        UcmClient(d.target) as another,
    ):
        blocks = _store(one, 0, 64)
        pinned, refusal = _pin_all_it_can(one, list(blocks))
        assert len(pinned) == 32 and "pin_share" in refusal and "Posix" in refusal, refusal
        _cache_full_of_pins(d, one, pinned)
        _still_stores(d, another, 1000)
        _pins_hold(d, one, {k: blocks[k] for k in pinned})


def test_a_pinned_block_rewritten_larger_is_held_to_the_budget(tenants: DaemonProcess) -> None:
    with UcmClient(tenants.target, token=TOKENS["hog"]) as hog:
        pinned, _ = _pin_all_it_can(hog, list(_store(hog, 0, 40)))
        with pytest.raises(ResourceExhausted, match="pin_share"):
            hog.put_blocks(NS, [(pinned[0], os.urandom(2 * BLOCK))])  # one block grown to two
        assert hog.lookup(NS, [pinned[0]]).hits == 1
        (data,) = hog.get_blocks(NS, [pinned[0]])
        assert data is not None and len(data) == BLOCK  # the pinned block as it was
        assert hog.put_blocks(NS, [(pinned[1], os.urandom(BLOCK))]).ok  # same size: fine


def test_pins_still_count_after_a_restart(tmp_path: Path) -> None:
    args = [*SMALL, "--auth-tokens-file", str(_tokens(tmp_path / "tokens.yaml"))]
    d = DaemonProcess(tmp_path / "ucm", args=args)
    with d, UcmClient(d.target, token=TOKENS["hog"]) as hog:
        keys = list(_store(hog, 0, 40))
        pinned, _ = _pin_all_it_can(hog, keys)
    with d, UcmClient(d.target, token=TOKENS["hog"]) as hog:
        with pytest.raises(ResourceExhausted, match="pin_share"):
            hog.set_retention(NS, [k for k in keys if k not in pinned][:1], pin=True)
        assert hog.set_retention(NS, pinned[:2], pin=False).applied == 2  # unpinning makes room
        assert hog.set_retention(NS, [k for k in keys if k not in pinned][:2], pin=True).applied == 2
        assert hog.lookup(NS, [key_digest("block", 0)]).hits == 1


def test_a_cache_only_daemon_bounds_pins_by_the_cache(tmp_path: Path) -> None:
    # The Cache holds every pin itself here (no tier below): half of it for one principal.
    args = ["--store-pipeline", "Cache", "--cache-capacity", "1MiB", "--cache-page-size", "64KiB"]
    with (
        DaemonProcess(tmp_path / "ucm", args=args) as d,
        UcmClient(d.target) as one,
        UcmClient(d.target) as another,
    ):
        blocks = _store(one, 0, 16)
        pinned, refusal = _pin_all_it_can(one, list(blocks))
        assert len(pinned) == 8 and "pin_share" in refusal and "Cache" in refusal, refusal
        keys = list(_store(another, 1000, 8))
        assert another.lookup(NS, keys).hits == 8 and set(keys) <= held(d, "Cache")
        assert one.get_blocks(NS, pinned) == [blocks[k] for k in pinned]
