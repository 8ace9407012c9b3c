"""Run the LMCache peer benchmark from the main venv and return its figures.

Why a subprocess: LMCache 0.5.6 needs torch, protobuf<7 and numpy<=2.2.6, which clash with the
daemon's own dependencies, so it lives in ``<repo>/.venv-lmcache`` (made by
``scripts/setup_lmcache.sh``) and ``lmcache_peer.py`` runs there. This module never imports lmcache;
it runs that script with that venv's interpreter and parses the one JSON object it prints. The keys
are documented in ``lmcache_peer.py``'s module docstring.

Usage (from the repo root, main venv)::

    python -m benchmarks.peers.lmcache --chunks 256 --chunk-bytes 1048576
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LMCACHE_PYTHON = REPO_ROOT / ".venv-lmcache" / "bin" / "python"
PEER_SCRIPT = Path(__file__).resolve().with_name("lmcache_peer.py")
# After a timeout the script gets SIGTERM and this long to stop its server before SIGKILL.
STOP_GRACE_S = 45.0


def run_lmcache_peer(
    chunks: int = 256,
    chunk_bytes: int = 1 << 20,
    lookup_keys: int = 2048,
    timeout_s: float = 300,
    *,
    repeat: int | None = None,
    layers: int | None = None,
) -> dict[str, float] | None:
    """Run ``lmcache_peer.py`` in LMCache's venv; its JSON figures, or None if that venv is missing.

    ``repeat`` and ``layers`` default to the script's own defaults (3 rounds; one KV layer of 8 heads
    x 128, i.e. 32 KiB contiguous pieces per block, as in a Llama-style layer).

    A missing venv is an expected state (the peer is optional and large to install), so it returns
    None with the reason logged; a peer that runs and fails is a real error and raises.

    Raises:
        TimeoutError: the run took longer than ``timeout_s`` (it was stopped, server included).
        RuntimeError: the script exited non-zero or printed no JSON; its stderr is passed through.
    """
    if not LMCACHE_PYTHON.exists():
        log.warning(
            "LMCache peer skipped: %s not found; run scripts/setup_lmcache.sh to create it", LMCACHE_PYTHON
        )
        return None
    cmd = [
        str(LMCACHE_PYTHON),
        str(PEER_SCRIPT),
        "--chunks",
        str(chunks),
        "--chunk-bytes",
        str(chunk_bytes),
        "--lookup-keys",
        str(lookup_keys),
    ]
    if repeat is not None:
        cmd += ["--repeat", str(repeat)]
    if layers is not None:
        cmd += ["--layers", str(layers)]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    log.info("running %s", " ".join(cmd))
    # stderr is inherited: the script's progress lines reach the caller's terminal as they happen.
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            # SIGTERM, not SIGKILL: the script turns it into a clean stop of the lmcache server.
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise TimeoutError(f"LMCache peer benchmark did not finish within {timeout_s:g}s") from None
        except BaseException:
            proc.send_signal(signal.SIGTERM)  # e.g. Ctrl-C here: let the script stop its server
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if proc.returncode == 130:  # the script was interrupted (Ctrl-C) and stopped its server
        raise KeyboardInterrupt("LMCache peer benchmark interrupted")
    if proc.returncode != 0:
        raise RuntimeError(f"LMCache peer benchmark exited with {proc.returncode}; see its stderr above")
    lines = [ln for ln in out.decode(errors="replace").splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError("LMCache peer benchmark printed no JSON")
    raw = json.loads(lines[-1])
    if not isinstance(raw, dict):
        raise RuntimeError(f"LMCache peer benchmark printed {type(raw).__name__}, not a JSON object")
    return {str(k): float(v) for k, v in raw.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Print the peer's JSON (for running it by hand beside our daemon's benchmark)."""
    p = argparse.ArgumentParser(description="Run the LMCache peer benchmark in .venv-lmcache.")
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--lookup-keys", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--timeout", type=float, default=300)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    figures = run_lmcache_peer(
        args.chunks, args.chunk_bytes, args.lookup_keys, args.timeout, repeat=args.repeat, layers=args.layers
    )
    if figures is None:
        return 2
    print(json.dumps(figures, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
