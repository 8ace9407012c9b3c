"""One settings loader for the daemon config, tier settings, fault wrappers, the connector
and the sparse config — and nothing any of them accepted before is refused now.

The first half is a regression table of spellings each loader accepted before the switch (each row
was run against the old loaders too); the second half pins the loader's own rules: one bool
vocabulary, sizes, choices, unknown keys named with the known ones, secrets never shown, one
ConfigError class, strict mode for the sparse config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pytest

from ucm_client.sparse.config import UcmSparseConfig, parse_fields
from ucm_client.sparse.errors import SparseConfigError
from ucm_client.sparse.methods.esa import EsaSpec
from ucm_client.vllm import config as connector
from ucm_protocol.errors import ConfigError
from ucm_server.config_sources import load_config
from ucm_server.store.ds3fs import DS3FSTier
from ucm_server.store.s3 import S3Tier
from ucm_server.testing.faults import FaultInjectingTier, LatencyInjectingTier

# -- regression table: spellings accepted before the one loader ----------------------------------------------

DAEMON_ENV = [  # (variable, value, field, expected)
    *[("UCM_DURABLE", v, "durable", True) for v in ("1", "true", "TRUE", " yes ", "on", "On")],
    *[("UCM_DURABLE", v, "durable", False) for v in ("0", "false", "False", "no", "off", " OFF ")],
    ("UCM_CACHE_CAPACITY", "4GiB", "cache_capacity", 4 << 30),
    ("UCM_CACHE_CAPACITY", "4G", "cache_capacity", 4 << 30),
    ("UCM_CACHE_CAPACITY", "1.5 GB", "cache_capacity", 3 << 29),
    ("UCM_CACHE_CAPACITY", "65536", "cache_capacity", 65536),
    ("UCM_CACHE_CAPACITY", "64k", "cache_capacity", 64 << 10),
    ("UCM_IO_THREADS", "3", "io_threads", 3),
    ("UCM_IO_THREADS", " 3 ", "io_threads", 3),
    ("UCM_SHARED_LOOKUP_TTL_S", "2.5", "shared_lookup_ttl_s", 2.5),
    ("UCM_SHARED_LOOKUP_TTL_S", "1e1", "shared_lookup_ttl_s", 10.0),
    ("UCM_WRITE_MODE", "write-through", "write_mode", "write-through"),
    ("UCM_GPU", "off", "gpu", "off"),
    ("UCM_METRICS_ADDRESS", "off", "metrics_address", "off"),
    ("UCM_TIER_SETTINGS", '{"S3": {"bucket": "b"}}', "tier_settings", {"S3": {"bucket": "b"}}),
    ("UCM_TIER_SETTINGS", "S3: {bucket: b}", "tier_settings", {"S3": {"bucket": "b"}}),
]


@pytest.mark.parametrize(("var", "value", "key", "expected"), DAEMON_ENV)
def test_daemon_env_spellings_still_accepted(var: str, value: str, key: str, expected: object) -> None:
    environ = {var: value}
    if key == "tier_settings":
        environ["UCM_STORE_PIPELINE"] = "Cache|S3"
    cfg, _ = load_config(environ=environ)
    assert getattr(cfg, key) == expected


DAEMON_YAML = [  # (yaml line, field, expected): YAML types, not only strings
    ("durable: true", "durable", True),
    ("durable: no", "durable", False),
    ("durable: 0", "durable", False),
    ("durable: 1", "durable", True),
    ("durable: 'on'", "durable", True),
    ("cache_capacity: 2147483648", "cache_capacity", 2 << 30),
    ("cache_capacity: 2GiB", "cache_capacity", 2 << 30),
    ("io_threads: 3", "io_threads", 3),
    ("io_threads: '3'", "io_threads", 3),
    ("io_threads: 3.0", "io_threads", 3),
    ("heartbeat_interval_s: 2", "heartbeat_interval_s", 2.0),
    ("listen: ''", "listen", ""),
    ("log_level: debug", "log_level", "debug"),
    ("data_dir: ~/ucm-state", "data_dir", Path("~/ucm-state").expanduser()),
    ("tier_settings: {}", "tier_settings", {}),
]


@pytest.mark.parametrize(("line", "key", "expected"), DAEMON_YAML)
def test_daemon_yaml_spellings_still_accepted(tmp_path: Path, line: str, key: str, expected: object) -> None:
    f = tmp_path / "ucm.yaml"
    f.write_text(line + "\n")
    cfg, _ = load_config(f, environ={})
    assert getattr(cfg, key) == expected
    seed = tmp_path / "seed.yaml"
    seed.write_text(f"ucm_connectors:\n- ucm_connector_config:\n    {line}\n")
    cfg, _ = load_config(seed, environ={})
    assert getattr(cfg, key) == expected


def test_daemon_flags_still_accepted() -> None:
    cfg, _ = load_config(
        overrides={"cache_capacity": "512MiB", "io_threads": 4, "durable": False, "write_mode": "write-back"},
        environ={},
    )
    assert (cfg.cache_capacity, cfg.io_threads, cfg.durable) == (512 << 20, 4, False)


TIER = [  # (key, value, attribute, expected) for DS3FS, a tier built from settings
    *[("durable", v, "durable", True) for v in (True, "true", "TRUE", "1", "yes", "Yes")],
    *[("durable", v, "durable", False) for v in (False, "false", "0", "no", "NO")],
    ("capacity", 5, "capacity", 5),
    ("capacity", "5", "capacity", 5),
    ("capacity", "1GiB", "capacity", 1 << 30),
    ("capacity", "1.5KiB", "capacity", 1536),
    ("io_entries", "64", "io_entries", 64),
    ("negative_ttl_s", 2, "negative_ttl_s", 2.0),
    ("negative_ttl_s", 2.5, "negative_ttl_s", 2.5),
    ("negative_ttl_s", "2.5", "negative_ttl_s", 2.5),
    ("subdir", "blocks", "roots", [Path("/3fs/blocks")]),
    ("subdir", Path("blocks"), "roots", [Path("/3fs/blocks")]),
    ("usrbio", "off", "usrbio_mode", "off"),
]


@pytest.mark.parametrize(("key", "value", "attr", "expected"), TIER)
def test_tier_setting_spellings_still_accepted(key: str, value: object, attr: str, expected: object) -> None:
    tier = DS3FSTier.from_settings("D", {"mount": "/3fs", key: value})
    assert getattr(tier, attr) == expected


def test_s3_settings_still_accepted() -> None:
    tier = S3Tier.from_settings(
        "S", {"bucket": "b", "max_workers": "4", "verify_tls": "false", "timeout_s": 2}
    )
    assert (tier.max_workers, tier.verify_tls, tier.timeout_s) == (4, False, 2.0)


def test_fault_wrapper_settings_still_accepted(tmp_path: Path) -> None:
    root = str(tmp_path / "b")
    faulty = FaultInjectingTier.from_settings(
        "F", {"root": root, "durable": False, "capacity": 1 << 20, "eio_read_digests": ["*", "ab" * 32]}
    )
    assert faulty.fail_all and faulty.fail_digests == {bytes.fromhex("ab" * 32)}
    slow = LatencyInjectingTier.from_settings("L", {"root": root, "read_delay_s": 1, "write_delay_s": 0.5})
    assert (slow.read_delay_s, slow.write_delay_s) == (1.0, 0.5)


CONNECTOR = [  # (source, key, value, expected); source "extra" = kv_connector_extra_config
    *[("extra", "load_async", v, True) for v in (True, "true", "1", "yes", "on", " True ")],
    *[("extra", "load_async", v, False) for v in (False, "false", "0", "no", "off")],
    *[("env", "load_async", v, True) for v in ("1", "true", "YES", "on")],
    ("extra", "load_timeout_s", 5, 5.0),
    ("extra", "load_timeout_s", 2.5, 2.5),
    ("extra", "load_timeout_s", "2.5", 2.5),
    ("env", "load_timeout_s", "7", 7.0),
    ("extra", "staging_buffer_gib", 0.5, 0.5),
    ("extra", "target", "/run/ucm.sock", "/run/ucm.sock"),
    ("extra", "target", "", None),
    ("extra", "target", None, None),
    ("extra", "model_id", "m@sha256:1", "m@sha256:1"),
    ("env", "target", "host:7000", "host:7000"),
    ("extra", "weight_fingerprint", "full", "full"),
    ("extra", "load_failure_policy", "vllm", "vllm"),
    ("extra", "ucm_connectors", {"ucm_connector_name": "x"}, ({"ucm_connector_name": "x"},)),
    ("extra", "ucm_connectors", [{"ucm_connector_name": "x"}], ({"ucm_connector_name": "x"},)),
    ("extra", "ucm_sparse_config", None, {}),
    ("extra", "ucm_sparse_config", {"ESA": {}}, {"ESA": {}}),
    ("extra", "metrics_config_path", "./m.yaml", "./m.yaml"),
]


@pytest.mark.parametrize(("source", "key", "value", "expected"), CONNECTOR)
def test_connector_spellings_still_accepted(source: str, key: str, value: Any, expected: object) -> None:
    if source == "env":
        cfg = connector.load_config({}, environ={f"UCM_{key.upper()}": value})
    else:
        cfg = connector.load_config({key: value}, environ={})
    assert getattr(cfg, key) == expected


def test_connector_yaml_spellings_still_accepted(tmp_path: Path) -> None:
    f = tmp_path / "ucm.yaml"
    f.write_text("load_async: yes\nload_timeout_s: 3\nenable_save: 'off'\nucm_connectors: []\n")
    cfg = connector.load_config({}, environ={"UCM_CONFIG_FILE": str(f)})
    assert (cfg.load_async, cfg.load_timeout_s, cfg.enable_save, cfg.ucm_connectors) == (True, 3.0, False, ())


SPARSE = [  # (section, expected spec fields) accepted before
    ({"sparse_ratio": 1}, {"sparse_ratio": 1.0}),
    ({"sparse_ratio": 0.25, "local_window_sz": 3}, {"sparse_ratio": 0.25, "local_window_sz": 3}),
    ({"retrieval_stride": 7, "block_size": 64}, {"retrieval_stride": 7, "block_size": 64}),
    ({}, {}),
]


@pytest.mark.parametrize(("section", "expected"), SPARSE)
def test_sparse_spellings_still_accepted(section: dict[str, object], expected: dict[str, object]) -> None:
    spec = parse_fields(EsaSpec, section, "ucm_sparse_config.ESA")
    for k, v in expected.items():
        assert getattr(spec, k) == v
    cfg = UcmSparseConfig.from_dict({"enabled": False, "min_seq_len": 3, "ESA": section})
    assert (cfg.enabled, cfg.min_seq_len) == (False, 3)


# -- the loader's own rules, seen through each user -------------------------------------------------


@pytest.mark.parametrize("word", ["maybe", "2", "", "y", "enable"])
def test_one_bool_vocabulary_refuses_the_same_words_everywhere(word: str) -> None:
    with pytest.raises(ConfigError, match="durable"):
        load_config(environ={"UCM_DURABLE": word})
    with pytest.raises(ConfigError, match="'durable'"):
        DS3FSTier.from_settings("D", {"mount": "/3fs", "durable": word})
    with pytest.raises(ConfigError, match="load_async"):
        connector.load_config({"load_async": word}, environ={})


def test_tier_bools_now_take_on_and_off_like_the_daemon() -> None:
    """Widening: the tier rules used to lack ``on``/``off``, which the daemon config always took."""
    assert DS3FSTier.from_settings("D", {"mount": "/3fs", "durable": "off"}).durable is False
    assert DS3FSTier.from_settings("D", {"mount": "/3fs", "scan_on_open": " On "}).scan_on_open is True


def test_sparse_stays_strict() -> None:
    """The sparse config is structured data: ``"yes"`` for a bool or ``True`` for a count is a mistake."""
    with pytest.raises(SparseConfigError, match="retrieval_stride: expected int"):
        parse_fields(EsaSpec, {"retrieval_stride": True}, "ucm_sparse_config.ESA")
    with pytest.raises(SparseConfigError, match="sparse_ratio: expected float"):
        parse_fields(EsaSpec, {"sparse_ratio": "0.3"}, "ucm_sparse_config.ESA")
    with pytest.raises(SparseConfigError, match="local_window_sz: expected int"):
        parse_fields(EsaSpec, {"local_window_sz": 2.0}, "ucm_sparse_config.ESA")


def test_unknown_keys_are_named_with_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'cache_capacty'; known: socket, listen"):
        load_config(overrides={"cache_capacty": "1GiB"}, environ={})
    with pytest.raises(ConfigError, match=r"tier 'D' \(DS3FS\): unknown key 'mnt'; known: mount, subdir"):
        DS3FSTier.from_settings("D", {"mount": "/x", "mnt": "/y"})
    with pytest.raises(ConfigError, match=r"kv_connector_extra_config: unknown key 'load_timout_s'; known: "):
        connector.load_config({"load_timout_s": 1}, environ={})
    with pytest.raises(
        SparseConfigError, match=r"ucm_sparse_config.ESA: unknown key 'sparse_ratoi'; known: "
    ):
        parse_fields(EsaSpec, {"sparse_ratoi": 0.3}, "ucm_sparse_config.ESA")


def test_secrets_are_never_shown() -> None:
    for value in (12345, ["s3cr3t-value"], {"k": "s3cr3t-value"}):
        with pytest.raises(ConfigError, match="'secret_key'") as info:
            S3Tier.from_settings("S", {"secret_key": value})
        assert "s3cr3t" not in str(info.value) and "12345" not in str(info.value)
        assert "<hidden>" in str(info.value)


def test_one_config_error_class() -> None:
    """The daemon's, the connector's and the sparse config's errors are one class (aliases), so one
    ``except ConfigError`` catches them all; the sparse one keeps its own name as a subclass."""
    assert connector.ConfigError is ConfigError
    assert issubclass(SparseConfigError, ConfigError) and issubclass(SparseConfigError, ValueError)
    with pytest.raises(ConfigError):
        UcmSparseConfig.from_dict({"ESA": {}, "enabled": "yes"})


def test_generic_loader_rules() -> None:
    from ucm_protocol.settings import coerce, load_fields

    @dataclass(frozen=True)
    class Demo:
        name: str
        mode: Literal["a", "b"] = "a"
        size: int = field(default=0, metadata={"size": True})
        token: str = field(default="", metadata={"secret": True})
        ratio: float | None = None
        paths: tuple[Path, ...] = ()

    got = load_fields(
        Demo, {"name": "x", "mode": "b", "size": "2KiB", "ratio": "0.5", "paths": ["~/a"]}, "demo"
    )
    assert got == {"name": "x", "mode": "b", "size": 2048, "ratio": 0.5, "paths": (Path("~/a").expanduser(),)}
    with pytest.raises(ConfigError, match=r"demo: mode: expected one of a, b, got 'c'"):
        load_fields(Demo, {"name": "x", "mode": "c"}, "demo")
    with pytest.raises(ConfigError, match=r"demo: name is required"):
        load_fields(Demo, {}, "demo")
    with pytest.raises(ConfigError, match=r"demo: token: expected a string, got <hidden>"):
        load_fields(Demo, {"name": "x", "token": 7}, "demo", source="structured")
    assert load_fields(Demo, {"name": "x", "ratio": None}, "demo")["ratio"] is None
    assert coerce(bool, "  ON ", "k") is True
    with pytest.raises(ConfigError, match="k: expected bool"):
        coerce(bool, "yes", "k", source="strict")
    assert json.loads(json.dumps(load_fields(Demo, {"name": "x"}, "demo"))) == {"name": "x"}
