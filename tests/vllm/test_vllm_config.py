"""Connector configuration: upstream UCM's format, its priority order, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from ucm_client.vllm.config import ConfigError, ConnectorConfig, load_config

SEED_YAML = """\
ucm_connectors:
  - ucm_connector_name: "UcmPipelineStore"
    ucm_connector_config:
      store_pipeline: "Cache|Posix"
      storage_backends: "/data/ucm_cache"
      buffer_number: 2048
ucm_sparse_config:
  ESA:
    sparse_ratio: 0.3
    local_window_sz: 2
    retrieval_stride: 5
metrics_config_path: "./metrics_config.yaml"
load_only_first_rank: false
use_layerwise: false
"""


def test_defaults_need_no_config_at_all() -> None:
    config = load_config(None, environ={})
    assert config == ConnectorConfig()
    assert config.target is None  # the daemon's default socket
    assert config.enable_load and config.enable_save and not config.load_async


def test_seed_001_yaml_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text(SEED_YAML)
    config = load_config({}, environ={"UCM_CONFIG_FILE": str(path)})
    assert config.ucm_sparse_config["ESA"]["sparse_ratio"] == 0.3
    assert not config.use_layerwise and not config.load_only_first_rank
    # The store list configures ucm-server; the connector names those keys (for one warning).
    assert config.daemon_side_keys() == [
        "ucm_connectors[UcmPipelineStore].store_pipeline",
        "ucm_connectors[UcmPipelineStore].storage_backends",
        "ucm_connectors[UcmPipelineStore].buffer_number",
        "metrics_config_path",
    ]


def test_priority_env_over_extra_over_yaml_over_defaults(tmp_path: Path) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text("load_timeout_s: 1\nsave_timeout_s: 2\nrpc_timeout_s: 3\n")
    extra = {"UCM_CONFIG_FILE": str(path), "save_timeout_s": 20, "rpc_timeout_s": 30}
    config = load_config(extra, environ={"UCM_RPC_TIMEOUT_S": "300"})
    assert (config.load_timeout_s, config.save_timeout_s, config.rpc_timeout_s) == (1.0, 20.0, 300.0)
    assert config.connect_timeout_s == ConnectorConfig().connect_timeout_s


def test_env_file_wins_over_extra_config_file(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("load_async: true\n")
    (tmp_path / "b.yaml").write_text("load_async: false\n")
    config = load_config(
        {"config_file": str(tmp_path / "b.yaml")}, environ={"UCM_CONFIG_FILE": str(tmp_path / "a.yaml")}
    )
    assert config.load_async


def test_use_layerwise_is_accepted_from_every_source(tmp_path: Path) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text("use_layerwise: true\n")
    assert load_config({}, environ={"UCM_CONFIG_FILE": str(path)}).use_layerwise
    assert load_config({"use_layerwise": True}, environ={}).use_layerwise
    assert load_config({}, environ={"UCM_USE_LAYERWISE": "true"}).use_layerwise
    assert not load_config({"use_layerwise": True}, environ={"UCM_USE_LAYERWISE": "0"}).use_layerwise


def test_socket_env_sets_the_target() -> None:
    assert load_config({"target": "/x.sock"}, environ={"UCM_SOCKET": "/y.sock"}).target == "/y.sock"
    assert load_config({"target": "/x.sock"}, environ={}).target == "/x.sock"


@pytest.mark.parametrize(
    ("extra", "environ", "fragment"),
    [
        ({"load_timout_s": 1}, {}, "kv_connector_extra_config: unknown key 'load_timout_s'"),
        ({"load_async": "maybe"}, {}, "load_async: expected bool"),
        ({}, {"UCM_LOAD_ASYNC": "maybe"}, "environment UCM_LOAD_ASYNC: load_async"),
        ({"load_timeout_s": -1}, {}, "load_timeout_s: expected a positive number"),
        ({"weight_fingerprint": "md5"}, {}, "expected one of sampled, full, off"),
        ({"use_layerwise": True, "zero_copy": False}, {}, "use_layerwise: true needs zero_copy: true"),
        ({}, {"UCM_USE_LAYERWISE": "1", "UCM_ZERO_COPY": "0"}, "use_layerwise: true needs zero_copy: true"),
        ({"load_only_first_rank": True}, {}, "load_only_first_rank: true is not supported"),
        ({"ucm_connectors": "Cache|Posix"}, {}, "ucm_connectors: expected a list of mappings"),
    ],
)
def test_bad_settings_name_the_key(extra: dict[str, object], environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("|", r"\|")):
        load_config(extra, environ=environ)


def test_bad_yaml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text("use_layerwise: [unclosed\n")
    with pytest.raises(ConfigError, match=f"config file {path}: not valid YAML"):
        load_config({}, environ={"UCM_CONFIG_FILE": str(path)})
    path.write_text("nonsense_key: 1\n")
    with pytest.raises(ConfigError, match=f"config file {path}: unknown key 'nonsense_key'"):
        load_config({}, environ={"UCM_CONFIG_FILE": str(path)})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config({}, environ={"UCM_CONFIG_FILE": str(tmp_path / "missing.yaml")})
