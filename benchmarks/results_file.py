"""Where a benchmark's table goes: printed, and written to ``benchmarks/results/<name>.md`` (which
``python -m benchmarks`` copies into the docs between the ``bench-<name>`` markers)."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def publish(name: str, text: str, *, write: bool = True) -> None:
    print(text)
    if write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{name}.md").write_text(text)
