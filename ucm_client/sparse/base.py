"""``UcmSparseBase``: the lifecycle every sparse-attention method implements (upstream UCM's hooks).

Roles are kept apart: a SCHEDULER instance answers the request-level hooks in the engine process, a
WORKER instance the step and layer hooks next to the KV cache; calling a hook of the other role is an
error, because the two never share memory in a real deployment and code that works in one process
only would break under vLLM's multiprocessing. ``SparseMeta`` is the only channel between them.

The public hooks are final: they enforce an execution discipline (``session.py``: session scope, tensor
validation against immutable per-layer specs) and then call the ``_on_*`` method a subclass provides.
A method therefore cannot forget a check, and a test of the discipline covers every method.
"""

from __future__ import annotations

import enum
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, final

import torch

from ucm_client.sparse.errors import SparseInputError, SparseRoleError, SparseSessionError
from ucm_client.sparse.kernels.paged import PageLayout
from ucm_client.sparse.phase_clock import PhaseClock
from ucm_client.sparse.session import ExecutionSession, check_tensor

__all__ = [
    "PUBLIC_HOOKS",
    "AttentionInputs",
    "HeadTables",
    "LayerSpec",
    "PagedAttentionMeta",
    "RequestSparseMeta",
    "SparseMeta",
    "SparseRequest",
    "UcmSparseBase",
    "UcmSparseRole",
    "layer_index",
]


def layer_index(layer_name: str) -> int:
    """``model.layers.7.self_attn.attn`` → 7 (the first integer path component): how vLLM's layer
    names map to the layer indices methods and cold KV keep their state by."""
    match = re.search(r"\.(\d+)\.", f".{layer_name}.")
    if match is None:
        raise SparseInputError(f"cannot find a layer index in layer name {layer_name!r}")
    return int(match.group(1))


class UcmSparseRole(enum.Enum):
    """Where an instance runs: the scheduler (engine core) or a worker (next to the KV cache)."""

    SCHEDULER = 0
    WORKER = 1


class SparseRequest(Protocol):
    """What the scheduler hooks read from a request (vLLM's ``Request`` satisfies it)."""

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class RequestSparseMeta:
    """Per-request decision the scheduler hands to the workers for one step."""

    request_id: str
    num_tokens: int
    retrieve: bool
    """True on steps where the worker must re-run block retrieval (every ``retrieval_stride`` steps)."""


@dataclass(frozen=True, slots=True)
class SparseMeta:
    """Everything a worker learns from the scheduler about one step."""

    # Plain dicts (typed read-only): this travels from the engine core to workers, and vLLM pickles it
    # when they are other processes; a MappingProxyType cannot be pickled.
    requests: Mapping[str, RequestSparseMeta] = field(default_factory=dict)
    write_blocks: Mapping[int, str] = field(default_factory=dict)
    """Physical block receiving each scheduled request's last token this step → request id.

    How a worker tells which batch row is which request: the block being written is owned by one
    request only, even when prefix caching shares every block before it (a row's *first* block is
    shared by every request with the same prefix, so it cannot name a request)."""
    finished: frozenset[str] = frozenset()
    """Requests the scheduler finished since the last step, or resumed after a preemption (their KV is
    recomputed from scratch); workers drop their state."""
    custom: Any = None
    """What a seed-form method's ``build_sparse_meta`` returned (any object; see ``seed_form``)."""

    @property
    def ucm_sparse_meta(self) -> Any:
        """Upstream UCM's name for the method's own metadata (``scheduler_output.ucm_sparse_meta``)."""
        return self.custom


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """Immutable facts about one attention layer, fixed when the KV caches are registered.

    Hooks validate every tensor against this; nothing about a layer is re-derived from a tensor's
    shape mid-run, so a mis-shaped tensor is caught instead of being trusted.
    """

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    device: torch.device
    layout: PageLayout

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


@dataclass(frozen=True, slots=True)
class PagedAttentionMeta:
    """The backend-neutral view of a step's attention metadata for one layer.

    Rows are requests. ``row_keys`` identify a row's request across steps (its request id); ``None``
    marks a row whose request is unknown this step, which attends densely and leaves no state.
    """

    query_start_loc: torch.Tensor
    """``[num_rows + 1]`` offsets of each row's query tokens."""
    seq_lens: torch.Tensor
    """``[num_rows]`` tokens in the KV cache per row, the current ones included."""
    block_table: torch.Tensor
    """``[num_rows, max_blocks]`` physical block ids per row."""
    num_actual_tokens: int
    row_keys: Sequence[str | None]
    per_head: bool = False
    """The backend can attend each KV head of a decode row to its own blocks (``HeadTables``)."""


@dataclass(frozen=True, slots=True)
class HeadTables:
    """Decode rows whose KV heads each attend to their own blocks.

    ``block_table[i, h]`` lists the physical blocks KV head ``h`` of batch row ``rows[i]`` attends to
    (padded past ``seq_lens[i]``'s blocks); every head of a row attends to ``seq_lens[i]`` tokens (the
    same number of blocks, the partial last block last). The backend runs these rows in one kernel
    call over the KV cache seen per (block, head) page.
    """

    rows: torch.Tensor
    """``[S]`` batch rows."""
    block_table: torch.Tensor
    """``[S, kv_heads, k]`` physical block ids per row and KV head."""
    seq_lens: torch.Tensor
    """``[S]`` tokens every head of the row attends to."""


@dataclass(frozen=True, slots=True)
class AttentionInputs:
    """What ``attention_begin`` hands back to the backend.

    ``block_table`` / ``seq_lens`` are ``None`` to attend densely, or the per-row sparse replacement
    (selected blocks in order, with ``seq_lens`` counting only the selected tokens). Rows listed in
    ``head_tables`` attend per KV head; their row here is whatever is cheapest for the kernel's batch
    call (their output is overwritten by the per-head call).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    head_tables: HeadTables | None = None


_INDEX_DTYPES = (torch.int32, torch.int64)


def _seed_form_stub(name: str) -> Any:
    def stub(self: UcmSparseBase, *args: Any, **kwargs: Any) -> Any:
        raise SparseRoleError(
            f"{type(self).__name__} is written in the seed form (it overrides the public hooks); "
            f"{name} is never called: run it through UcmSparseFactory, which wraps it in SeedFormAdapter"
        )

    return stub


PUBLIC_HOOKS = (
    "request_begin",
    "estimate_num_slots_sparsed",
    "build_sparse_meta",
    "request_finished_in_scheduler",
    "register_kv_caches",
    "execute_begin",
    "attention_begin",
    "attention_finished",
    "execute_finished",
    "request_finished_in_worker",
)
"""Upstream UCM's hooks; a subclass that overrides one of them is written in the seed form."""


class UcmSparseBase(ABC):
    """Base of every sparse method; see the module docstring for the contract.

    Two ways to write a method: the *checked form* implements the ``_on_*`` methods and inherits the
    final public hooks; the *seed form* (upstream UCM's example) overrides the public hooks themselves.
    A seed-form class is instantiable (its ``_on_*`` are filled in here) and the factory runs it
    inside :class:`ucm_client.sparse.seed_form.SeedFormAdapter`, which is a checked-form method: the
    session and tensor checks apply to it too.
    """

    seed_form: bool = False
    """True for a subclass that overrides the public hooks (set automatically)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if any(hook in vars(cls) for hook in PUBLIC_HOOKS):
            cls.seed_form = True
            for name in [n for n in dir(UcmSparseBase) if n.startswith("_on_")]:
                if getattr(getattr(cls, name), "__isabstractmethod__", False):
                    setattr(cls, name, _seed_form_stub(name))

    def __init__(self, role: UcmSparseRole, config: Mapping[str, Any], *, min_seq_len: int = 0) -> None:
        self.role = role
        self.config: Mapping[str, Any] = MappingProxyType(dict(config))
        self.min_seq_len = min_seq_len
        self._session = ExecutionSession()
        self._layer_specs: Mapping[int, LayerSpec] = MappingProxyType({})
        self._kv_caches: Mapping[int, torch.Tensor] = MappingProxyType({})
        self.clock = PhaseClock()
        """Per-phase wall time of decode steps (the runtime and the method both record into it)."""

    # ------------------------------------------------------------------ helpers
    def _require_role(self, role: UcmSparseRole, hook: str) -> None:
        if self.role is not role:
            raise SparseRoleError(f"{hook} is a {role.name} hook; this instance is {self.role.name}")

    @property
    def layer_specs(self) -> Mapping[int, LayerSpec]:
        """Per-layer specs, read-only; empty until ``register_kv_caches``."""
        return self._layer_specs

    @property
    def session(self) -> ExecutionSession:
        return self._session

    def _spec(self, layer_idx: int) -> LayerSpec:
        try:
            return self._layer_specs[layer_idx]
        except KeyError:
            raise SparseInputError(
                f"layer {layer_idx} has no registered KV cache (registered: {sorted(self._layer_specs)})"
            ) from None

    # ------------------------------------------------------------ scheduler side
    @final
    def request_begin(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """A request entered the scheduler; set up its per-request state."""
        self._require_role(UcmSparseRole.SCHEDULER, "request_begin")
        self._on_request_begin(request_id, prompt_token_ids)

    @final
    def estimate_num_slots_sparsed(self, request: SparseRequest) -> int:
        """KV slots the request needs resident after sparsification (what the scheduler must allocate)."""
        self._require_role(UcmSparseRole.SCHEDULER, "estimate_num_slots_sparsed")
        return self._on_estimate_num_slots_sparsed(request)

    @final
    def build_sparse_meta(
        self,
        scheduler_output: Any,
        seq_group_metadata_list: Sequence[SparseRequest],
        request_metas: Mapping[str, Any],
    ) -> SparseMeta:
        """Decide this step's per-request sparse actions; the result travels to the workers."""
        self._require_role(UcmSparseRole.SCHEDULER, "build_sparse_meta")
        return self._on_build_sparse_meta(scheduler_output, seq_group_metadata_list, request_metas)

    @final
    def request_finished_in_scheduler(self, request_id: str) -> None:
        self._require_role(UcmSparseRole.SCHEDULER, "request_finished_in_scheduler")
        self._on_request_finished_in_scheduler(request_id)

    # --------------------------------------------------------------- worker side
    @final
    def register_kv_caches(
        self, kv_caches: Mapping[int, torch.Tensor], *, num_heads: int, layout: PageLayout
    ) -> None:
        """Take the paged caches (``[blocks, kv_heads, block_size, 2*head_dim]`` per layer); build specs."""
        self._require_role(UcmSparseRole.WORKER, "register_kv_caches")
        specs: dict[int, LayerSpec] = {}
        for idx, cache in kv_caches.items():
            check_tensor(f"kv_caches[{idx}]", cache, shape=(None, None, None, None))
            num_blocks, kv_heads, block_size, two_d = cache.shape
            if two_d % 2 or num_heads % kv_heads:
                raise SparseInputError(
                    f"kv_caches[{idx}]: last dim {two_d} must be 2*head_dim and num_heads {num_heads} "
                    f"a multiple of kv heads {kv_heads}"
                )
            specs[idx] = LayerSpec(
                layer_idx=idx,
                num_heads=num_heads,
                num_kv_heads=kv_heads,
                head_dim=two_d // 2,
                block_size=block_size,
                num_blocks=num_blocks,
                dtype=cache.dtype,
                device=cache.device,
                layout=layout,
            )
        self._layer_specs = MappingProxyType(specs)
        self._kv_caches = MappingProxyType(dict(kv_caches))
        self._on_register_kv_caches()

    @final
    def execute_begin(self, scheduler_output: SparseMeta | None) -> None:
        """Open the step's session; layer hooks are accepted until ``execute_finished``."""
        self._require_role(UcmSparseRole.WORKER, "execute_begin")
        self._session.open()
        self._on_execute_begin(scheduler_output)

    @final
    def attention_begin(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_metadata: PagedAttentionMeta,
        *,
        output: torch.Tensor | None = None,
    ) -> AttentionInputs:
        """Before a layer's attention: validate, then let the method choose what to attend to."""
        self._require_role(UcmSparseRole.WORKER, "attention_begin")
        self._session.require_open("attention_begin")
        spec = self._spec(layer_idx)
        kw = {"dtype": spec.dtype, "device": spec.device}
        check_tensor("query", query, shape=(None, spec.num_heads, spec.head_dim), **kw)  # type: ignore[arg-type]
        tokens = query.shape[0]
        check_tensor("key", key, shape=(tokens, spec.num_kv_heads, spec.head_dim), **kw)  # type: ignore[arg-type]
        check_tensor("value", value, shape=(tokens, spec.num_kv_heads, spec.head_dim), **kw)  # type: ignore[arg-type]
        if output is None:
            output = torch.empty(tokens, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=spec.device)
        check_tensor("output", output, shape=(tokens, spec.num_heads, spec.head_dim), **kw)  # type: ignore[arg-type]
        meta = attn_metadata
        rows = len(meta.row_keys)
        check_tensor("seq_lens", meta.seq_lens, shape=(rows,), dtype=_INDEX_DTYPES)
        check_tensor("query_start_loc", meta.query_start_loc, shape=(rows + 1,), dtype=_INDEX_DTYPES)
        check_tensor("block_table", meta.block_table, shape=(rows, None), dtype=_INDEX_DTYPES)
        if not 0 <= meta.num_actual_tokens <= tokens:
            raise SparseInputError(
                f"num_actual_tokens {meta.num_actual_tokens} exceeds the {tokens} query rows"
            )
        self._session.begin_layer(layer_idx)
        return self._on_attention_begin(spec, query, key, value, meta=meta, output=output)

    @final
    def attention_finished(self, layer_idx: int, output: torch.Tensor) -> torch.Tensor:
        """After a layer's attention: the method may correct the output (same shape, same buffer)."""
        self._require_role(UcmSparseRole.WORKER, "attention_finished")
        self._session.require_open("attention_finished")
        spec = self._spec(layer_idx)
        check_tensor(
            "output",
            output,
            shape=(None, spec.num_heads, spec.head_dim),
            dtype=spec.dtype,
            device=spec.device,
        )
        self._session.finish_layer(layer_idx)
        return self._on_attention_finished(spec, output)

    @final
    def execute_finished(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """Close the step's session; returns the (possibly changed) logits indices."""
        self._require_role(UcmSparseRole.WORKER, "execute_finished")
        if not self._session.is_open:
            raise SparseSessionError("execute_finished called outside an execution session")
        check_tensor("logits_indices", logits_indices, shape=(None,), dtype=_INDEX_DTYPES)
        try:
            return self._on_execute_finished(logits_indices)
        finally:
            self._session.close()

    @final
    def request_finished_in_worker(self, request_id: str) -> None:
        self._require_role(UcmSparseRole.WORKER, "request_finished_in_worker")
        self._on_request_finished_in_worker(request_id)

    # ------------------------------------------------------- subclass interface
    @abstractmethod
    def _on_request_begin(self, request_id: str, prompt_token_ids: Sequence[int]) -> None: ...

    @abstractmethod
    def _on_estimate_num_slots_sparsed(self, request: SparseRequest) -> int: ...

    @abstractmethod
    def _on_build_sparse_meta(
        self,
        scheduler_output: Any,
        seq_group_metadata_list: Sequence[SparseRequest],
        request_metas: Mapping[str, Any],
    ) -> SparseMeta: ...

    @abstractmethod
    def _on_request_finished_in_scheduler(self, request_id: str) -> None: ...

    def _on_register_kv_caches(self) -> None:  # noqa: B027 - optional hook, empty on purpose
        """Called once the specs exist; most methods need nothing more."""

    @abstractmethod
    def _on_execute_begin(self, scheduler_output: SparseMeta | None) -> None: ...

    @abstractmethod
    def _on_attention_begin(
        self,
        spec: LayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        meta: PagedAttentionMeta,
        output: torch.Tensor,
    ) -> AttentionInputs: ...

    def _on_attention_finished(self, spec: LayerSpec, output: torch.Tensor) -> torch.Tensor:
        """Default: the output stands as computed."""
        return output

    def _on_execute_finished(self, logits_indices: torch.Tensor) -> torch.Tensor:
        """Default: logits indices unchanged."""
        return logits_indices

    @abstractmethod
    def _on_request_finished_in_worker(self, request_id: str) -> None: ...
