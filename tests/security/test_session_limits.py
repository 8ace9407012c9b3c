"""Tasks and sessions: one session cannot exhaust the daemon.

Before the fix a session could queue tasks without limit and a client could open sessions without
limit; each costs the daemon memory and scheduling for everyone. Now ``max_tasks_per_session`` bounds a
session's running and queued tasks, ``max_sessions`` the daemon's sessions, and
``max_sessions_per_peer`` those of one tenant (token) or one TCP host. A refusal is RESOURCE_EXHAUSTED
naming the limit and its setting, never INTERNAL; other clients are unaffected and the daemon stays
healthy. The tests push past each limit as a runaway client would.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from support.blocks import NS
from support.tokens import tokens_file

from ucm_client import BlockIO, Segment, SharedBuffer, UcmClient, key_digest
from ucm_client.errors import ResourceExhausted
from ucm_server.testing.daemon import DaemonProcess

SLOW_TIER = "ucm_server.testing.faults:LatencyInjectingTier"
SIZE = 4096


def _slow_daemon(tmp_path: Path, *extra: str) -> DaemonProcess:
    """Every write takes 1.5 s, so tasks stay running while the test piles more on."""
    settings = {SLOW_TIER: {"root": str(tmp_path / "blocks"), "durable": False, "write_delay_s": 1.5}}
    args = ["--store-pipeline", SLOW_TIER, "--max-tasks-per-session", "4", *extra]
    return DaemonProcess(tmp_path / "ucm", args=args, env={"UCM_TIER_SETTINGS": json.dumps(settings)})


def _dump(c: UcmClient, region: int, name: str) -> int:
    return c.dump(NS, [BlockIO(key_digest("limits", name), (Segment(region, 0, SIZE),))])


@pytest.mark.slow
def test_a_session_past_its_task_limit_is_refused_and_others_are_not(tmp_path: Path) -> None:
    with _slow_daemon(tmp_path) as d, UcmClient(d.target) as greedy, UcmClient(d.target) as other:
        with SharedBuffer(SIZE) as gbuf, SharedBuffer(SIZE) as obuf:
            g, o = greedy.register(gbuf), other.register(obuf)
            tasks = [_dump(greedy, g, f"g{i}") for i in range(4)]
            with pytest.raises(
                ResourceExhausted,
                match=r"has 4 tasks running or queued; the limit is 4 \(setting max_tasks_per_session\)",
            ):
                _dump(greedy, g, "g-too-many")
            with pytest.raises(ResourceExhausted, match="max_tasks_per_session"):
                greedy.prefetch(NS, [key_digest("limits", "g0")])
            with pytest.raises(ResourceExhausted, match="max_tasks_per_session"):
                greedy.load(NS, [BlockIO(key_digest("limits", "g0"), (Segment(g, 0, SIZE),))])
            # Another client is not affected, and the refused calls left nothing behind.
            assert other.wait(_dump(other, o, "other"), 30).ok
            assert d.healthy()
            for t in tasks:
                assert greedy.wait(t, 30).ok
            # Once its tasks finished, the session may submit again.
            assert greedy.wait(_dump(greedy, g, "g-again"), 30).ok
            assert greedy.lookup(NS, [key_digest("limits", "g-too-many")]).present == [False]
        assert d.healthy()


@pytest.mark.slow
def test_sessions_past_the_daemon_limit_are_refused_cleanly(tmp_path: Path) -> None:
    with DaemonProcess(tmp_path / "ucm", args=["--max-sessions", "3"]) as d:
        clients = [UcmClient(d.target, client_name=f"c{i}") for i in range(3)]
        try:
            for c in clients:
                c.connect()
            for _ in range(3):  # again and again: each refusal is clean, nothing leaks
                extra = UcmClient(d.target, client_name="one-too-many")
                with pytest.raises(ResourceExhausted, match=r"the limit is 3 \(setting max_sessions\)"):
                    extra.connect()
                extra.close()
            assert d.healthy()
            assert clients[0].lookup(NS, [key_digest("x")]).present == [False]
        finally:
            for c in clients:
                c.close()
        # Sessions that ended free their places.
        deadline = time.monotonic() + 10
        while True:
            try:
                with UcmClient(d.target) as again:
                    assert again.lookup(NS, [key_digest("x")]).present == [False]
                break
            except ResourceExhausted:
                assert time.monotonic() < deadline, "closed sessions never freed their places"
                time.sleep(0.1)
        assert d.healthy()


def _tokens(path: Path) -> Path:
    return tokens_file(path, [("tok-a", "team-a", {}), ("tok-b", "team-b", {})])


def test_one_tenant_cannot_take_every_session(tmp_path: Path) -> None:
    args = ["--auth-tokens-file", str(_tokens(tmp_path / "tokens.yaml")), "--max-sessions-per-peer", "2"]
    with DaemonProcess(tmp_path / "ucm", args=args) as d:
        with UcmClient(d.target, token="tok-a") as a1, UcmClient(d.target, token="tok-a") as a2:
            third = UcmClient(d.target, token="tok-a")
            with pytest.raises(
                ResourceExhausted,
                match=r"tenant 'team-a' holds 2 sessions; the limit is 2 \(setting max_sessions_per_peer\)",
            ):
                third.connect()
            third.close()
            with UcmClient(d.target, token="tok-b") as b1, UcmClient(d.target, token="tok-b") as b2:
                assert b1.lookup(NS, [key_digest("y")]).present == [False]
                assert b2.lookup(NS, [key_digest("y")]).present == [False]
            assert a1.lookup(NS, [key_digest("y")]).present == [False]
            assert a2.lookup(NS, [key_digest("y")]).present == [False]
        assert d.healthy()
