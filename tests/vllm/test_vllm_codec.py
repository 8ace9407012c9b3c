"""Compression at rest end to end: greedy tokens of the tiny Llama with its KV (bf16) loaded from a
Posix tier compressed to fp8, against the same without compression and without any connector.

Each store is filled by one fresh vLLM process; a fresh daemon on the same data then serves a second
fresh vLLM process (its Cache empty: every hit is read from the Posix tier, decoded). The random
weight model may be sensitive to fp8's rounding, so what is asserted is what is robust: the
compressed run completes and hits, its blocks on disk are encoded, the uncompressed control matches
the baseline exactly, and the first generated token of each prompt matches; the full token match is
recorded (``codec_tokens.json`` in the test's directory) and reported.

Exact means against a run that splits each prompt the same way between loaded and computed tokens.
A prompt of whole blocks is loaded but for its last token, which is computed alone; vLLM's own prefix
cache recomputes that whole last block instead. In float32 both give the same tokens; in bfloat16 on
a CPU with AMX, vLLM's kernels round a one-token step and a 128-token step differently, and greedy
tokens then part after a few steps (seen: the 3rd of 16), with the stored bytes exact. So the filling
process runs every prompt twice: its first pass computes from scratch (the baseline's split), its
second reuses the KV with the split a fresh loading process has (its own cache for the blocks
before, the connector for the rest).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.posix_files import all_stored, read_payload
from support.vllm_process import P1, P_FULL, copy_model, last_metric, run_vllm, start_daemon

from ucm_server.store import codec

pytestmark = pytest.mark.vllm

HITS = "vllm:external_prefix_cache_hits"
CODEC = ("--codec-tiers", "Posix", "--codec-dtype", "bfloat16")
PROMPTS = [P1, P_FULL]


def _spec(model: Path, connector: bool, passes: int = 1) -> dict[str, object]:
    return {
        "model": str(model),
        "prompts": PROMPTS * passes,
        "connector": connector,
        "dtype": "bfloat16",  # the KV cache's too (kv_cache_dtype alone keeps it float32 on CPU)
        "max_tokens": 16,
    }


def _reload(root: Path, model: Path, *args: str) -> tuple[dict[str, object], list[str]]:
    """Fill a store, then load from it in a fresh process through a fresh daemon (empty Cache)."""
    daemon = start_daemon(root / "daemon", *args)
    try:
        fill = run_vllm(root / "fill", _spec(model, True, passes=2), socket=daemon.socket)
    finally:
        daemon.stop()
    encodings = [codec.describe(read_payload(block)) for block in all_stored(daemon.data_dir / "blocks")]
    daemon = start_daemon(root / "daemon2", *args, data_dir=daemon.data_dir)
    try:
        load = run_vllm(root / "load", _spec(model, True), socket=daemon.socket)
    finally:
        daemon.stop()
    first_pass = len(PROMPTS)
    assert fill["metrics"][first_pass - 1].get(HITS, 0) == 0, "the first pass found something stored"
    outputs = fill["outputs"]
    return {
        "fill": outputs[:first_pass],
        "reuse": outputs[first_pass:],
        "load": load["outputs"],
        "hits": last_metric(load, HITS),
    }, encodings


def test_greedy_tokens_with_kv_loaded_from_a_compressed_tier(tmp_path: Path, tiny_model: Path) -> None:
    model = copy_model(tiny_model, tmp_path / "model")
    baseline = run_vllm(tmp_path / "baseline", _spec(model, False), socket=None)["outputs"]
    plain, plain_enc = _reload(tmp_path / "plain", model)
    packed, packed_enc = _reload(tmp_path / "codec", model, *CODEC)

    # What fp8 changes: the compressed load against the raw one (the same split, see above).
    same = [
        sum(a == b for a, b in zip(x, y, strict=False))
        for x, y in zip(packed["load"], plain["load"], strict=True)
    ]
    # (a changed token may end the output early: shorter outputs diverge where they end)
    first_diff = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(packed["load"], plain["load"], strict=True)
    ]
    record = {
        "baseline": baseline,
        "plain": plain,
        "codec": packed,
        "codec_tokens_matching": same,
        "codec_first_divergence": first_diff,
        "encodings": {"plain": sorted(set(plain_enc)), "codec": sorted(set(packed_enc))},
    }
    (tmp_path / "codec_tokens.json").write_text(json.dumps(record, indent=1))
    print(
        "codec e2e:",
        json.dumps({k: record[k] for k in ("codec_tokens_matching", "codec_first_divergence", "encodings")}),
    )

    # The control: loads of raw KV are exact, so a fresh process's outputs are those of the process
    # that computed the KV when it reused it (the same split), and that one computed the baseline.
    assert plain["hits"] > 0 and plain["fill"] == baseline
    assert plain["load"] == plain["reuse"]
    assert plain["load"][0] == baseline[0], "a prompt with a partial last block: the same split as vLLM's own"
    assert set(plain_enc) == {"raw"}
    # Compressed: every KV block is stored encoded, the run hits as much and completes.
    assert packed_enc and all(e.startswith("fp8_e4m3 (bfloat16") for e in packed_enc), packed_enc
    assert packed["fill"] == baseline, "filling computes KV: nothing decoded yet, outputs exact"
    assert packed["hits"] == plain["hits"]
    assert all(d >= 1 for d in first_diff), f"first generated token changed: {first_diff}"
