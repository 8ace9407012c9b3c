"""Peer benchmark: LMCache 0.5.6's standalone server (`lmcache server`), driven by LMCache's own client.

Why this exists: UCM's design competes with LMCache's multiprocess server, so our daemon's numbers mean
little without the same figures for LMCache measured on the same machine in the same session. This
script runs only in LMCache's own venv (``scripts/setup_lmcache.sh`` makes ``.venv-lmcache``; LMCache
pins protobuf<7 and numpy<=2.2.6, which clash with ours). The main venv calls it through
``benchmarks.peers.lmcache.run_lmcache_peer`` and parses the JSON it prints.

What it does:
  1. starts ``lmcache server --l1-size-gb 2 --eviction-policy LRU --port P --http-port H`` on free
     loopback ports (``LMCACHE_TRACK_USAGE=false``) and waits until the ZMQ endpoint answers;
  2. connects with the client that vLLM's ``LMCacheMPConnector`` uses: ``RequestClientFactory``
     (ZMQ) plus ``LMCacheDrivenTransferContext``. On CPU this migrates the client's paged KV tensors
     into POSIX shared memory at REGISTER_KV_CACHE; STORE / RETRIEVE then name block ids and the
     *server* copies between its L1 and those shared pages (server-side copy through shared memory);
  3. measures, and always stops the server (normal exit, error, Ctrl-C or SIGTERM).

KV layout: one LMCache chunk is ``server_chunk_tokens`` tokens (256 by default) of ``--layers``
layers, each a vLLM NHD tensor ``(2, num_blocks, 16, heads, 128)`` float16, sized so that one chunk is
exactly ``--chunk-bytes`` bytes (default 1 layer x 8 heads: a Llama-style GQA layer, so the server
copies the same 32 KiB contiguous pieces per block and layer that a real model gives it). Layout
matters: LMCache copies per layer and per block, so splitting the same 1 MiB over 32 layers (1 KiB
pieces) makes its stores about 3x slower here. Every store uses token ids not seen before, so
LMCache cannot skip it as a duplicate.

JSON printed on stdout (one object; every value is a number):
  chunks, chunk_bytes, layers, lookup_keys, repeat   the run's parameters
  server_chunk_tokens                               tokens per LMCache chunk (from the server)
  server_start_s                                    server launch until its ZMQ endpoint answered
  store_per_chunk_gbps    N chunks stored, one STORE request per chunk, sent and awaited in turn
  store_batch_gbps        N chunks stored in one STORE request
  retrieve_per_chunk_gbps N chunks retrieved, one RETRIEVE request per chunk, in turn
  retrieve_batch_gbps     N chunks retrieved in one RETRIEVE request
  store_visible_after_s   worst time, after a STORE returned, until a LOOKUP saw every chunk of it
  lookup_one_p50_ms       p50 of a one-chunk LOOKUP that hits: LOOKUP + QUERY_PREFETCH_STATUS polls
                          until the hit count arrives (what the connector's scheduler side waits for)
  lookup_prefix_p50_ms    p50 of one LOOKUP of a ``lookup_keys``-chunk prefix that fully hits
  lookup_prefix_hit_chunks hit count that prefix lookup returned (should equal lookup_keys)
  memcpy_gbps             numpy copy of the same N x S bytes into touched memory, same process
                          (median of samples taken before and after the transfers)
  store_batch_vs_memcpy, retrieve_batch_vs_memcpy   the batched figures over memcpy_gbps
GB/s figures are 1e9 bytes per second, medians over ``--repeat`` rounds. Diagnostics go to stderr.
The prefix-lookup set uses a tiny second KV layout (16 KiB chunks, its own model name) so that
2,048 fully-hitting chunks fit in the 2 GB L1 next to the transfer sets; a lookup's work in LMCache
(token hashing, index probes, read-lock bookkeeping) scales with tokens and chunks, and is not
expected to depend on chunk bytes (not measured separately).

Usage (after ``scripts/setup_lmcache.sh``)::

    .venv-lmcache/bin/python benchmarks/peers/lmcache_peer.py [--chunks 256] [--chunk-bytes 1048576]
        [--lookup-keys 2048] [--repeat 3] [--layers 1]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The server process's half sits next to this file (run as a script, this directory is first on
# sys.path); it imports nothing of LMCache.
from lmcache_server import (
    LMCacheServer,
    free_port,
    log,
    signals_as_interrupt,
    sweep_stale_shm,
)

# This file also sits next to ``lmcache.py`` (the main-venv runner), which ``import lmcache`` would
# find instead of the LMCache package; drop the directory before anything imports lmcache.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if (Path(p) if p else Path.cwd()).resolve() != _HERE]

import numpy as np  # noqa: E402  (after the sys.path fix on purpose)

BLOCK_TOKENS = 16  # vLLM's default block size
HEAD_SIZE = 128
MODEL_NAME = "ucm-peer-bench"
LOOKUP_MODEL_NAME = "ucm-peer-bench-lookup"
LOOKUP_BYTES_PER_TOKEN = 64  # tiny layout for the prefix-lookup set: (2, nb, 16, 1, 16) float16
INSTANCE_ID = 4242
LOOKUP_INSTANCE_ID = 4243
RPC_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 90.0
VISIBLE_TIMEOUT_S = 30.0
MEMCPY_SAMPLES = 5


@dataclass(frozen=True)
class Layout:
    """Paged KV geometry whose LMCache chunk is exactly ``chunk_bytes`` bytes."""

    layers: int
    heads: int
    head_size: int
    chunk_tokens: int
    num_blocks: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // BLOCK_TOKENS

    @staticmethod
    def for_chunks(chunks: int, chunk_bytes: int, chunk_tokens: int, layers: int) -> Layout:
        # bytes per chunk = tokens * layers * 2 (K and V) * hidden * 2 (float16)
        denom = chunk_tokens * layers * 2 * 2
        if chunk_tokens % BLOCK_TOKENS or chunk_bytes % denom:
            raise ValueError(
                f"--chunk-bytes {chunk_bytes} is not a multiple of {denom} "
                f"({chunk_tokens} tokens x {layers} layers x K,V x float16)"
            )
        hidden = chunk_bytes // denom
        heads, head_size = (hidden // HEAD_SIZE, HEAD_SIZE) if hidden % HEAD_SIZE == 0 else (1, hidden)
        return Layout(layers, heads, head_size, chunk_tokens, chunks * (chunk_tokens // BLOCK_TOKENS))


def make_tokens(seed: int, n: int) -> list[int]:
    """Distinct token ids per seed: LMCache hashes chunks as a prefix chain from the first token."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(1, 32000, size=n, dtype=np.int64)
    toks[0] = 100_000 + seed
    return [int(t) for t in toks]


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class PeerClient:
    """LMCache's own MP client pieces, wired as ``LMCacheMPWorkerAdapter`` wires them."""

    def __init__(self, port: int) -> None:
        import torch
        import zmq  # type: ignore[import-not-found,unused-ignore]
        from lmcache.utils import EngineType  # type: ignore[import-not-found,unused-ignore]
        from lmcache.v1.multiprocess.custom_types import (  # type: ignore[import-not-found,unused-ignore]
            IPCCacheServerKey,
        )
        from lmcache.v1.multiprocess.group_view import (  # type: ignore[import-not-found,unused-ignore]
            EngineGroupInfo,
        )
        from lmcache.v1.multiprocess.transfer_context import (  # type: ignore[import-not-found,unused-ignore]
            LMCacheDrivenTransferContext,
        )
        from lmcache.v1.multiprocess.transport.factory import (  # type: ignore[import-not-found,unused-ignore]
            RequestClientFactory,
        )

        self._torch: Any = torch
        self._key_cls: Any = IPCCacheServerKey
        self._group_info_cls: Any = EngineGroupInfo
        self._ctx_cls: Any = LMCacheDrivenTransferContext
        self._engine_type: Any = EngineType.VLLM
        self._zmq: Any = zmq.Context()
        self._zmq.setsockopt(zmq.LINGER, 0)
        self.client: Any = RequestClientFactory.create(f"tcp://localhost:{port}", context=self._zmq)
        self._contexts: list[Any] = []
        self._request_seq = 0

    def wait_ready(self, server: LMCacheServer, timeout_s: float) -> int:
        """Poll GET_CHUNK_SIZE until the server answers; returns its chunk size in tokens."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not server.alive():
                raise RuntimeError(f"lmcache server exited during start-up; log tail:\n{server.log_tail()}")
            try:
                return int(self.client.get_chunk_size().result(timeout=1.0))
            except Exception as exc:  # LMCacheTimeoutError until the server binds its socket
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"lmcache server not ready after {timeout_s:.0f}s ({exc!r}); log tail:\n"
                        f"{server.log_tail()}"
                    ) from exc

    def register(self, instance_id: int, model: str, layout: Layout) -> KVTarget:
        """Allocate paged KV tensors and REGISTER_KV_CACHE them (they move into POSIX shm here)."""
        torch = self._torch
        shape = (2, layout.num_blocks, BLOCK_TOKENS, layout.heads, layout.head_size)
        kv = {
            f"model.layers.{i}.self_attn": torch.empty(shape, dtype=torch.float16)
            for i in range(layout.layers)
        }
        for t in kv.values():  # random bytes, written once, so every page is real
            raw = t.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
        ctx = self._ctx_cls(instance_id, self.client)
        self._contexts.append(ctx)  # before register(): close() must unregister a half-registered one
        groups = [
            self._group_info_cls(
                engine_group_id=0, layer_indices=tuple(range(layout.layers)), tokens_per_block=BLOCK_TOKENS
            )
        ]
        ctx.register(
            kv,
            model,
            1,
            layout.blocks_per_chunk,
            RPC_TIMEOUT_S,
            layout_hints={"kv_layout": "NHD"},
            engine_group_infos=groups,
            engine_type=self._engine_type,
        )
        # Views of the shm pages the server reads and writes (REGISTER moved the tensors there).
        raw_views = [t.view(torch.uint8).numpy().reshape(-1) for t in kv.values()]
        return KVTarget(model, layout, ctx, kv, raw_views)

    def new_request_id(self, tag: str) -> str:
        self._request_seq += 1
        return f"ucm-peer-{tag}-{self._request_seq}"

    def key(self, target: KVTarget, tokens: Sequence[int], chunks: tuple[int, int], request_id: str) -> Any:
        """Key for chunks [first, last) of a token sequence; carries the whole prefix, as vLLM's does."""
        start, end = chunks[0] * target.layout.chunk_tokens, chunks[1] * target.layout.chunk_tokens
        return self._key_cls(
            model_name=target.model,
            world_size=1,
            worker_id=0,
            token_ids=tuple(tokens[:end]),
            start=start,
            end=end,
            request_id=request_id,
            num_kv_readers=1,
        )

    def transfer(self, target: KVTarget, op: str, key: Any) -> None:
        """One STORE or RETRIEVE request for the key's chunks, awaited; raises unless it succeeded.

        Chunk i of a key lives in blocks [i * blocks_per_chunk, (i + 1) * blocks_per_chunk).
        """
        bpc = target.layout.blocks_per_chunk
        first = key.start // target.layout.chunk_tokens
        last = key.end // target.layout.chunk_tokens
        block_ids = [list(range(first * bpc, last * bpc))]
        event = target.ctx.create_recorded_event()
        if op == "store":
            fut = target.ctx.submit_store(key.request_id, key, target.kv, block_ids, event, bpc)
        else:
            fut = target.ctx.submit_retrieve(key.request_id, key, target.kv, block_ids, event, bpc)
        ok = fut.result(timeout=RPC_TIMEOUT_S)
        del event  # kept alive until the server answered, as the adapter does
        if ok is not True:
            raise RuntimeError(f"{op} of tokens [{key.start}, {key.end}) returned {ok!r}")

    def lookup(self, key: Any) -> int:
        """LOOKUP then QUERY_PREFETCH_STATUS until it answers: the scheduler-side hit check.

        Returns the hit count in chunks. The read locks it takes are released by a RETRIEVE or by
        ``release``.
        """
        lk = key.no_worker_id_version()
        self.client.lookup(lk, 1).result(timeout=RPC_TIMEOUT_S)
        while True:
            hits = self.client.query_prefetch_status(lk.request_id).result(timeout=RPC_TIMEOUT_S)
            if hits is not None:
                return int(hits)

    def release(self, key: Any, hits: int) -> None:
        """Drop a lookup's read locks and its session, as the connector does for a finished request."""
        lk = key.no_worker_id_version()
        if hits:
            self.client.free_lookup_locks(lk, 1).result(timeout=RPC_TIMEOUT_S)
        self.end_session(lk.request_id)

    def end_session(self, request_id: str) -> None:
        self.client.end_session(request_id).result(timeout=RPC_TIMEOUT_S)

    def close(self) -> None:
        """Unregister and close everything; best effort, because it also runs on error paths."""
        for ctx in self._contexts:
            with contextlib.suppress(Exception):
                fut = ctx.unregister()
                if fut is not None:
                    fut.result(timeout=10.0)
            with contextlib.suppress(Exception):
                ctx.close()  # unmaps and unlinks the client's shm segments
        self._contexts.clear()
        with contextlib.suppress(Exception):
            self.client.close()
        with contextlib.suppress(Exception):
            self._zmq.term()


@dataclass
class KVTarget:
    """One registered KV cache: the server copies chunks between its L1 and these shm pages."""

    model: str
    layout: Layout
    ctx: Any
    kv: dict[str, Any]
    raw_views: list[np.ndarray[Any, np.dtype[np.uint8]]]

    def zero(self) -> None:
        for view in self.raw_views:
            view.fill(0)

    def copy_to(self, dst: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        off = 0
        for view in self.raw_views:
            np.copyto(dst[off : off + view.size], view)
            off += view.size

    def equals(self, ref: np.ndarray[Any, np.dtype[np.uint8]]) -> bool:
        off = 0
        for view in self.raw_views:
            if not np.array_equal(view, ref[off : off + view.size]):
                return False
            off += view.size
        return True


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def run(args: argparse.Namespace) -> dict[str, float]:
    """Start the server, measure, stop the server; returns the JSON figures."""
    server = LMCacheServer(args.l1_size_gb, free_port(), free_port())
    peer: PeerClient | None = None
    try:
        t_start = time.monotonic()
        server.start()
        peer = PeerClient(server.port)  # the heavy lmcache/torch imports overlap the server's start-up
        chunk_tokens = peer.wait_ready(server, READY_TIMEOUT_S)
        server_start_s = time.monotonic() - t_start
        log(
            f"server ready on zmq :{server.port} / http :{server.http_port} in {server_start_s:.1f}s; "
            f"chunk = {chunk_tokens} tokens"
        )
        figures = Bench(args, peer, chunk_tokens).run()
        figures["server_start_s"] = round(server_start_s, 2)
        return figures
    finally:
        if peer is not None:
            peer.close()
        server.stop()


class Bench:
    """The measurements, in the order they run; each returns or records its own figures."""

    def __init__(self, args: argparse.Namespace, peer: PeerClient, chunk_tokens: int) -> None:
        self.args = args
        self.peer = peer
        self.n: int = args.chunks
        self.total: int = args.chunks * args.chunk_bytes
        self.chunk_tokens = chunk_tokens
        self._seed = 0

    def fresh_tokens(self, chunks: int) -> list[int]:
        self._seed += 1
        return make_tokens(self._seed, chunks * self.chunk_tokens)

    def run(self) -> dict[str, float]:
        args, n = self.args, self.n
        layout = Layout.for_chunks(n, args.chunk_bytes, self.chunk_tokens, args.layers)
        log(
            f"KV layout: {layout.layers} layer(s) x (2, {layout.num_blocks}, {BLOCK_TOKENS}, {layout.heads}, "
            f"{layout.head_size}) float16; {layout.blocks_per_chunk} blocks per chunk; "
            f"{n} x {args.chunk_bytes} B = {self.total / 2**20:.0f} MiB"
        )
        target = self.peer.register(INSTANCE_ID, MODEL_NAME, layout)

        # (e) memcpy baseline; its destination then serves as the reference for retrieves. Touched
        # first (np.zeros would hand out untouched pages and time page faults), sampled before and
        # after the transfers so that a burst of load from elsewhere cannot skew the ratio alone.
        reference = np.empty(self.total, dtype=np.uint8)
        reference.fill(1)
        target.copy_to(reference)
        copies = [gbps(self.total, timed(lambda: target.copy_to(reference))) for _ in range(MEMCPY_SAMPLES)]
        log(f"memcpy {statistics.median(copies):.2f} GB/s (before the transfers)")

        gb: dict[str, list[float]] = {}
        visible_after = 0.0
        last_tokens: list[int] = []
        for rnd in range(args.repeat):
            sets: dict[str, list[int]] = {}
            for mode in ("per_chunk", "batched"):  # (a)
                sets[mode] = last_tokens = self.fresh_tokens(n)
                secs = self.store(target, mode, sets[mode])
                visible = self.wait_visible(target, sets[mode], n)
                visible_after = max(visible_after, visible)
                gb.setdefault(f"store_{mode}", []).append(gbps(self.total, secs))
                log(
                    f"round {rnd}: store {mode}: {gbps(self.total, secs):.3f} GB/s ({secs * 1e3:.0f} ms), "
                    f"visible to lookup {visible:.3f}s after it returned"
                )
            for mode in ("per_chunk", "batched"):  # (b)
                verify = rnd == 0
                if verify:
                    target.zero()
                secs = self.retrieve(target, mode, sets[mode])
                if verify and not target.equals(reference):
                    raise RuntimeError(f"retrieve {mode}: the bytes retrieved differ from those stored")
                gb.setdefault(f"retrieve_{mode}", []).append(gbps(self.total, secs))
                log(
                    f"round {rnd}: retrieve {mode}: {gbps(self.total, secs):.3f} GB/s ({secs * 1e3:.0f} ms)"
                    + (", bytes verified" if verify else "")
                )

        one = self.lookup_one(target, last_tokens)  # (c)
        prefix, prefix_hits = self.lookup_prefix()  # (d)

        scratch = np.empty(self.total, dtype=np.uint8)
        scratch.fill(1)
        after = [gbps(self.total, timed(lambda: target.copy_to(scratch))) for _ in range(MEMCPY_SAMPLES)]
        log(f"memcpy {statistics.median(after):.2f} GB/s (after the transfers)")
        memcpy = statistics.median(copies + after)

        med = {k: statistics.median(v) for k, v in gb.items()}
        return {
            "chunks": float(n),
            "chunk_bytes": float(args.chunk_bytes),
            "layers": float(layout.layers),
            "lookup_keys": float(args.lookup_keys),
            "repeat": float(args.repeat),
            "server_chunk_tokens": float(self.chunk_tokens),
            "store_per_chunk_gbps": round(med["store_per_chunk"], 4),
            "store_batch_gbps": round(med["store_batched"], 4),
            "retrieve_per_chunk_gbps": round(med["retrieve_per_chunk"], 4),
            "retrieve_batch_gbps": round(med["retrieve_batched"], 4),
            "store_visible_after_s": round(visible_after, 3),
            "lookup_one_p50_ms": round(p50_ms(one), 3),
            "lookup_prefix_p50_ms": round(p50_ms(prefix), 3),
            "lookup_prefix_hit_chunks": float(prefix_hits),
            "memcpy_gbps": round(memcpy, 3),
            "store_batch_vs_memcpy": round(med["store_batched"] / memcpy, 4),
            "retrieve_batch_vs_memcpy": round(med["retrieve_batched"] / memcpy, 4),
        }

    def store(self, target: KVTarget, mode: str, tokens: list[int]) -> float:
        """Store all n chunks, one request per chunk (in turn) or one request; returns seconds."""
        rid = self.peer.new_request_id(f"store-{mode}")
        if mode == "batched":
            key = self.peer.key(target, tokens, (0, self.n), rid)
            return timed(lambda: self.peer.transfer(target, "store", key))
        keys = [self.peer.key(target, tokens, (i, i + 1), rid) for i in range(self.n)]

        def each() -> None:
            for k in keys:
                self.peer.transfer(target, "store", k)

        return timed(each)

    def retrieve(self, target: KVTarget, mode: str, tokens: list[int]) -> float:
        """Look the set up (untimed: the connector does it at scheduling), then time the retrieve."""
        rid = self.peer.new_request_id(f"retrieve-{mode}")
        full = self.peer.key(target, tokens, (0, self.n), rid)
        hits = self.peer.lookup(full)
        if hits != self.n:
            raise RuntimeError(f"retrieve {mode}: lookup found {hits}/{self.n} chunks")
        if mode == "batched":
            secs = timed(lambda: self.peer.transfer(target, "retrieve", full))
        else:
            keys = [self.peer.key(target, tokens, (i, i + 1), rid) for i in range(self.n)]

            def each() -> None:
                for k in keys:
                    self.peer.transfer(target, "retrieve", k)

            secs = timed(each)
        self.peer.end_session(rid)
        return secs

    def wait_visible(self, target: KVTarget, tokens: list[int], chunks: int) -> float:
        """Seconds from now until a lookup sees all ``chunks`` chunks of ``tokens``."""
        t0 = time.monotonic()
        while True:
            key = self.peer.key(target, tokens, (0, chunks), self.peer.new_request_id("visible"))
            hits = self.peer.lookup(key)
            self.peer.release(key, hits)
            if hits == chunks:
                return time.monotonic() - t0
            if time.monotonic() - t0 > VISIBLE_TIMEOUT_S:
                raise RuntimeError(
                    f"only {hits}/{chunks} chunks visible {VISIBLE_TIMEOUT_S:.0f}s after a store"
                )
            time.sleep(0.005)

    def lookup_one(self, target: KVTarget, tokens: list[int]) -> list[float]:
        """Latency samples of a one-chunk lookup that hits."""
        samples: list[float] = []
        for _ in range(self.args.lookup_iters):
            key = self.peer.key(target, tokens, (0, 1), self.peer.new_request_id("lookup1"))
            t0 = time.perf_counter()
            hits = self.peer.lookup(key)
            samples.append(time.perf_counter() - t0)
            self.peer.release(key, hits)
            if hits != 1:
                raise RuntimeError(f"one-key lookup hit {hits} chunks, expected 1")
        log(
            f"lookup one key: p50 {p50_ms(samples):.2f} ms, "
            f"min {min(samples) * 1e3:.2f} ms over {len(samples)}"
        )
        return samples

    def lookup_prefix(self) -> tuple[list[float], int]:
        """Latency samples of one lookup of a lookup_keys-chunk prefix, on a tiny layout of its own."""
        m = self.args.lookup_keys
        tiny = Layout(
            1, 1, LOOKUP_BYTES_PER_TOKEN // 4, self.chunk_tokens, m * (self.chunk_tokens // BLOCK_TOKENS)
        )
        target = self.peer.register(LOOKUP_INSTANCE_ID, LOOKUP_MODEL_NAME, tiny)
        tokens = self.fresh_tokens(m)
        rid = self.peer.new_request_id("store-lookup-set")
        for i in range(0, m, 256):  # set-up, not measured: store the set in requests of 256 chunks
            self.peer.transfer(target, "store", self.peer.key(target, tokens, (i, min(i + 256, m)), rid))
        self.wait_visible(target, tokens, m)
        samples: list[float] = []
        hits = 0
        for _ in range(self.args.prefix_iters):
            key = self.peer.key(target, tokens, (0, m), self.peer.new_request_id("lookupN"))
            t0 = time.perf_counter()
            hits = self.peer.lookup(key)
            samples.append(time.perf_counter() - t0)
            self.peer.release(key, hits)
        log(f"lookup {m}-chunk prefix: p50 {p50_ms(samples):.1f} ms over {len(samples)}, hits {hits}/{m}")
        return samples, hits


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--chunks", type=int, default=256, help="chunks per transfer set (N)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help="bytes per chunk (S)")
    p.add_argument("--lookup-keys", type=int, default=2048, help="chunks in the prefix lookup")
    p.add_argument("--repeat", type=int, default=3, help="rounds of store/retrieve (medians reported)")
    p.add_argument("--layers", type=int, default=1, help="KV layers a chunk is split over")
    p.add_argument("--lookup-iters", type=int, default=50, help="one-key lookups timed")
    p.add_argument("--prefix-iters", type=int, default=10, help="prefix lookups timed")
    p.add_argument("--l1-size-gb", type=float, default=2.0, help="server L1 size")
    args = p.parse_args(argv)
    for name in ("chunks", "chunk_bytes", "lookup_keys", "repeat", "layers", "lookup_iters", "prefix_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    # LMCache logs every wrap and store at INFO; keep our stderr readable (the server logs to its file).
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    try:
        with signals_as_interrupt():
            sweep_stale_shm()
            figures = run(args)
    except KeyboardInterrupt:
        log("interrupted; server stopped")
        return 130
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        log(f"FAILED: {exc}")
        return 1
    print(json.dumps(figures, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
