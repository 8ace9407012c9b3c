"""The machinery ESA, GSA and KVStarMultiStep share: per-block features, budgeted top-k, paged rewrite.

A block-sparse method differs from the others only in how it summarises a full KV block (its
*features*, computed once per block and cached, since a full block never changes) and how it scores
those features against the query. Everything else lives here once: the budget and windows, the
retrieval stride (between retrievals the previous selection is reused, extended by the moving local
window), the tensor-level decode used by tests and benchmarks, and the worker hook that turns a
selection into a shorter block table for vLLM's paged kernel.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ucm_client.sparse.base import (
    AttentionInputs,
    HeadTables,
    LayerSpec,
    PagedAttentionMeta,
    RequestSparseMeta,
    SparseMeta,
    SparseRequest,
    UcmSparseBase,
    UcmSparseRole,
)
from ucm_client.sparse.config import BlockBudget
from ucm_client.sparse.errors import SparseInputError
from ucm_client.sparse.kernels.attention import (
    ChannelCodes,
    aggregate_heads,
    blocks_to_tokens,
    channel_codes,
    group_query,
    norm_shrink,
    per_head_sparse_attention,
    select_blocks,
    select_blocks_per_head,
    sparse_decode_attention,
)
from ucm_client.sparse.kernels.paged import read_request_kv
from ucm_client.sparse.kernels.scoring import (
    compile_now,
    grouped_block_max,
    top_blocks,
    top_blocks_per_head,
    unit_directions,
)

__all__ = [
    "BlockResolver",
    "BlockSparseMethod",
    "BlockSparseSpec",
    "ChannelMajorFeatures",
    "DecodeResult",
    "DecodeState",
]


class BlockResolver(Protocol):
    """Where a selected block's KV is for the kernel, when some blocks live outside vLLM's cache.

    Cold KV (:class:`~ucm_client.sparse.coldkv.worker.ColdKVWorker`) implements it: a request's cold
    blocks are loaded into its scratch blocks and the table points there instead.
    """

    def is_cold(self, request_id: str) -> bool: ...

    def resolve_rows(
        self, layer_idx: int, rows: Sequence[tuple[str, torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Per row ``(request id, selected logical blocks, the row's physical blocks)``: the physical
        blocks the kernel reads for that selection, in order."""
        ...


class BlockSparseSpec(Protocol):
    """The settings every block-sparse spec carries (each method's frozen dataclass has them)."""

    @property
    def retrieval_stride(self) -> int: ...

    def budget(self) -> BlockBudget: ...


@dataclass(slots=True)
class DecodeState:
    """Per (request, layer) memory of a block-sparse method between decode steps."""

    step: int = 0
    selection: torch.Tensor | None = None
    """Logical block ids chosen at the last retrieval: ``[k]`` shared, or ``[kv_heads, k]`` per head."""
    selected_blocks: int = 0
    """Blocks the context had at the last retrieval (later ones join the reused selection)."""
    anchor: torch.Tensor | None = None
    """The per-KV-head query direction at the last retrieval, to notice the query drifting away."""
    drift_refreshes: int = 0
    features: torch.Tensor | None = None
    """Cached features of the first ``features_blocks`` full blocks."""
    features_blocks: int = 0
    queries: list[torch.Tensor] = field(default_factory=list)
    """Recent decode queries, newest last (methods that group queries over steps read these)."""
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    """Method-specific tensors fixed at the first retrieval (e.g. kept dimensions)."""
    retrievals: int = 0


@dataclass(frozen=True, slots=True)
class DecodeResult:
    """One decode step of the tensor-level API."""

    output: torch.Tensor
    block_ids: torch.Tensor
    token_idx: torch.Tensor
    retrieved: bool


class BlockSparseMethod(UcmSparseBase):
    """Base of block-sparse methods; subclasses define ``_features`` and ``_score``."""

    spec: BlockSparseSpec
    prebuild_features = True
    """Feature blocks as prefill and decode fill them (False: only when a retrieval needs them)."""
    block_resolver: BlockResolver | None = None
    """Set by cold KV: maps selected logical blocks to where their KV is this layer (``None``: the row's
    own blocks)."""

    def __init__(self, role: UcmSparseRole, config: Mapping[str, Any], *, min_seq_len: int = 0) -> None:
        super().__init__(role, config, min_seq_len=min_seq_len)
        self.spec = self._parse_spec(config)
        self._budget = self.spec.budget()
        self._sched_tokens: dict[str, int] = {}
        self._sched_steps: dict[str, int] = {}
        self._states: dict[tuple[str, int], DecodeState] = {}
        self._step_meta: SparseMeta | None = None
        self._rows_seen: set[str] = set()
        self.stats = {
            "sparse_rows": 0,
            "dense_rows": 0,
            "retrievals": 0,
            "drift_refreshes": 0,
            "feature_blocks": 0,
            "features_at_retrieval": 0,
        }
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pending_features: dict[
            int, list[tuple[DecodeState, int, Callable[[int, int], torch.Tensor]]]
        ] = {}
        if role is UcmSparseRole.WORKER:
            compile_now()  # the scoring loops, at engine start rather than at the first retrieval

    # ------------------------------------------------------------ algorithm
    @abstractmethod
    def _parse_spec(self, config: Mapping[str, Any]) -> BlockSparseSpec: ...

    @abstractmethod
    def _features(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        """Features of whole blocks; ``keys`` is ``[m * block_size, kv_heads, D]``, result ``[m, ...]``."""

    @abstractmethod
    def _score(self, queries: torch.Tensor, features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Scores ``[kv_heads, m]`` of ``m`` featured blocks for ``queries`` ``[G, num_heads, D]``."""

    def extend_features(
        self,
        state: DecodeState,
        num_tokens: int,
        block_size: int,
        read_keys: Callable[[int, int], torch.Tensor],
    ) -> int:
        """Feature every full block of the first ``num_tokens`` not featured yet; returns the featured blocks.

        Called at prefill (after the layer's attention wrote the prompt's KV) and whenever a block
        fills during decode, so a retrieval never has to feature the whole context at once (before:
        82 / 168 / 353 ms per layer on the first decode step at 8k / 16k / 32k).
        """
        full = num_tokens // block_size
        if full > state.features_blocks:
            start = state.features_blocks * block_size
            new_features = self._features(read_keys(start, full * block_size), block_size, state)
            self.stats["feature_blocks"] += full - state.features_blocks
            state.features = (
                new_features
                if state.features is None
                else self._append_features(state.features, new_features)
            )
            state.features_blocks = full
            self._features_added(state, new_features)
        return state.features_blocks

    def _append_features(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Features of blocks that filled since, after the cached ones (block-major by default)."""
        return torch.cat([old, new])

    def _features_added(self, state: DecodeState, new: torch.Tensor) -> None:
        """Derive what a retrieval will need from blocks just featured (at prefill, as blocks fill)."""

    def _queries_for_retrieval(self, state: DecodeState) -> torch.Tensor:
        """The queries retrieval scores against: by default only the newest."""
        return state.queries[-1][None]

    def _history_len(self) -> int:
        return 1

    # ------------------------------------------------------------ tensor API
    def select(
        self,
        query: torch.Tensor,
        num_tokens: int,
        state: DecodeState,
        block_size: int,
        read_keys: Callable[[int, int], torch.Tensor],
        *,
        retrieve: bool | None = None,
        per_head: bool = False,
        written_tokens: int | None = None,
    ) -> tuple[torch.Tensor, bool]:
        """Block ids for this decode step, and whether retrieval ran (else the last selection was reused).

        ``read_keys(start, end)`` returns keys of tokens ``[start, end)``; it is called only for blocks
        that filled up since the last retrieval, so callers whose keys live elsewhere (paged cache,
        daemon) read each block once. ``retrieve`` is the scheduler's decision when it made one
        (``SparseMeta``); ``None`` counts ``retrieval_stride`` locally. Either way a retrieval also
        runs when the query has drifted from the one the selection was made for (cosine per KV head
        below ``drift_cosine``), since a kept selection is only as good as the query it answered.
        ``per_head``: one block list per KV head (``[kv_heads, k]``), else one shared list (``[k]``,
        what a paged kernel's block table can express). ``written_tokens``: how many tokens
        ``read_keys`` can already see (a paged cache receives this step's key only during attention);
        a block past it is scored once written, and is in the local window meanwhile.
        """
        device = query.device
        num_blocks = -(-num_tokens // block_size)
        state.queries.append(query)
        del state.queries[: -self._history_len()]
        state.step += 1
        keep = self._budget.num_kept(num_blocks)
        if keep >= num_blocks:
            state.selection = None
            return torch.arange(num_blocks, device=device), False
        if retrieve is None:
            retrieve = (state.step - 1) % self.spec.retrieval_stride == 0
        drift = self._drift_cosine()
        direction: torch.Tensor | None = None
        if drift != 0.0 and state.selection is not None and not retrieve and state.anchor is not None:
            direction = self._direction(query, state.anchor.shape[0])
            if _min_cosine(direction, state.anchor) < drift:
                retrieve = True
                state.drift_refreshes += 1
                self.stats["drift_refreshes"] += 1
                del state.queries[:-1]  # older queries point elsewhere now: score for the new one
        if state.selection is not None and not retrieve and (state.selection.dim() == 2) == per_head:
            new = torch.arange(state.selected_blocks, num_blocks, device=device)
            if per_head:
                new = new[None].expand(state.selection.shape[0], -1)
            return torch.cat([state.selection, new], dim=-1), False
        before = state.features_blocks
        full = self.extend_features(
            state, num_tokens if written_tokens is None else written_tokens, block_size, read_keys
        )
        self.stats["features_at_retrieval"] += full - before  # work a decode step waited for
        assert state.features is not None and full  # keep < num_blocks implies a written full block
        if len(state.queries) > 1:
            # A query group serves the coming steps only while it points where the newest one does:
            # keep the queries within half the drift threshold's angle of it.
            kv_heads = state.anchor.shape[0] if state.anchor is not None else self._kv_heads(state.features)
            newest = self._direction(query, kv_heads)
            tight = (1.0 + self._drift_cosine()) / 2
            state.queries[:] = [
                q for q in state.queries if _min_cosine(self._direction(q, kv_heads), newest) >= tight
            ]
        block_scores = self._score(self._queries_for_retrieval(state), state.features, state)
        heads = block_scores.shape[0]
        init, local = self._budget.init_window_sz, self._budget.local_window_sz
        if block_scores.device.type == "cpu":  # one compiled call, the host's case
            host = block_scores.float().contiguous().numpy()
            if per_head:
                chosen = torch.empty(heads, num_blocks, dtype=torch.int64)
                count = top_blocks_per_head(host, num_blocks, keep, init, local, chosen.numpy())
                state.selection = chosen[:, :count]
            else:
                chosen = torch.empty(num_blocks, dtype=torch.int64)
                count = top_blocks(host, num_blocks, keep, init, local, chosen.numpy())
                state.selection = chosen[:count]
        else:
            scores = torch.full((heads, num_blocks), float("-inf"), dtype=torch.float32, device=device)
            scores[:, :full] = block_scores
            if per_head:
                state.selection = select_blocks_per_head(scores, keep, init, local)
            else:
                state.selection = select_blocks(aggregate_heads(scores), keep, init, local)
        state.selected_blocks = num_blocks
        if direction is None or direction.shape[0] != heads:
            direction = self._direction(query, heads)
        state.anchor = direction
        state.retrievals += 1
        self.stats["retrievals"] += 1
        return state.selection, True

    def _kv_heads(self, features: torch.Tensor) -> int:
        """KV heads in ``features`` (axis 1 of block-major features; channel-major ones override)."""
        return int(features.shape[1])

    def _drift_cosine(self) -> float:
        return float(getattr(self.spec, "drift_cosine", 0.0))

    @staticmethod
    def _direction(query: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """Unit direction of each KV head's summed query group ``[kv_heads, D]``."""
        if query.device.type == "cpu":
            out = torch.empty(kv_heads, query.shape[-1])
            unit_directions(query.float().contiguous().numpy(), kv_heads, out.numpy())
            return out
        q = group_query(query.float(), kv_heads).sum(dim=1)
        unit: torch.Tensor = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return unit

    def decode(
        self,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        *,
        state: DecodeState,
        block_size: int,
        scale: float,
        per_head: bool = False,
    ) -> DecodeResult:
        """One decode step over token-major KV: select blocks, then exact attention over them.

        ``per_head``: each KV head attends to its own blocks (``block_ids`` ``[kv_heads, k]``,
        ``token_idx`` ``[kv_heads, k * block_size]`` clipped to the context).
        """
        block_ids, retrieved = self.select(
            query, keys.shape[0], state, block_size, lambda start, end: keys[start:end], per_head=per_head
        )
        if block_ids.dim() == 2:
            out = per_head_sparse_attention(query, keys, values, block_ids, block_size, scale)
            tokens = (
                block_ids[:, :, None] * block_size + torch.arange(block_size, device=keys.device)
            ).flatten(1)
            return DecodeResult(output=out, block_ids=block_ids, token_idx=tokens, retrieved=retrieved)
        tokens = blocks_to_tokens(block_ids, block_size, keys.shape[0])
        out = sparse_decode_attention(
            query, keys, values, tokens, scale, workspace=self._gather_workspace(keys, tokens.numel())
        )
        return DecodeResult(output=out, block_ids=block_ids, token_idx=tokens, retrieved=retrieved)

    def _gather_workspace(self, like: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused K/V gather buffers, grown to the largest selection seen."""
        ws = self._workspace
        if (
            ws is None
            or ws[0].shape[0] < rows
            or ws[0].shape[1:] != like.shape[1:]
            or ws[0].dtype != like.dtype
        ):
            shape = (rows, *like.shape[1:])
            ws = (like.new_empty(shape), like.new_empty(shape))
            self._workspace = ws
        return ws

    # ------------------------------------------------------------ scheduler
    def _on_request_begin(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self._sched_tokens[request_id] = len(prompt_token_ids)
        self._sched_steps[request_id] = 0

    def _on_estimate_num_slots_sparsed(self, request: SparseRequest) -> int:
        block = self._scheduler_block_size()
        blocks = -(-request.num_tokens // block)
        if request.num_tokens < self.min_seq_len:
            return blocks * block
        return self._budget.num_kept(blocks) * block

    def _scheduler_block_size(self) -> int:
        size = self.config.get("block_size", 128)
        return int(size) if isinstance(size, int) else 128

    def _on_build_sparse_meta(
        self,
        scheduler_output: Any,
        seq_group_metadata_list: Sequence[SparseRequest],
        request_metas: Mapping[str, Any],
    ) -> SparseMeta:
        out: dict[str, RequestSparseMeta] = {}
        for req in seq_group_metadata_list:
            step = self._sched_steps.get(req.request_id, 0)
            out[req.request_id] = RequestSparseMeta(
                request_id=req.request_id,
                num_tokens=req.num_tokens,
                retrieve=step % self.spec.retrieval_stride == 0,
            )
            self._sched_steps[req.request_id] = step + 1
        return SparseMeta(requests=out)

    def _on_request_finished_in_scheduler(self, request_id: str) -> None:
        self._sched_tokens.pop(request_id, None)
        self._sched_steps.pop(request_id, None)

    # ------------------------------------------------------------ worker
    def _on_execute_begin(self, scheduler_output: SparseMeta | None) -> None:
        self._step_meta = scheduler_output
        self._rows_seen.clear()

    def _on_attention_begin(
        self,
        spec: LayerSpec,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        meta: PagedAttentionMeta,
        output: torch.Tensor,
    ) -> AttentionInputs:
        if self._budget.sparse_ratio >= 1.0:
            return AttentionInputs(query, key, value, output)  # never sparse: no state, no features
        cache = self._kv_caches[spec.layer_idx]
        qsl = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        new_table: torch.Tensor | None = None
        new_lens: torch.Tensor | None = None
        selections: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []
        pending = self._pending_features[spec.layer_idx] = []
        for row, row_key in enumerate(meta.row_keys):
            n = int(seq_lens[row])
            if row_key is None or n < max(self.min_seq_len, 1):
                self.stats["dense_rows"] += 1
                continue  # unknown request, or short: dense, and no features yet
            self._rows_seen.add(row_key)
            num_blocks = -(-n // spec.block_size)
            blocks = meta.block_table[row, :num_blocks]
            state = self._row_state(row_key, spec.layer_idx, blocks)
            read_keys = self._paged_reader(cache, spec, blocks)
            pending.append((state, n, read_keys))  # feature new full blocks once written
            if qsl[row + 1] - qsl[row] != 1 or self._budget.num_kept(num_blocks) >= num_blocks:
                if self.block_resolver is not None and self.block_resolver.is_cold(row_key):
                    raise SparseInputError(
                        f"request {row_key} has cold blocks in the daemon but its step at layer "
                        f"{spec.layer_idx} would attend densely (stale block ids)"
                    )
                self.stats["dense_rows"] += 1
                continue  # prefill, or the budget covers everything: dense
            row_meta = self._step_meta.requests.get(row_key) if self._step_meta else None
            start = time.perf_counter()
            sel, _ = self.select(
                query[qsl[row]],
                n,
                state,
                spec.block_size,
                read_keys,
                retrieve=None if row_meta is None else row_meta.retrieve,
                per_head=meta.per_head,
                written_tokens=n - 1,  # this step's key reaches the cache during attention
            )
            self.clock.add("selection", time.perf_counter() - start)
            if new_table is None:
                new_table = meta.block_table.clone()
                new_lens = meta.seq_lens.clone()
            assert new_lens is not None
            selections.append((row, row_key, sel, blocks))
            tail = n - (num_blocks - 1) * spec.block_size  # tokens in the partial last block
            # Per KV head: the row's own batch call attends its last block only (its output is
            # overwritten by the per-head call), so it costs the kernel next to nothing.
            kept = 1 if sel.dim() == 2 else sel.numel()
            new_lens[row] = (kept - 1) * spec.block_size + tail
            self.stats["sparse_rows"] += 1
        if new_table is None or new_lens is None:
            return AttentionInputs(query, key, value, output)
        # All rows' selections at once: a resolver that loads blocks does it in one batched task.
        resolver = self.block_resolver
        physical = (
            [blocks[sel] for _, _, sel, blocks in selections]
            if resolver is None
            else resolver.resolve_rows(
                spec.layer_idx, [(key, sel, blocks) for _, key, sel, blocks in selections]
            )
        )
        heads: list[tuple[int, torch.Tensor]] = []
        for (row, _, sel, blocks), ids in zip(selections, physical, strict=True):
            if sel.dim() == 2:
                new_table[row, 0] = blocks[-1]  # the local window's last block: never cold
                heads.append((row, ids))
            else:
                new_table[row, : sel.numel()] = ids
        return AttentionInputs(
            query,
            key,
            value,
            output,
            block_table=new_table,
            seq_lens=new_lens,
            head_tables=_head_tables(heads, new_lens, spec.block_size) if heads else None,
        )

    def _row_state(self, row_key: str, layer_idx: int, blocks: torch.Tensor) -> DecodeState:
        state = self._states.setdefault((row_key, layer_idx), DecodeState())
        known = state.aux.get("block_ids")
        if known is not None and not torch.equal(known, blocks[: known.numel()]):
            # The row key now names another request (a surrogate key was reused, or the request was
            # preempted and its blocks reallocated): start afresh.
            state = self._states[(row_key, layer_idx)] = DecodeState()
        state.aux["block_ids"] = blocks.clone()
        return state

    @staticmethod
    def _paged_reader(
        cache: torch.Tensor, spec: LayerSpec, blocks: torch.Tensor
    ) -> Callable[[int, int], torch.Tensor]:
        def read_keys(start: int, end: int) -> torch.Tensor:
            first = start // spec.block_size
            keys, _ = read_request_kv(
                cache, blocks[first : -(-end // spec.block_size)], end - first * spec.block_size, spec.layout
            )
            return keys[start - first * spec.block_size :]

        return read_keys

    def _on_attention_finished(self, spec: LayerSpec, output: torch.Tensor) -> torch.Tensor:
        # The layer's KV is in the cache now: feature the blocks that prefill or decode just filled,
        # so no retrieval pays for many blocks at once.
        pending = self._pending_features.pop(spec.layer_idx, [])
        if self.prebuild_features:
            with self.clock.time("features"):
                for state, n, read_keys in pending:
                    self.extend_features(state, n, spec.block_size, read_keys)
        return output

    def _on_execute_finished(self, logits_indices: torch.Tensor) -> torch.Tensor:
        if self._step_meta is None:
            # Without the scheduler's channel no request_finished reaches the worker: drop the state
            # of rows that did not run this step, so finished requests do not accumulate.
            for key in [k for k in self._states if k[0] not in self._rows_seen]:
                del self._states[key]
        return logits_indices

    def _on_request_finished_in_worker(self, request_id: str) -> None:
        for key in [k for k in self._states if k[0] == request_id]:
            del self._states[key]


class ChannelMajorFeatures(BlockSparseMethod):
    """Features kept as int8 ``[kv_heads, channels, tokens]`` codes (``kernels.channel_codes``): blocks
    append along the token axis; their per-block scales and the keys' squared norms are kept beside
    them in ``state.aux`` (``scales``, ``sq_norms``), extended as blocks are featured."""

    def _code(self, keys: torch.Tensor, block_size: int, state: DecodeState) -> torch.Tensor:
        """Code whole blocks of token-major keys ``[m * block_size, H, C]``; returns the codes and
        leaves the scales and squared norms for :meth:`_features_added` to append."""
        # Squared norms as blocks are featured, so the first retrieval does not compute them for
        # the whole context (measured: +136 ms on the first decode step at 32k, D 128).
        coded, state.aux["new_sq_norms"] = channel_codes(keys, block_size)
        state.aux["block_size"] = torch.tensor(block_size)
        state.aux["new_scales"] = coded.scales
        return coded.codes

    def _append_features(self, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        return torch.cat([old, new], dim=-1)

    def _kv_heads(self, features: torch.Tensor) -> int:
        return int(features.shape[0])

    def _features_added(self, state: DecodeState, new: torch.Tensor) -> None:
        for name in ("scales", "sq_norms"):
            fresh = state.aux.pop(f"new_{name}")
            kept = state.aux.get(name)
            state.aux[name] = fresh if kept is None else torch.cat([kept, fresh], dim=-1)

    def _host_scores(
        self,
        queries: torch.Tensor,
        features: torch.Tensor,
        state: DecodeState,
        dims: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``scale`` × each block's best approximate logit ``[G, H, m]`` for ``queries`` ``[G, num_heads,
        D]`` in one compiled call (:func:`~ucm_client.sparse.kernels.scoring.grouped_block_max`);
        ``dims`` ``[H, R]`` names the query channel of each feature row."""
        block_size = int(state.aux["block_size"])
        out = torch.empty(queries.shape[0], features.shape[0], features.shape[-1] // block_size)
        grouped_block_max(
            queries.float().contiguous().numpy(),
            dims.numpy(),
            self.spec.score_channels,  # type: ignore[attr-defined]
            features.numpy(),
            state.aux["scales"].numpy(),
            self._shrink(features, state).float().contiguous().numpy(),
            block_size,
            scale,
            out.numpy(),
        )
        return out

    @staticmethod
    def _coded(features: torch.Tensor, state: DecodeState) -> ChannelCodes:
        return ChannelCodes(features, state.aux["scales"])

    @staticmethod
    def _shrink(features: torch.Tensor, state: DecodeState) -> torch.Tensor:
        """Each featured token's :func:`~ucm_client.sparse.kernels.attention.norm_shrink` factor ``[H, n]``.

        Recomputed only when tokens were featured since the last retrieval (the median moves only
        then), so most retrievals read them instead of recomputing them.
        """
        n = features.shape[-1]
        shrink = state.aux.get("shrink")
        if shrink is None or shrink.shape[-1] != n:
            state.aux["shrink"] = shrink = norm_shrink(state.aux["sq_norms"])
        return shrink


def _head_tables(rows: list[tuple[int, torch.Tensor]], lens: torch.Tensor, block_size: int) -> HeadTables:
    """The per-KV-head rows of a step: each row's ``[kv_heads, k]`` physical blocks, padded to the
    longest; every head of a row attends ``k - 1`` full blocks and the row's partial last one."""
    longest = max(ids.shape[-1] for _, ids in rows)
    table = torch.zeros(len(rows), rows[0][1].shape[0], longest, dtype=torch.int32)
    seq_lens = torch.empty(len(rows), dtype=torch.int32)
    for i, (row, ids) in enumerate(rows):
        table[i, :, : ids.shape[-1]] = ids
        seq_lens[i] = (ids.shape[-1] - 1) * block_size + int(lens[row])  # lens holds the tail now
    index = torch.tensor([row for row, _ in rows], dtype=torch.int64)
    return HeadTables(rows=index, block_table=table, seq_lens=seq_lens)


def _min_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """The smallest per-KV-head cosine of two sets of unit directions ``[kv_heads, D]`` (numpy on the
    host: one call instead of three small torch operations on a decode step's path)."""
    if a.device.type == "cpu" and b.device.type == "cpu":
        return float((a.numpy() * b.numpy()).sum(-1).min())
    return float((a * b).sum(-1).min())
