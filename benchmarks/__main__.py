"""``python -m benchmarks`` (``make bench``): run every benchmark, then copy the tables into the docs.

Each benchmark is its own module, run in its own process one after the other (they would disturb each
other's timings), and writes ``benchmarks/results/<name>.md``; the documentation (README.md and
docs/*.md: docs/performance.md, docs/sparse.md, docs/sglang.md) shows those tables between
``<!-- bench-<name>:begin -->`` / ``end`` markers. Every figure is a ratio against a baseline measured
in the same run. ``--only NAME`` runs a subset; ``--docs-only`` (old name ``--readme-only``) only copies
the tables.
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
    "tracing_overhead": ["benchmarks.tracing_overhead"],
    "sglang": ["benchmarks.sglang_bench"],
    "sglang_serving": ["benchmarks.sglang_serving"],
}


def as_section(table: str) -> str:
    """A results file as it goes into a document: its heading lines become bold lines, so a table's own
    title never becomes a top-level heading in the middle of the page that shows it."""
    return "\n".join(
        f"**{line.lstrip('#').strip()}**" if line.startswith("#") else line for line in table.splitlines()
    )


def update_docs() -> list[str]:
    """Copy each ``benchmarks/results/<name>.md`` between its markers, in whichever document has them."""
    done = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = original = doc.read_text()
        for result in sorted(RESULTS.glob("*.md")):
            begin, end = f"<!-- bench-{result.stem}:begin -->", f"<!-- bench-{result.stem}:end -->"
            if begin in text and end in text:
                head, rest = text.split(begin, 1)
                _, tail = rest.split(end, 1)
                text = f"{head}{begin}\n{as_section(result.read_text().strip())}\n{end}{tail}"
                done.append(result.stem)
        if text != original:
            doc.write_text(text)
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=sorted(BENCHMARKS))
    p.add_argument("--docs-only", "--readme-only", dest="docs_only", action="store_true")
    args = p.parse_args()
    failed = []
    if not args.docs_only:
        for name in args.only or list(BENCHMARKS):
            started = time.monotonic()
            print(f"== {name}", file=sys.stderr, flush=True)
            code = subprocess.call([sys.executable, "-m", *BENCHMARKS[name]], cwd=ROOT)
            print(f"== {name}: exit {code} in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
            if code:
                failed.append(name)
    print(f"tables updated: {', '.join(update_docs()) or 'none'}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
