"""``ucm_sparse_config`` parsing and the method factory, including out-of-tree methods."""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from ucm_client.sparse.base import UcmSparseRole
from ucm_client.sparse.config import ENV_VAR, UcmSparseConfig, load_sparse_config
from ucm_client.sparse.errors import SparseConfigError, UnknownSparseMethodError
from ucm_client.sparse.factory import ENTRY_POINT_GROUP, UcmSparseFactory
from ucm_client.sparse.methods.esa import ESA, EsaSpec

SEED_CONFIG = {
    "enabled": True,
    "min_seq_len": 256,
    "ESA": {
        "sparse_ratio": 0.3,
        "local_window_sz": 2,
        "retrieval_stride": 5,
        "init_window_sz": 1,
        "min_blocks": 4,
    },
}


def test_seed_format_parses_into_the_method_spec() -> None:
    cfg = UcmSparseConfig.from_dict(SEED_CONFIG)
    assert (cfg.algorithm, cfg.enabled, cfg.min_seq_len) == ("ESA", True, 256)
    method = UcmSparseFactory.from_config(cfg, UcmSparseRole.WORKER)
    assert isinstance(method, ESA)
    assert method.spec == EsaSpec(sparse_ratio=0.3, local_window_sz=2, retrieval_stride=5, init_window_sz=1)
    assert method.min_seq_len == 256


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"ESA": {"sparse_ratoi": 0.3}}, "unknown key 'sparse_ratoi'"),
        ({"ESA": {"sparse_ratio": 1.5}}, "sparse_ratio must be in"),
        ({"ESA": {"local_window_sz": 0}}, "local_window_sz must be >= 1"),
        ({"ESA": {"retrieval_stride": True}}, "retrieval_stride: expected int"),
        ({"ESA": {}, "GSA": {}}, "exactly one method section"),
        ({"algorithm": "ESA", "GSA": {}}, "do not match algorithm"),
        ({"ESA": {}, "min_seq_len": -1}, "min_seq_len"),
        ({"ESA": {}, "enabled": "yes"}, "enabled: expected bool"),
        ({"ESA": {}, "module_path": "x"}, "module_path and class_name go together"),
    ],
)
def test_bad_configs_name_the_problem(raw: dict[str, object], message: str) -> None:
    with pytest.raises(SparseConfigError, match=message):
        cfg = UcmSparseConfig.from_dict(raw)
        UcmSparseFactory.from_config(cfg, UcmSparseRole.WORKER)


def test_unknown_method_lists_the_known_ones() -> None:
    with pytest.raises(UnknownSparseMethodError) as info:
        UcmSparseFactory.create_sparse_method("NoSuch", UcmSparseRole.WORKER, {})
    for name in ("ESA", "GSA", "KVStarMultiStep", "Blend", "ReRoPE"):
        assert name in str(info.value)
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_duplicate_registration_with_another_target_is_rejected() -> None:
    same = ("ESA", "ucm_client.sparse.methods.esa", "ESA")
    UcmSparseFactory.register_sparse_method(*same)  # same target: fine
    with pytest.raises(SparseConfigError, match="already registered"):
        UcmSparseFactory.register_sparse_method("ESA", "elsewhere", "ESA")


def _write_plugin(root: Path, module: str) -> None:
    (root / f"{module}.py").write_text(
        textwrap.dedent(
            """
            from ucm_client.sparse.methods.passthrough import DenseInVllmMethod

            class Everything(DenseInVllmMethod):
                pass
            """
        )
    )


def test_third_party_method_by_module_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_plugin(tmp_path, "my_sparse_mod")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = UcmSparseConfig.from_dict(
        {
            "algorithm": "ThirdPartySparse",
            "module_path": "my_sparse_mod",
            "class_name": "Everything",
            "ThirdPartySparse": {},
        }
    )
    method = UcmSparseFactory.from_config(cfg, UcmSparseRole.SCHEDULER)
    assert type(method).__name__ == "Everything"
    assert "ThirdPartySparse" in UcmSparseFactory.known_methods()


def test_third_party_method_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_plugin(tmp_path, "ep_sparse_mod")
    dist = tmp_path / "ep_sparse-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-sparse\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\nEpSparse = ep_sparse_mod:Everything\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "EpSparse" in UcmSparseFactory.known_methods()
    method = UcmSparseFactory.create_sparse_method("EpSparse", UcmSparseRole.WORKER, {})
    assert type(method).__name__ == "Everything"


def test_a_class_that_is_not_a_sparse_method_is_refused() -> None:
    UcmSparseFactory.register_sparse_method("NotSparse", "json", "JSONDecoder")
    with pytest.raises(SparseConfigError, match="is not a UcmSparseBase"):
        UcmSparseFactory.create_sparse_method("NotSparse", UcmSparseRole.WORKER, {})


def test_environment_overrides_connector_extra_config(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = {"ucm_sparse_config": SEED_CONFIG}
    monkeypatch.delenv(ENV_VAR, raising=False)
    cfg = load_sparse_config(extra)
    assert cfg is not None and cfg.algorithm == "ESA"
    monkeypatch.setenv(ENV_VAR, json.dumps({"GSA": {"hash_bits": 64}}))
    cfg = load_sparse_config(extra)
    assert cfg is not None and cfg.algorithm == "GSA" and cfg.method_config["hash_bits"] == 64
    monkeypatch.setenv(ENV_VAR, "{not json")
    with pytest.raises(SparseConfigError, match=ENV_VAR):
        load_sparse_config(extra)
    monkeypatch.delenv(ENV_VAR)
    assert load_sparse_config({}) is None


@pytest.mark.vllm
def test_doctor_reports_hooks_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("vllm")
    from ucm_client.sparse import doctor

    code = doctor.main(["--json", "--register"])
    rows = {r["hook"]: r for r in json.loads(capsys.readouterr().out)}
    assert code == 0 and rows["attention_begin"]["active"] is True
    assert rows["build_sparse_meta"]["active"] is False and rows["build_sparse_meta"]["detail"]
    assert "vllm" in sys.modules


def _engine_config(
    sparse: dict[str, object] | None,
    connector: str | None = "UcmSparseConnector",
    module_path: str | None = "ucm_client.sparse.vllm_connector",
    **extra: object,
) -> SimpleNamespace:
    """The attributes of a VllmConfig the runtime reads: the connector and its extra config."""
    if sparse is not None:
        extra["ucm_sparse_config"] = sparse
    transfer = SimpleNamespace(
        kv_connector=connector, kv_connector_module_path=module_path, kv_connector_extra_config=extra
    )
    return SimpleNamespace(kv_transfer_config=transfer)


def test_each_engine_gets_a_runtime_from_its_connector_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from ucm_client.sparse.methods.gsa import GSA
    from ucm_client.sparse.vllm import runtime as vllm_runtime

    monkeypatch.delenv(ENV_VAR, raising=False)
    vllm_runtime.reset_runtime()
    try:
        first = _engine_config(SEED_CONFIG)
        rt1 = vllm_runtime.runtime_for_engine(first)
        assert rt1 is not None and isinstance(rt1.method, ESA) and rt1.method.min_seq_len == 256
        assert vllm_runtime.runtime_for_engine(first) is rt1  # every layer of one engine shares it
        assert vllm_runtime.worker_runtime() is rt1
        second = _engine_config({"GSA": {"hash_bits": 64}})
        rt2 = vllm_runtime.runtime_for_engine(second)
        assert rt2 is not None and rt2 is not rt1 and isinstance(rt2.method, GSA)
        assert vllm_runtime.runtime_for_engine(_engine_config(None)) is None  # no config: dense
        assert vllm_runtime.runtime_for_engine(_engine_config({"enabled": False, "ESA": {}})) is None
    finally:
        vllm_runtime.reset_runtime()


def test_an_engine_whose_connector_carries_no_channel_refuses_naming_the_configuration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sparse attention never starts keyed by anything but the request: without a connector that carries
    the scheduler's metadata the runtime refuses, and the error holds the configurations to use, with
    the user's own ``ucm_sparse_config`` in them."""
    pytest.importorskip("vllm")
    from ucm_client.sparse.vllm import runtime as vllm_runtime

    monkeypatch.setenv(ENV_VAR, json.dumps(SEED_CONFIG))
    vllm_runtime.reset_runtime()
    try:
        for engine, where in (
            (SimpleNamespace(), "no kv_transfer_config"),
            (_engine_config(None, None, None), "no kv_transfer_config"),
            (
                _engine_config(None, "LMCacheConnectorV1", "vllm.distributed.kv_transfer"),
                "'LMCacheConnectorV1'",
            ),
        ):
            with pytest.raises(SparseConfigError, match="Refusing to start") as refused:
                vllm_runtime.runtime_for_engine(engine)
            message = str(refused.value)
            assert where in message
            suggested = {c["kv_connector"]: c for c in map(json.loads, re.findall(r"'(\{.*?\})'", message))}
            assert suggested["UCMConnector"]["kv_connector_module_path"] == "ucm_client.vllm.connector"
            alone = suggested["UcmSparseConnector"]
            assert alone["kv_connector_module_path"] == "ucm_client.sparse.vllm_connector"
            assert alone["kv_connector_extra_config"]["ucm_sparse_config"]["ESA"] == SEED_CONFIG["ESA"]
            assert alone["kv_connector_extra_config"]["ucm_sparse_config"]["min_seq_len"] == 256
        # Either of ours carries it, alone or inside vLLM's MultiConnector.
        for engine in (
            _engine_config(None),
            _engine_config(None, "UCMConnector", "ucm_client.vllm.connector"),
            _engine_config(
                None,
                "MultiConnector",
                None,
                connectors=[
                    {"kv_connector": "LMCacheConnectorV1"},
                    {
                        "kv_connector": "UcmSparseConnector",
                        "kv_connector_module_path": "ucm_client.sparse.vllm_connector",
                    },
                ],
            ),
        ):
            vllm_runtime.reset_runtime()
            assert vllm_runtime.runtime_for_engine(engine) is not None
    finally:
        vllm_runtime.reset_runtime()
