"""SGLang's own HiCache code (unmodified, on CPU tensors) against a real ucm-server.

Each test drives SGLang's ``HiCacheController`` in the SGLang venv (``harness.py``): a backup goes
through SGLang's backup thread into ``batch_set_v1`` / ``batch_set``, a prefetch through its
prefetch threads into ``batch_exists`` and ``batch_get_v1`` / ``batch_get``. Pages are filled with
seeded random values, and what comes back is compared byte for byte.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.slow_tier import slow_daemon

from tests.sglang.conftest import Harness
from ucm_server.testing.daemon import DaemonProcess

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4


@pytest.fixture(scope="module")
def sgl_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    with DaemonProcess(tmp_path_factory.mktemp("ucm"), args=["--cache-capacity", "64MiB"]) as d:
        yield d


def tokens(start: int, pages: int) -> list[int]:
    return list(range(start, start + pages * PAGE))


def build(h: Harness, name: str, target: str, **args: Any) -> dict[str, Any]:
    extra = {"target": target, "reconnect_interval_s": 0.5, **args.pop("extra", {})}
    built = h("build", name=name, page_size=PAGE, extra=extra, **args)
    assert built["built"], built
    return built


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "generic"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_prefetch_round_trips_bytes(
    harness: Harness, sgl_daemon: DaemonProcess, layout: str, v1: bool
) -> None:
    name = f"{layout}-{v1}"
    built = build(harness, name, sgl_daemon.target, layout=layout, v1=v1)
    # The v1 path shares SGLang's host pool with the daemon in place; the generic path stages.
    assert built["zero_copy"] is v1, built
    prompt = tokens(1000 + 100 * LAYOUTS.index(layout) + (50 if v1 else 0), pages=6)
    stored = harness("store", name=name, tokens=prompt, seed=7)
    assert stored["stored_tokens"] == len(prompt)
    fetched = harness("fetch", name=name, tokens=prompt)
    assert fetched["hit_tokens"] == len(prompt)
    assert fetched["completed_tokens"] == len(prompt)
    assert fetched["pages"] == stored["pages"]
    assert fetched["errors_logged"] == []
    harness("close", name=name)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_v1_and_generic_paths_read_each_others_pages(
    harness: Harness, sgl_daemon: DaemonProcess, layout: str
) -> None:
    """A page stored from the pool (v1) is the bytes of SGLang's flat page (generic), and back."""
    build(harness, "zc", sgl_daemon.target, layout=layout, v1=True)
    build(harness, "flat", sgl_daemon.target, layout=layout, v1=False)
    for writer, reader, start in (("zc", "flat", 5000), ("flat", "zc", 6000)):
        prompt = tokens(start + 100 * LAYOUTS.index(layout), pages=3)
        stored = harness("store", name=writer, tokens=prompt, seed=start)
        fetched = harness("fetch", name=reader, tokens=prompt)
        assert fetched["completed_tokens"] == len(prompt)
        assert fetched["pages"] == stored["pages"]
    harness("close", name="zc")
    harness("close", name="flat")


def test_a_miss_and_a_partial_prefix(harness: Harness, sgl_daemon: DaemonProcess) -> None:
    build(harness, "p", sgl_daemon.target, layout="page_first")
    never = harness("fetch", name="p", tokens=tokens(9000, pages=4))
    assert (never["hit_tokens"], never["completed_tokens"], never["errors_logged"]) == (0, 0, [])

    head = tokens(7000, pages=3)
    stored = harness("store", name="p", tokens=head, seed=3)
    longer = [*head, *range(8000, 8000 + 3 * PAGE)]  # the same first 3 pages, then 3 never stored
    fetched = harness("fetch", name="p", tokens=longer)
    assert fetched["hit_tokens"] == len(head)
    assert fetched["completed_tokens"] == len(head)
    assert fetched["pages"] == stored["pages"]
    # A prompt that differs in its first page shares no key with the stored chain.
    other_start = harness("fetch", name="p", tokens=[1, *head[1:]])
    assert other_start["hit_tokens"] == 0
    harness("close", name="p")


def test_a_second_sglang_process_finds_the_first_ones_pages(
    harness: Harness, sgl_daemon: DaemonProcess, tmp_path: Path
) -> None:
    prompt = tokens(11000, pages=5)
    build(harness, "first", sgl_daemon.target, layout="layer_first")
    stored = harness("store", name="first", tokens=prompt, seed=11)
    second = Harness(tmp_path / "second.log")
    try:
        built = build(second, "second", sgl_daemon.target, layout="layer_first")
        fetched = second("fetch", name="second", tokens=prompt)
        assert fetched["completed_tokens"] == len(prompt)
        assert fetched["pages"] == stored["pages"]
        assert second("expected", name="second", count=len(prompt), seed=11)["pages"] == stored["pages"]
        # Another model name is another namespace: nothing of the first server's is found.
        build(second, "other-model", sgl_daemon.target, layout="layer_first", model="another-model")
        assert second("fetch", name="other-model", tokens=prompt)["hit_tokens"] == 0
        assert (
            built["namespace"]
            == harness(
                "build",
                name="again",
                page_size=PAGE,
                extra={"target": sgl_daemon.target},
                layout="layer_first",
            )["namespace"]
        )
    finally:
        second.close()
    harness("close", name="first")
    harness("close", name="again")


def test_daemon_killed_mid_prefetch_reports_pages_missing_and_reconnects(
    harness: Harness, tmp_path: Path
) -> None:
    """The daemon dies while SGLang's prefetch reads: the pages not read are reported missing, no
    exception reaches SGLang's threads, and once a daemon is back the backend uses it again."""
    daemon = slow_daemon(tmp_path, 1.0)  # every block read and write sleeps 1 s
    with daemon:
        build(harness, "k", daemon.target, layout="page_first", extra={"prefetch_on_lookup": False})
        prompt = tokens(20000, pages=8)
        stored = harness("store", name="k", tokens=prompt, seed=5)
        assert stored["stored_tokens"] == len(prompt)
        assert daemon.proc is not None
        killed = harness("fetch", name="k", tokens=prompt, kill_pid=daemon.proc.pid, kill_after_s=0.4)
        daemon.proc.wait()
        assert killed["hit_tokens"] == len(prompt)
        assert killed["completed_tokens"] < len(prompt)
        assert killed["pages"] == stored["pages"][: killed["completed_tokens"] // PAGE]
        assert killed["errors_logged"] == []
        assert killed["threads_alive"]
        assert killed["daemon_down"]
        # While it is down, a lookup answers "nothing stored" at once (no connection attempt).
        down = harness("fetch", name="k", tokens=prompt)
        assert (down["hit_tokens"], down["errors_logged"], down["threads_alive"]) == (0, [], True)

        daemon.proc = None
        daemon.start()  # the same blocks directory: the pages are on its tier again
        import time

        time.sleep(0.6)  # the backend's reconnect interval (0.5 s) passes
        back = harness("fetch", name="k", tokens=prompt)
        assert back["completed_tokens"] == len(prompt)
        assert back["pages"] == stored["pages"]
        assert not back["daemon_down"]
    harness("close", name="k")


def test_a_read_slower_than_load_timeout_is_cancelled_and_reported_missing(
    harness: Harness, tmp_path: Path
) -> None:
    daemon = slow_daemon(tmp_path, 1.5)
    with daemon:
        build(
            harness,
            "s",
            daemon.target,
            layout="layer_first",
            extra={"load_timeout_s": 0.5, "prefetch_on_lookup": False, "save_timeout_s": 60},
        )
        prompt = tokens(30000, pages=2)
        assert harness("store", name="s", tokens=prompt, seed=9)["stored_tokens"] == len(prompt)
        slow = harness("fetch", name="s", tokens=prompt)
        assert slow["hit_tokens"] == len(prompt)
        assert slow["completed_tokens"] == 0
        assert slow["errors_logged"] == []
        assert not slow["daemon_down"]  # slow is not down: the next call asks it again
    harness("close", name="s")


# -- bad input: named errors, at start-up where the mistake is known there -----------------------------


def test_bad_keys_and_host_indices_are_named(harness: Harness, sgl_daemon: DaemonProcess) -> None:
    build(harness, "bad", sgl_daemon.target, layout="page_first")
    good = "ab" * 32
    short = harness("call", name="bad", method="batch_exists", args=[[good, "abc"]])
    assert short["raised"] == "InvalidArgument"
    assert "key 1 is 3 characters" in short["message"] and "64 hex characters" in short["message"]
    not_hex = harness("call", name="bad", method="batch_exists", args=[["zz" * 32]])
    assert not_hex["raised"] == "InvalidArgument" and "not hexadecimal" in not_hex["message"]
    not_str = harness("call", name="bad", method="batch_exists", args=[[7]])
    assert not_str["raised"] == "InvalidArgument" and "key 0 is a int" in not_str["message"]

    size = 2 * 256 + PAGE  # the host pool: twice the device pool, plus SGLang's padding page
    outside = harness(
        "call", name="bad", method="batch_set_v1", args=[[good]], host_indices=list(range(size, size + PAGE))
    )
    assert outside["raised"] == "ValueError"
    assert "out of the host pool" in outside["message"] and f"0..{size - 1}" in outside["message"]
    negative = harness(
        "call", name="bad", method="batch_get_v1", args=[[good]], host_indices=[-4, -3, -2, -1]
    )
    assert negative["raised"] == "ValueError" and "out of the host pool" in negative["message"]
    torn = harness("call", name="bad", method="batch_get_v1", args=[[good]], host_indices=[8, 9, 10, 12])
    assert torn["raised"] == "ValueError" and "whole pages" in torn["message"]
    count = harness(
        "call", name="bad", method="batch_set_v1", args=[[good, good]], host_indices=[8, 9, 10, 11]
    )
    assert count["raised"] == "ValueError" and "4 token indices for 2 keys" in count["message"]
    harness("close", name="bad")


def test_an_unsupported_layout_fails_start_up_naming_it(harness: Harness, sgl_daemon: DaemonProcess) -> None:
    built = harness(
        "build", name="ph", page_size=PAGE, layout="page_head", extra={"target": sgl_daemon.target}
    )
    assert not built["built"]
    assert "'page_head'" in built["message"]
    assert "layer_first, page_first, page_first_direct" in built["message"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"targte": "/x"}, "unknown key 'targte'"),
        ({"target": "127.0.0.1:9000"}, "is not a Unix socket"),
        ({"load_timeout_s": 0}, "load_timeout_s: expected a positive number"),
        ({"retention": {"pin": "yes"}}, "retention: 'pin' must be true or false"),
        ({"zero_copy": "maybe"}, "zero_copy"),
    ],
)
def test_bad_settings_fail_start_up_naming_the_key(
    harness: Harness, extra: dict[str, Any], named: str
) -> None:
    built = harness("build", name="cfg", page_size=PAGE, layout="page_first", extra=extra)
    assert not built["built"]
    assert built["error"] in ("ValueError", "ConfigError"), built
    assert named in built["message"], built["message"]


def test_a_config_naming_no_daemon_starts_and_answers_missing(harness: Harness, tmp_path: Path) -> None:
    """SGLang starts (a daemon started later is found then), says so once, and every call answers
    "nothing stored" without raising."""
    built = build(harness, "none", f"unix://{tmp_path}/no-daemon.sock", layout="page_first")
    assert built["daemon_down"]
    fetched = harness("fetch", name="none", tokens=tokens(40000, pages=2))
    assert (fetched["hit_tokens"], fetched["errors_logged"]) == (0, [])
    stored = harness("store", name="none", tokens=tokens(40000, pages=2), seed=1)
    assert stored["stored_tokens"] == 0
    assert "daemon at unix://" in harness.tail() and "SGLang keeps serving" in harness.tail()
    harness("close", name="none")
