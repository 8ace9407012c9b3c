"""``python -m benchmarks`` (``make bench``): run every benchmark, then copy the tables into README.md.

Each benchmark is its own module, run in its own process one after the other (they would disturb each
other's timings), and writes ``benchmarks/results/<name>.md``; the README shows those tables between
``<!-- bench-<name>:begin -->`` / ``end`` markers. Every figure is a ratio against a baseline measured
in the same run. ``--only NAME`` runs a subset; ``--readme-only`` just refreshes the README.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = {
    "daemon": ["benchmarks.daemon_bench"],
    "shared_tiers": ["benchmarks.shared_tiers"],
    "load": ["benchmarks.load_bench"],
    "e2e_vllm": ["benchmarks.e2e_vllm"],
    "prefetch_vllm": ["benchmarks.prefetch_vllm"],
    "sparse": ["benchmarks.sparse_bench"],
    "sparse_vllm": ["benchmarks.sparse_vllm_bench"],
    "sparse_vllm_mha64": ["benchmarks.sparse_vllm_bench", "--geometry", "mha64"],
    "sparse_offload_vllm": ["benchmarks.sparse_offload_vllm"],
    "scale": ["benchmarks.scale_bench"],
    "small_objects": ["benchmarks.small_objects"],
    "eviction": ["benchmarks.eviction_bench"],
    "admission": ["benchmarks.admission_bench"],
    "io_classes": ["benchmarks.io_classes"],
    "encryption": ["benchmarks.encryption_bench"],
    "codec": ["benchmarks.codec_bench"],
    "sglang": ["benchmarks.sglang_bench"],
}


def update_readme() -> list[str]:
    readme = ROOT / "README.md"
    text = readme.read_text()
    done = []
    for result in sorted(RESULTS.glob("*.md")):
        begin, end = f"<!-- bench-{result.stem}:begin -->", f"<!-- bench-{result.stem}:end -->"
        if begin in text and end in text:
            head, rest = text.split(begin, 1)
            _, tail = rest.split(end, 1)
            text = f"{head}{begin}\n{result.read_text().strip()}\n{end}{tail}"
            done.append(result.stem)
    readme.write_text(text)
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=sorted(BENCHMARKS))
    p.add_argument("--readme-only", action="store_true")
    args = p.parse_args()
    failed = []
    if not args.readme_only:
        for name in args.only or list(BENCHMARKS):
            started = time.monotonic()
            print(f"== {name}", file=sys.stderr, flush=True)
            code = subprocess.call([sys.executable, "-m", *BENCHMARKS[name]], cwd=ROOT)
            print(f"== {name}: exit {code} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
            if code:
                failed.append(name)
    print(f"README tables updated: {', '.join(update_readme()) or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
