"""A method written as in upstream UCM's example loads through the factory and runs under the session checks.

``MySparsAlgorithm`` below follows upstream's custom-method example line by line (public hooks overridden,
``register_kv_caches(kv_caches)``, ``attention_begin`` returning ``(query, key, value, output)``, an
``ucm_sparse_meta`` read in ``execute_begin``); only its two private helpers, empty upstream, are
filled in. The vLLM run of the same class is in ``test_sparse_vllm.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ucm_client.sparse.base import PagedAttentionMeta, UcmSparseBase, UcmSparseRole
from ucm_client.sparse.config import UcmSparseConfig
from ucm_client.sparse.errors import SparseInputError, SparseRoleError, SparseSessionError
from ucm_client.sparse.factory import UcmSparseFactory
from ucm_client.sparse.kernels.paged import PageLayout
from ucm_client.sparse.kernels.scoring import block_min_hamming
from ucm_client.sparse.methods.gsa import GSA, GSAOnDevice, hamming_words, hash_codes, pack_words
from ucm_client.sparse.seed_form import SeedFormAdapter
from ucm_client.sparse.testing import planted_needles


class MySparsAlgorithm(UcmSparseBase):
    """自定义稀疏算法示例 (upstream UCM's custom sparse-method example)."""

    def __init__(self, role: UcmSparseRole, config: dict[str, Any]) -> None:
        super().__init__(role, config)
        self.sparse_ratio = config.get("sparse_ratio", 0.3)
        self._request_states: dict[str, Any] = {}
        self.calls: list[str] = []
        self.drop_tokens = config.get("drop_tokens", False)

    # ---- Scheduler 侧 ----
    def request_begin(self, request_id, prompt_token_ids):  # type: ignore[no-untyped-def,override]
        self._request_states[request_id] = {
            "token_ids": prompt_token_ids,
            "num_tokens": len(prompt_token_ids),
        }

    def estimate_num_slots_sparsed(self, request):  # type: ignore[no-untyped-def,override]
        state = self._request_states.get(request.request_id, {})
        total = state.get("num_tokens", 0)
        return int(total * self.sparse_ratio)

    def build_sparse_meta(self, scheduler_output, seq_group_metadata_list, request_metas):  # type: ignore[no-untyped-def,override]
        sparse_meta = {}
        for meta in seq_group_metadata_list:
            request_id = meta.request_id
            state = self._request_states.get(request_id)
            if state:
                selected = self._select_blocks(state)
                sparse_meta[request_id] = selected
        return sparse_meta

    def request_finished_in_scheduler(self, request_id):  # type: ignore[no-untyped-def,override]
        self._request_states.pop(request_id, None)

    # ---- Worker 侧 ----
    def register_kv_caches(self, kv_caches):  # type: ignore[no-untyped-def,override]
        self._kv_caches = kv_caches

    def execute_begin(self, scheduler_output):  # type: ignore[no-untyped-def,override]
        self._current_sparse_meta = scheduler_output.ucm_sparse_meta
        self.calls.append("execute_begin")

    def attention_begin(self, layer_idx, query, key, value, attn_metadata):  # type: ignore[no-untyped-def,override]
        sparse_k, sparse_v = self._filter_kv(key, value)
        output_buffer = torch.empty_like(query)
        self.calls.append(f"attention_begin:{layer_idx}")
        return query, sparse_k, sparse_v, output_buffer

    def attention_finished(self, layer_idx, output):  # type: ignore[no-untyped-def,override]
        self.last_output = output
        return output

    def execute_finished(self, logits_indices):  # type: ignore[no-untyped-def,override]
        self._current_sparse_meta = None
        return logits_indices

    def request_finished_in_worker(self, request_id):  # type: ignore[no-untyped-def,override]
        pass

    # ---- 私有方法 ----
    def _select_blocks(self, state: dict[str, Any]) -> list[int]:
        return list(range(max(1, int(state["num_tokens"] * self.sparse_ratio) // 16)))

    def _filter_kv(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (key[:-1], value[:-1]) if self.drop_tokens else (key, value)


HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 16


def _config(**config: Any) -> UcmSparseConfig:
    """Upstream UCM's `MySparse:` entry (an empty body when no keys are given), loaded by module path.

    The path is the one vLLM's workers import too (tests/sparse has no package marker, so this
    module's own ``__name__`` differs), which keeps the factory's registration of the name unique.
    """
    return UcmSparseConfig.from_dict(
        {
            "MySparse": config or None,
            "module_path": "tests.sparse.test_sparse_seed_form",
            "class_name": "MySparsAlgorithm",
        }
    )


def _worker(**config: Any) -> Any:
    method = UcmSparseFactory.from_config(_config(**config), UcmSparseRole.WORKER)
    caches = {i: torch.zeros(8, KV_HEADS, BS, 2 * DIM) for i in range(2)}
    method.register_kv_caches(caches, num_heads=HEADS, layout=PageLayout.TOKEN_MAJOR)
    return method


def _layer_args() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionMeta]:
    q, k, v = torch.randn(1, HEADS, DIM), torch.randn(1, KV_HEADS, DIM), torch.randn(1, KV_HEADS, DIM)
    meta = PagedAttentionMeta(
        query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([20]),
        block_table=torch.tensor([[3, 5]]),
        num_actual_tokens=1,
        row_keys=["r"],
    )
    return q, k, v, meta


def test_seed_form_class_loads_from_an_empty_section_and_runs_a_checked_step() -> None:
    method = _worker()
    assert isinstance(method, SeedFormAdapter) and type(method.inner).__name__ == "MySparsAlgorithm"
    assert set(method.inner._kv_caches) == {0, 1}  # register_kv_caches(kv_caches), upstream UCM's signature
    sched = UcmSparseFactory.from_config(_config(sparse_ratio=0.5), UcmSparseRole.SCHEDULER)
    sched.request_begin("r", list(range(64)))
    meta = sched.build_sparse_meta(None, [type("R", (), {"request_id": "r", "num_tokens": 64})()], {})
    assert meta.ucm_sparse_meta == {"r": [0, 1]}
    method.execute_begin(meta)
    assert method.inner._current_sparse_meta == {"r": [0, 1]}  # scheduler_output.ucm_sparse_meta
    q, k, v, paged = _layer_args()
    out = torch.zeros(1, HEADS, DIM)
    inputs = method.attention_begin(0, q, k, v, paged, output=out)
    assert inputs.output is out  # vLLM's buffer stays the one attention writes
    out.fill_(2.0)  # what attention computed
    assert method.attention_finished(0, out) is out
    assert torch.equal(method.inner.last_output, torch.full((1, HEADS, DIM), 2.0))  # its own buffer, filled
    method.execute_finished(torch.tensor([0]))
    assert method.inner.calls == ["execute_begin", "attention_begin:0"]


def test_session_and_shape_checks_apply_to_a_seed_form_method() -> None:
    method = _worker()
    q, k, v, paged = _layer_args()
    with pytest.raises(SparseSessionError, match="outside an execution session"):
        method.attention_begin(0, q, k, v, paged)
    assert method.inner.calls == []  # rejected before the method ran
    dropping = _worker(drop_tokens=True)
    dropping.execute_begin(None)
    with pytest.raises(SparseInputError, match="returned key"):
        dropping.attention_begin(0, q, k, v, paged)


def test_seed_form_hooks_of_the_checked_form_are_not_reachable_directly() -> None:
    inner = MySparsAlgorithm(UcmSparseRole.WORKER, {})
    with pytest.raises(SparseRoleError, match="SeedFormAdapter"):
        inner._on_execute_begin(None)


def test_gsa_on_device_selects_what_gsa_selects() -> None:
    case = planted_needles(4096, seed=3, needle_tokens=1)
    from ucm_client.sparse.methods.block_sparse import DecodeState

    picks = []
    for cls in (GSA, GSAOnDevice):
        method = cls(UcmSparseRole.WORKER, {"sparse_ratio": 0.2})
        res = method.decode(
            case.query,
            case.keys,
            case.values,
            state=DecodeState(),
            block_size=case.block_size,
            scale=case.scale,
        )
        picks.append(res.block_ids)
    assert torch.equal(picks[0], picks[1]) and case.recall(picks[1]) == 1.0
    assert "GSAOnDevice" in UcmSparseFactory.known_methods()


def test_packed_hamming_equals_counting_bits_one_by_one() -> None:
    gen = torch.Generator().manual_seed(0)
    proj = torch.randn(32, 136, generator=gen)  # 136 bits: the last word is zero-padded
    a, b = (
        hash_codes(torch.randn(50, 32, generator=gen), proj),
        hash_codes(torch.randn(32, generator=gen), proj),
    )
    want = (a != b).sum(-1)
    got = hamming_words(pack_words(a), pack_words(b))  # torch popcounts (GSAOnDevice)
    assert torch.equal(got.long(), want)
    # GSA's compiled host loop over the same codes: 50 blocks of one token, one head, no mask
    words, query = pack_words(a).numpy().view(np.uint64), pack_words(b).numpy().view(np.uint64)
    compiled = np.empty((1, 50), np.int64)
    block_min_hamming(
        words[:, None, None, :], query[None], np.full_like(query[None], ~np.uint64(0)), compiled
    )
    assert torch.equal(torch.from_numpy(compiled[0]), want)
